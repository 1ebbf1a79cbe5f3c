"""`State.holds` (plan.step's check, once a step) against what it stands for, `model_state(model) == state`, over random
changes to random small models: it may say False where the value would still be equal (then the caller compares the
value), never True where the value differs; and it says True after what keeps every object (so the check is the quick
one, not always False)."""
import collections
import enum
import itertools
import types
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from memfit.memory import fingerprint_check
from memfit.memory.fingerprint import describe_change, model_state


@pytest.fixture(params=["dict versions", "every attribute", "tensors read in Python"])
def path(request, monkeypatch):
    """Every way `holds` compares: skipping what no dict write changed (torch's dict versions), and in full (where
    torch has no version reader, or a dict was written); the tensors' properties by torch's C++ check, or (where torch
    has none) read in Python."""
    if request.param == "every attribute":
        monkeypatch.setattr(fingerprint_check, "_dict_version", lambda: None)
    if request.param == "tensors read in Python":
        monkeypatch.setattr(fingerprint_check, "tensor_checker", lambda tensors: None)
    return request.param


class Config:
    """A config object several modules hold (as `transformers` layers hold theirs): its fields are compared."""

    def __init__(self):
        self.scale, self.act, self.sizes, self.dims = 1.0, "gelu", (2, 3), torch.Size([2, 3])
        self.id2label, self.names, self.tags, self.empty = {0: "a", 1: "b"}, ["x", "y"], {"p", "q"}, []
        self.inner = types.SimpleNamespace(depth=1)


class Mode(enum.Enum):
    A = 1
    B = 2


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.cfg, self.p, self.kernel, self.mode = cfg, 0.1, (1, 1), Mode.A
        self.names, self.table, self.labels = ["a"], torch.zeros(2), {"k": 1}

    def forward(self, x):
        return self.fc(x) * self.cfg.scale


class Options:
    """A config object with no fields yet."""


def model(kinds: list[int]) -> nn.Module:
    cfg = Config()
    parts = [[nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Dropout(0.1), nn.ReLU(), Block(cfg),
              nn.Sequential(nn.Linear(3, 3), nn.Tanh())][k] for k in kinds]
    m = nn.Sequential(*parts)
    m.cfg, m.options = cfg, Options()
    return m


def _first(m, kind):
    return next((x for x in m.modules() if isinstance(x, kind)), None)


def _other_float(v):
    return float(str(v))                      # equal, another object (not quick, still equal)


