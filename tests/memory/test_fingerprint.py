"""What a kept plan or memory model depends on (`memfit.memory.fingerprint.model_state`): every change a forward
could read gives a new value; what a forward cannot tell apart (a forward run, a weight update in place, the
same state read twice) gives the same one."""
import torch
from torch import nn

from memfit.memory.fingerprint import model_state


class Config:
    scale = None


def fresh() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.1))
    m.cfg = Config()
    m.cfg.scale = 1.0
    m.table = torch.zeros(3)
    m.names = []
    m.tags = {"b", "a"}
    return m


def test_the_same_state_gives_the_same_value_and_runs_and_in_place_updates_keep_it():
    m = fresh()
    before = model_state(m)
    assert model_state(m) == before                   # read twice: equal (no ids of temporaries, sets sorted)
    m.eval()
    with torch.no_grad():
        m(torch.randn(2, 4))                          # a forward in eval mode writes nothing
    m.train()
    assert model_state(m) == before
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()                                         # in place: a plan reads the values by reference
    assert model_state(m) == before
    assert m.to(torch.float32) is m and model_state(m) == before     # a no-op move keeps every tensor


def test_two_models_of_the_same_structure_are_told_apart():
    # entries are kept per model object: a second model built the same way is another model (its own tensors)
    assert model_state(fresh()) != model_state(fresh())


def test_every_change_a_forward_may_read_gives_a_new_value():
    changes = {
        "dropout p": lambda m: setattr(m[2], "p", 0.5),
        "training flag": lambda m: m.eval(),
        "one submodule's training flag": lambda m: m[1].eval(),
        "replaced forward": lambda m: setattr(m[0], "forward", lambda x: x),
        "hook": lambda m: m[0].register_forward_hook(lambda *a: None),
        "config field": lambda m: setattr(m.cfg, "scale", 2.0),
        "tensor attribute written in place": lambda m: m.table.add_(1),
        "tensor attribute replaced": lambda m: setattr(m, "table", torch.zeros(3)),
        "parameter replaced": lambda m: setattr(m[0], "weight", nn.Parameter(torch.zeros(4, 4))),
        "parameter reshaped in place": lambda m: setattr(m[0].weight, "data", torch.zeros(8, 4)),
        "parameter dtype": lambda m: m[0].to(torch.float64),
        "every dtype": lambda m: m.half(),
        "requires_grad": lambda m: m[0].bias.requires_grad_(False),
        "buffer added": lambda m: m[0].register_buffer("mask", torch.ones(4)),
        "buffer replaced": lambda m: setattr(m[1], "running_mean", torch.zeros(4)),
        "submodule replaced": lambda m: m.__setitem__(2, nn.Dropout(0.1)),
        "submodule added": lambda m: m.append(nn.ReLU()),
        "an empty list attribute becomes a string": lambda m: setattr(m, "names", "list"),
        "an empty list attribute filled": lambda m: m.names.append("a"),
        "a set attribute grows": lambda m: m.tags.add("c"),
        "an int attribute": lambda m: setattr(m[1], "num_features", 5),
    }
    for what, change in changes.items():
        m = fresh()
        before = model_state(m)
        change(m)
        assert model_state(m) != before, what


def test_a_config_shared_by_modules_is_seen_through_each_and_a_lazy_module_is_fingerprinted():
    shared = Config()
    shared.scale = 1.0
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    m[0].cfg = m[1].cfg = shared
    before = model_state(m)
    shared.scale = 3.0
    assert model_state(m) != before
    lazy = nn.Sequential(nn.LazyLinear(4))            # no data before its first forward: still fingerprinted
    before = model_state(lazy)
    lazy(torch.randn(2, 3))
    assert model_state(lazy) != before


def test_long_containers_are_compared_by_identity_and_length():
    m = nn.Linear(2, 2)
    m.history = list(range(1000))                     # longer than fingerprint._LONG: not walked item by item
    before = model_state(m)
    m.history[5] = -1                                  # a documented limit: an item of a long list is not seen
    assert model_state(m) == before
    m.history.append(0)                                # its length is
    assert model_state(m) != before
    m.history = list(m.history)                        # so is a new list
    assert model_state(m) != before


def test_a_forward_installed_at_a_deleted_forwards_id_is_another_forward():
    # ids are reused after collection: a kept value naming the first forward by id alone would take a second one,
    # made at the same address, for the same forward
    m = nn.Linear(2, 2)
    m.forward = lambda x: x
    before, first = model_state(m), id(m.forward)
    del m.forward                                      # the only reference: the first forward is collected
    made = []
    for _ in range(10_000):
        f = (lambda x: 2 * x)
        if id(f) == first:
            break
        made.append(f)                                 # kept alive, so the next one takes another address
    assert id(f) == first                              # the precondition: CPython reused the address
    m.forward = f
    assert model_state(m) != before


def test_a_kept_value_does_not_keep_a_replaced_forward_or_the_model_alive():
    import gc
    import types
    import weakref
    m = nn.Linear(2, 2)
    m.forward = types.MethodType(lambda self, x: x, m)   # a bound forward holds the model
    kept = model_state(m)
    forward, model = weakref.ref(m.forward), weakref.ref(m)
    del m
    gc.collect()
    assert forward() is None and model() is None and kept != kept


def test_describe_change_names_what_changed():
    from memfit.memory.fingerprint import describe_change
    cases = {
        "parameter '0.bias' no longer requires grad": lambda m: m[0].bias.requires_grad_(False),
        "parameter '0.weight' was replaced": lambda m: setattr(m[0], "weight", nn.Parameter(torch.zeros(4, 4))),
        "module '2' was replaced by another module": lambda m: m.__setitem__(2, nn.Dropout(0.1)),
        "module '1' was switched to eval mode": lambda m: m[1].eval(),
        "attribute 'p' of module '2' changed": lambda m: setattr(m[2], "p", 0.5),
        "attribute 'forward' of module '0' changed": lambda m: setattr(m[0], "forward", lambda x: x),
        "modules were added or removed (4 modules then, 5 now)": lambda m: m.append(nn.ReLU()),
    }
    for said, change in cases.items():
        m = fresh()
        before = model_state(m)
        assert describe_change(before, m) is None
        change(m)
        assert describe_change(before, m) == said