# (name, change, keeps every object): a change that keeps every object must leave `holds` True
CHANGES = [
    ("forward and optimizer step", lambda m: _step(m), True),
    ("eval and back", lambda m: (m.eval(), m.train()), True),
    ("same object set again", lambda m: setattr(m, "cfg", m.cfg), True),
    ("set to another object and back", lambda m: _and_back(m), True),
    ("a forward set on the instance and removed (plan.step's checkpointing)",
     lambda m: (setattr(m[-1], "forward", m[-1].forward), vars(m[-1]).pop("forward")), True),
    ("a parameter set to None and back", lambda m: _on_linear(m, lambda x: (
        KEPT.append(x.bias), x.register_parameter("bias", None), x.register_parameter("bias", KEPT[-1]))), True),
    ("parameter set again", lambda m: setattr(m[0], "weight", m[0].weight) if hasattr(m[0], "weight") else None, True),
    ("training flag", lambda m: m.eval(), False),
    ("one module's flag", lambda m: m[-1].eval(), False),
    ("dropout p", lambda m: [setattr(x, "p", 0.5) for x in m.modules() if isinstance(x, nn.Dropout)], False),
    ("config field", lambda m: setattr(m.cfg, "scale", 2.0), False),
    ("config field, equal float", lambda m: setattr(m.cfg, "scale", _other_float(m.cfg.scale)), False),
    ("config field added", lambda m: setattr(m.cfg, "extra", 1), False),
    ("a config with no fields given some by update", lambda m: vars(m.options).update({"x": 1}), False),
    ("config field deleted and set again (order)", lambda m: (delattr(m.cfg, "scale"), setattr(m.cfg, "scale", 1.0)),
     False),
    ("config's class", lambda m: setattr(m.cfg, "__class__", type("Other", (Config,), {})), False),
    ("config dict in place", lambda m: m.cfg.id2label.__setitem__(0, "z"), False),
    ("config dict grows", lambda m: m.cfg.id2label.__setitem__(2, "c"), False),
    ("config list in place", lambda m: m.cfg.names.__setitem__(1, "z"), False),
    ("config set grows", lambda m: m.cfg.tags.add("r"), False),
    ("config set swapped element", lambda m: (m.cfg.tags.discard("p"), m.cfg.tags.add("s")), False),
    ("config empty list filled", lambda m: m.cfg.empty.append(1), False),
    ("config tuple replaced", lambda m: setattr(m.cfg, "sizes", (2, 4)), False),
    ("config Size replaced", lambda m: setattr(m.cfg, "dims", torch.Size([2, 4])), False),
    ("config nested object's field (not compared)", lambda m: setattr(m.cfg.inner, "depth", 2), False),
    ("config a float becomes a 0-d tensor", lambda m: setattr(m.cfg, "scale", torch.tensor(float(m.cfg.scale))), False),
    ("config replaced by an equal one", lambda m: [setattr(x, "cfg", Config()) for x in m.modules()
                                                   if "cfg" in vars(x)], False),
    ("a float becomes a 0-d tensor", lambda m: _on_block(m, lambda b: setattr(b, "p", torch.tensor(float(b.p)))),
     False),
    ("a tuple becomes a list", lambda m: _on_block(m, lambda b: setattr(b, "kernel", list(b.kernel))), False),
    ("an enum", lambda m: _on_block(m, lambda b: setattr(b, "mode", Mode.B)), False),
    ("module list attribute in place", lambda m: _on_block(m, lambda b: b.names.append("b")), False),
    ("module dict attribute in place", lambda m: _on_block(m, lambda b: b.labels.__setitem__("k", 2)), False),
    ("tensor attribute in place", lambda m: _on_block(m, lambda b: b.table.add_(1)), False),
    ("tensor attribute replaced", lambda m: _on_block(m, lambda b: setattr(b, "table", torch.zeros(2))), False),
    ("attribute deleted and set again (order)",
     lambda m: _on_block(m, lambda b: (delattr(b, "p"), setattr(b, "p", 0.1))), False),
    ("attribute renamed, same value", lambda m: _on_block(m, lambda b: (setattr(b, "q", b.p), delattr(b, "p"))), False),
    ("hook", lambda m: m[0].register_forward_hook(lambda *a: None), False),
    ("pre-hook on the last", lambda m: m[-1].register_forward_pre_hook(lambda *a: None), False),
    ("hook dict replaced by an empty plain dict", lambda m: setattr(m[0], "_forward_hooks", {}), False),
    ("hook dict replaced by another empty one", lambda m: setattr(m[0], "_forward_hooks", collections.OrderedDict()),
     False),
    ("forward replaced", lambda m: setattr(m[0], "forward", lambda x: x), False),
    ("requires_grad", lambda m: _on_parameter(m, lambda p: p.requires_grad_(False)), False),
    ("parameter storage swapped", lambda m: _on_parameter(m, lambda p: setattr(p, "data", p.data.clone())), False),
    ("parameter dtype", lambda m: m.double(), False),
    ("parameter replaced", lambda m: _replace_parameter(m), False),
    ("buffer added", lambda m: m[0].register_buffer("mask", torch.ones(3)), False),
    ("submodule replaced", lambda m: m.__setitem__(0, nn.Linear(3, 3)), False),
    ("submodule appended", lambda m: m.append(nn.ReLU()), False),
    ("submodule deleted (Sequential renumbers into an OrderedDict)", lambda m: m.__delitem__(0) if len(m) > 1 else None,
     False),
    ("submodule inserted", lambda m: m.insert(0, nn.Identity()), False),
    ("two submodules swapped", lambda m: _swap(m), False),
    ("parameter replaced by one on the same storage (the old kept)", lambda m: _on_linear(m, lambda x: (
        KEPT.append(x.weight), setattr(x, "weight", nn.Parameter(x.weight.data)))), False),
    ("config replaced by an equal one (the old kept)", lambda m: [(KEPT.append(x.cfg), setattr(x, "cfg", _plain(x.cfg)))
                                                                  for x in m.modules() if "cfg" in vars(x)], False),
    ("a parameter set to None", lambda m: _on_linear(m, lambda x: x.register_parameter("bias", None)), False),
]


KEPT = []             # objects a change replaced, kept alive: then only their identity tells them apart


def _and_back(m):
    was = m.cfg
    m.cfg = Config()
    m.cfg = was                              # the dict written twice: its version moved, its values are as they were


def _swap(m):
    keys = list(m._modules)
    m._modules[keys[0]], m._modules[keys[-1]] = m._modules[keys[-1]], m._modules[keys[0]]


def _plain(cfg):
    new = Config()
    new.__dict__ = {k: v for k, v in vars(cfg).items()}     # the same field objects
    return new


def _step(m):
    params = list(m.parameters())
    out = m(torch.randn(4, 3, dtype=params[0].dtype if params else torch.float32))
    if params and out.requires_grad:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        out.sum().backward()
        opt.step()


def _on_block(m, f):
    b = _first(m, Block)
    if b is not None:
        f(b)


def _on_parameter(m, f):
    p = next(m.parameters(), None)
    if p is not None:
        f(p)


def _on_linear(m, f):
    x = _first(m, nn.Linear)
    if x is not None:
        f(x)


def _replace_parameter(m):
    x = _first(m, nn.Linear)
    if x is not None:
        x.weight = nn.Parameter(x.weight.detach().clone())


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.integers(0, 5), min_size=1, max_size=4),
       changes=st.lists(st.integers(0, len(CHANGES) - 1), min_size=0, max_size=3))
def test_holds_is_true_only_where_model_state_is_equal(path, kinds, changes):
    m = model(kinds)
    before = model_state(m)
    assert before.quick is not None and before.holds(m)
    for c in changes:
        CHANGES[c][1](m)
    what = [CHANGES[c][0] for c in changes]
    if before.holds(m):
        assert model_state(m) == before, what
    if all(CHANGES[c][2] for c in changes):
        assert before.holds(m), what                  # nothing replaced: the quick check says so
        full, written = fingerprint_check.Quick._same, fingerprint_check.Quick._moved
        with (mock.patch.object(fingerprint_check.Quick, "_same", autospec=True, side_effect=full) as compared,
              mock.patch.object(fingerprint_check.Quick, "_moved", autospec=True, side_effect=written) as moved):
            assert before.holds(m), what              # and again, now comparing no attribute (the dicts' versions,
        assert compared.call_count == (path == "every attribute") and moved.call_count == 0, what   # taken again)
    after = model_state(m)
    assert after.quick is not None and after.holds(m), what     # the new value is quick too


def test_every_change_above_is_seen_on_a_model_with_all_parts(path):
    """Each change on a model holding every kind of part: `holds` says False wherever `model_state` changes (the
    property test draws few of them together; this takes each once)."""
    for what, change, keeps in CHANGES:
        m = model([0, 1, 2, 3, 4, 5])
        before = model_state(m)
        change(m)
        equal = model_state(m) == before
        assert not before.holds(m) or equal, what
        if keeps:
            assert equal and before.holds(m), what


def test_the_changes_above_are_changes():
    # the catalogue is a test of something: all but the no-ops, an equal value in another object and what model_state
    # does not look into change the value
    equal = {"config nested object's field (not compared)", "hook dict replaced by another empty one",
             "config field, equal float"}
    for what, change, keeps in CHANGES:
        m = model([0, 1, 2, 3, 4, 5])
        before = model_state(m)
        change(m)
        assert (model_state(m) == before) == (keeps or what in equal), what


def test_the_check_reads_no_module_twice():
    # the flat lists the check compares are as long as the model's attributes (one entry each): nothing walked twice
    m = model([4, 4, 5])
    q = model_state(m).quick
    assert q.count == sum(len(vars(x)) for x in m.modules())
    assert len(q.own_refs) == sum(len(d) for x in m.modules() for d in (x._modules, x._parameters, x._buffers))
    assert len(list(itertools.chain(m.parameters(), m.buffers()))) == len(q.tensors[0])


def test_torch_has_the_dict_version_reader_the_quick_check_uses():
    # without it every check compares every attribute (right, 2-4x slower: ResNet-50's 4,200); a torch without
    # `torch._C._dynamo.guards.dict_version`, or whose reader misses a write, lands here
    assert fingerprint_check._dict_version() is not None


def test_a_class_swapped_on_a_module_is_a_change():
    """`m.__class__ = Other` keeps the object, its attributes and tensors, and gives it another forward: a kept plan
    or memory model of the model before must not be taken for the model now, by the quick check or the full one."""
    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    before = model_state(model)
    assert before.holds(model)
    model[0].__class__ = Doubled
    assert not before.holds(model) and model_state(model) != before
    assert describe_change(before, model) == "the class of module '0' changed (now Doubled)"
    model[0].__class__ = torch.nn.Linear
    assert before.holds(model) and model_state(model) == before


class _TwoByName(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.w1, self.w2 = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.b(self.a(x)) * self.w1 + self.w2


def _rename_modules(m):          # the same objects in the same order, under each other's names
    a, b = m.a, m.b
    del m.a, m.b
    m.b, m.a = a, b


def _rename_parameters(m):
    w1, w2 = m.w1, m.w2
    del m.w1, m.w2
    m.w2, m.w1 = w1, w2


def test_submodules_or_parameters_renamed_in_the_same_order_are_a_change():
    """`self.a` reads by name: two submodules (or parameters) swapped by deleting and setting them again keep the
    objects and their order in `_modules` (`_parameters`) and give another forward; the value listed the objects
    only, so a kept plan was taken for the new model (both the quick check and `model_state ==`). Checked with and
    without a step's write to the module's `__dict__` (the quick check's dict-version way and its full one)."""
    x = torch.randn(3, 4)
    for rename in (_rename_modules, _rename_parameters):
        for step in (False, True):
            torch.manual_seed(0)
            m = _TwoByName()
            before = model_state(m)
            with torch.no_grad():
                y = m(x)
            rename(m)
            if step:
                m.a.forward = m.a.forward
                del m.a.forward
            with torch.no_grad():
                assert not torch.equal(m(x), y)          # the forward differs
            assert model_state(m) != before
            assert not before.holds(m)
            assert "names" in describe_change(before, m)


def test_a_parameter_transposed_in_place_through_data_is_a_change():
    """`w.data = w.data.t()` on a square weight keeps its storage, shape and dtype and changes what the forward
    computes: its strides are part of what a kept plan depends on, for the quick check and the full one."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
    before = model_state(model)
    model[0].weight.data = model[0].weight.data.t()
    assert not before.holds(model) and model_state(model) != before
    assert "strides" in describe_change(before, model)
    model[0].weight.data = model[0].weight.data.t()
    assert before.holds(model)


def test_the_tensor_checker_sees_each_property_it_is_used_for():
    w, b = torch.nn.Parameter(torch.ones(4, 4)), torch.zeros(3)
    check = fingerprint_check.tensor_checker([w, b])
    assert check(w, b)
    changes = [(lambda: w.requires_grad_(False), lambda: w.requires_grad_(True)),
               (lambda: setattr(w, "data", w.data.t()), lambda: setattr(w, "data", w.data.t())),
               (lambda: b.resize_(4), lambda: b.resize_(3)),
               (lambda: setattr(w, "data", w.data.double()), lambda: setattr(w, "data", w.data.float()))]
    for change, undo in changes:
        change()
        assert not check(w, b)
        undo()
        assert check(w, b)
    assert not check(torch.ones(4, 4, requires_grad=True), b)      # a plain tensor for the parameter: other keys
    assert fingerprint_check.tensor_checker([]) is None


@pytest.mark.parametrize("change", ["requires_grad", "transposed", "resized", "dtype"])
def test_the_tensors_are_checked_by_torch_and_again_where_it_says_no(change):
    """The parameters' and buffers' properties by torch's C++ check (`tensor_checker`) when it passes, each change
    seen by it; where it says no for another reason (an autocast around the check, which it compares too), read in
    Python: the model as it was still holds."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.register_buffer("scale", torch.ones(3))
    before = model_state(model)
    assert before.quick.checker is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert before.holds(model)
    w = model[0].weight
    undo = {"requires_grad": lambda: w.requires_grad_(False), "transposed": lambda: setattr(w, "data", w.data.t()),
            "resized": lambda: model.scale.resize_(4), "dtype": lambda: setattr(w, "data", w.data.double())}
    undo[change]()
    assert not before.holds(model) and model_state(model) != before


class _CallableDict(dict):
    def __call__(self, x):
        return x * self["scale"]


class _CallableList(list):
    def __call__(self, x):
        return x


class _CallableTensor(torch.Tensor):
    def __call__(self, x):
        return x


@pytest.mark.parametrize("make, change", [
    (lambda: _CallableDict(scale=1.0), lambda v: v.__setitem__("scale", 2.0)),
    (lambda: _CallableList([1, 2]), lambda v: v.append(3)),
    (lambda: torch.zeros(2).as_subclass(_CallableTensor), lambda v: v.add_(1))],
    ids=["dict", "list", "tensor"])
def test_a_callable_container_or_tensor_changed_in_place_is_a_change(path, make, change):
    """A module attribute that is a container or a tensor and callable too (a dict subclass with __call__): the full
    value records its contents, and the quick check compared only its class, so holds said True after a change
    (found by a cold review)."""
    m = nn.Linear(2, 2)
    m.extra = make()
    before = model_state(m)
    assert before.holds(m)
    change(m.extra)
    assert model_state(m) != before and not before.holds(m)
