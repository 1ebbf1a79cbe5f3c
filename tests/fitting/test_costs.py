"""memfit.fitting.costs: what a step's ops are, counted on fake tensors, against a real step of the same model; the
sizes each kernel is timed at against fake runs at those sizes; and the order of predictions whose true order is
known by construction."""
import collections

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
from memfit.errors import FakeRunError
from memfit.fitting import costs, host
from memfit.fitting.search import Setting, step_seconds

DEV = torch.device("cpu")


def mlp(dropout=0.0):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(dropout), nn.LayerNorm(16),
                                         nn.Linear(16, 8)) for _ in range(2)])


class RealOps(TorchDispatchMode):
    """The reference: the ops a real step dispatches, by phase."""

    def __init__(self):
        super().__init__()
        self.phase, self.ops = "forward", collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        backward = self.phase == "forward" and torch._C._current_graph_task_id() != -1
        self.ops["backward" if backward else self.phase].append(func)
        return func(*args, **(kwargs or {}))


OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1),
              "adam amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True),
              "sgd momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.1, momentum=0.5),
              "adamw tensor lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.1)),
              "refuses foreach": lambda ps: NoForeach(ps, lr=0.1, momentum=0.9)}


class NoForeach(torch.optim.SGD):
    """An optimizer of another library: a `foreach` option whose multi-tensor path refuses these groups."""

    def step(self, closure=None):
        if any(g["foreach"] for g in self.param_groups):
            raise RuntimeError("foreach is not supported here")
        return super().step(closure)


@pytest.mark.parametrize("stepped, optimizer", [(False, "adamw"), (True, "adamw"), (False, "adam amsgrad"),
                                                (False, "sgd momentum"), (False, "rmsprop"),
                                                (False, "adamw tensor lr"), (False, "refuses foreach")])
def test_the_ops_counted_are_the_ops_a_real_step_dispatches(stepped, optimizer):
    """Forward, backward and the optimizer step: the same ops in the same order as a real step of the model (fake
    tensors dispatch `prim` ops for attributes, and autograd detaches what the saved-tensor count's hook unpacks:
    neither is an op of a real step). An optimizer without state yet: its state-making first step is not counted
    (it runs on the multi-tensor kernels: the state it makes must be the one the counted step reads)."""
    model, (x, y) = mlp(), (torch.randn(4, 8), torch.randn(4, 8))
    opt = OPTIMIZERS[optimizer](model.parameters())
    groups = [dict(g) for g in opt.param_groups]
    if stepped:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    counted = costs._count(model, x, y, F.mse_loss, ["0", "1"], None, DEV, opt)
    assert opt.param_groups == groups and (stepped or not opt.state)       # the optimizer as it was
    if not stepped:                               # the reference steps over existing state, as counted
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    real = RealOps()
    with real:
        F.mse_loss(model(x), y).backward()
        real.phase = "optimizer"
        opt.step()
        opt.zero_grad()
    for phase in ("forward", "backward", "optimizer"):
        assert [o.func for o in counted.ops if o.phase == phase] == real.ops[phase], phase



def test_the_adds_counted_for_a_later_micro_batch_are_those_its_real_backward_dispatches_beyond_the_first():
    """A micro-batch after the first (gradients held) runs what the first does and AccumulateGrad's add of each
    gradient into the one held: counted apart (phase "accumulate"), one add per trainable parameter, on its shape."""
    model, (x, y) = mlp(), (torch.randn(4, 8), torch.randn(4, 8))
    model[0][3].weight.requires_grad_(False)                   # a frozen parameter: no gradient, no add
    counted = costs._count(model, x, y, F.mse_loss, ["0", "1"], None, DEV, adds=True)
    first, later = RealOps(), RealOps()
    with first:
        F.mse_loss(model(x), y).backward()
    with later:
        F.mse_loss(model(x), y).backward()                     # into the gradients held
    extra = collections.Counter(later.ops["backward"]) - collections.Counter(first.ops["backward"])
    adds = [o for o in counted.ops if o.phase == "accumulate"]
    assert collections.Counter(o.func for o in adds) == extra and sum(extra.values()) == 11     # 12 less 1 frozen
    trainable = sorted(tuple(p.shape) for p in model.parameters() if p.requires_grad)
    assert sorted(o.spec.leaves[0][1] for o in adds) == trainable
    assert [o.func for o in counted.ops if o.phase == "backward"] == first.ops["backward"]


def test_each_blocks_saved_tensors_are_those_autograd_saves_in_its_forward():
    model, (x, y) = mlp(), (torch.randn(4, 8), torch.randn(4, 8))
    counted = costs._count(model, x, y, F.mse_loss, ["0", "1"], None, DEV)
    saved, inside = {"0": 0, "1": 0}, []
    for name in saved:
        model[int(name)].register_forward_pre_hook(lambda m, a, _n=name: inside.append(_n))
        model[int(name)].register_forward_hook(lambda m, a, o: inside.clear())

    def pack(t):
        for name in inside:
            saved[name] += 1
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    assert counted.saved == saved and saved["0"] > 0
    assert saved["0"] < saved["1"]          # the first block's input needs no gradient: one tensor fewer


@pytest.mark.parametrize("m", [1, 3, 8])
def test_the_shapes_each_kernel_is_timed_at_are_a_fake_run_at_that_size(m):
    """The arguments a kernel is timed on at micro-batch m, read off the runs at 2 and 4 (which dimensions carry
    the batch), are those of the same op in a fake run at m."""
    model, (x, y) = mlp(), (torch.randn(4, 8), torch.randn(4, 8))
    runs = {k: costs._count(model, costs._at(x, k), costs._at(y, k), F.mse_loss, [], None, DEV) for k in (2, 4, m)}
    ops = costs._sized(runs[2], 2, runs[4], 4)
    direct = [o for o in runs[m].ops if o.phase in ("forward", "backward")]
    assert len(direct) == len(ops)
    shape = lambda leaf: leaf[1] if isinstance(leaf, tuple) and len(leaf) == 4 and leaf[0] == "t" else leaf
    for o, d in zip(ops, direct, strict=True):
        assert o.op.func == d.func
        key, scale = o.kernel(m)
        if o.op.view:
            assert key is None
            continue
        at = dict(key[2])
        assert [at.get(i, shape(lf)) for i, lf in enumerate(o.op.spec.leaves)] == [shape(lf) for lf in d.spec.leaves]
        assert scale == 1.0


def test_a_kernel_too_large_to_time_is_timed_at_a_halved_batch_or_priced(monkeypatch):
    model, (x, y) = mlp(), (torch.randn(4, 8), torch.randn(4, 8))
    runs = {k: costs._count(model, costs._at(x, k), costs._at(y, k), F.mse_loss, [], None, DEV) for k in (2, 4)}
    ops = costs._sized(runs[2], 2, runs[4], 4)
    mm = next(o for o in ops if o.op.func is torch.ops.aten.addmm.default)     # bias, (m, 8) input, weight
    per_sample = 8 * 4                        # bytes of the input's row; bias and weight stay
    fixed = costs.spec_bytes(mm.op.spec, {}) - 4 * per_sample
    monkeypatch.setattr(costs, "CAP", fixed + 3 * per_sample)       # 3 samples fit, 16 do not
    key, scale = mm.kernel(16)
    assert dict(key[2])[1] == (2, 8) and scale == 8.0                # 16 -> 8 -> 4 -> 2: timed at 2, times 8
    monkeypatch.setattr(costs, "CAP", fixed - 1)                     # not even one sample fits: priced
    assert mm.kernel(16) == (None, 1.0)
    assert mm.roofline(16, DEV) > 0


def test_counting_and_timing_leave_torchs_generator_alone_while_dropout_is_timed():
    model, (x, y) = mlp(dropout=0.3), (torch.randn(4, 8), torch.randn(4, 8))
    torch.manual_seed(5)
    state = torch.get_rng_state()
    step, blocks, _, _ = costs.step_costs(model, x, y, F.mse_loss, ["0", "1"], sizes=[1, 4])
    assert torch.equal(state, torch.get_rng_state())
    counted = costs._count(model, x, y, F.mse_loss, [], None, DEV)
    assert any(torch.Tag.nondeterministic_seeded in o.func.tags for o in counted.ops)     # a random op was timed
    assert step.kernel_seconds(4) > 0 and blocks["0"].kernel_seconds(1) > 0


def test_predicted_order_of_settings_whose_true_order_is_known_by_construction():
    """Checkpointing a block of three 256-wide layers recomputes about 1000x the arithmetic of a block of one 8-wide
    layer, with as many ops and fewer tensors saved per op: its step is predicted slower. Eight micro-batches
    of one sample run every op eight times for the same arithmetic: predicted slower than one of eight."""
    torch.manual_seed(0)
    heavy = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    light = nn.Sequential(nn.Linear(256, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 256))
    model = nn.Sequential(heavy, light)
    x, y = torch.randn(8, 256), torch.randn(8, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step, blocks, once, _ = costs.step_costs(model, x, y, F.mse_loss, ["0", "1"], sizes=[1, 8], optimizer=opt)
    machine = host.machine(DEV)
    at = lambda m, s: step_seconds(8, m, step, blocks, Setting(s), machine, once)
    assert at(8, ("0",)) > at(8, ("1",)) > at(8, ())
    assert at(1, ()) > at(8, ())


def test_a_sparse_gradient_is_refused_by_fit_naming_the_fix():
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = nn.Embedding(100, 8, sparse=True), nn.Linear(8, 2)

        def forward(self, ids):
            return self.lin(self.emb(ids)).mean(1)
    torch.manual_seed(0)
    model = Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, y = torch.randint(0, 100, (8, 4)), torch.randn(8, 2)
    with pytest.raises(ValueError, match=r"sparse_coo tensor \(in backward\).*sparse=False"):
        memfit.fit(model, opt, (ids, y), F.mse_loss, budget="1GiB")
    assert all(p.grad is None for p in model.parameters())                    # nothing half-done


def test_a_blocks_dropped_cost_is_what_its_dropout_modules_run():
    """`Cost.dropped` of a block: the ops its Dropout modules' forwards dispatch (the reference: a real Dropout on a
    tensor of the block's shapes), which fit's trials leave out (Dropout at p = 0 there); none for a block without
    one, nor anything of the block's other ops."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.GELU(), nn.Dropout(0.25),
                                        nn.Linear(16, 8)),
                          nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    _, blocks, _, _ = costs.step_costs(model, x, y, F.mse_loss, ["0", "1"])
    real, h = RealOps(), torch.randn(4, 16, requires_grad=True)
    with real:
        nn.Dropout(0.5)(h)
    per_dropout = len(real.ops["forward"])
    assert per_dropout >= 2                                        # the mask drawn, the product (at least)
    assert blocks["0"].dropped.ops == 2 * per_dropout
    assert blocks["0"].dropped.kernel_seconds(4) > 0
    assert blocks["0"].dropped.ops < blocks["0"].ops
    assert blocks["1"].dropped.ops == 0 and blocks["1"].dropped.kernel_seconds(4) == 0


class MaskedSGD(torch.optim.SGD):
    """An SGD whose step takes the gradients' nonzero entries (`g[g != 0]`): a size made from values."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad[p.grad != 0].mean())


def test_fit_with_an_optimizer_that_makes_a_size_from_values_is_refused_by_name_and_leaves_everything_as_found():
    """A step that takes the gradients' nonzero entries cannot run on fake tensors (a scalar read is answered,
    `test_value_reads`; a size is not): fit says so, naming the optimizer and what to do instead (it raised torch's
    bare exception), and changes nothing."""
    model = mlp()
    opt = MaskedSGD(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FakeRunError, match=r"MaskedSGD\.step\(\) makes a size from tensor values.*measure_step.*"
                                           r"accumulate"):
        memfit.fit(model, opt, (torch.randn(8, 8), torch.randn(8, 8)), F.mse_loss, "1MiB")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not opt.state and all(p.grad is None for p in model.parameters())
    # the memory model names the step as the cause too, and what it offers (optimizer=None) works
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(FakeRunError, match=r"MaskedSGD\.step\(\) makes a size from tensor values.*optimizer=None") \
            as err:
        memfit.memory_model(model, x, train=True, optimizer=opt, loss_fn=F.mse_loss, target=y)
    assert "control flow" not in str(err.value)
    assert memfit.memory_model(model, x, train=True, optimizer=None, loss_fn=F.mse_loss, target=y).total_bytes(8) > 0


def _transformers_4x_mask_check():
    """transformers 4.x's `_ignore_causal_mask_sdpa` as it asks (`if torch.all(mask == 1)`), made in a module named
    as transformers' own, where the fake runs look for it (transformers 5.x, installed here, does not ask)."""
    import types
    module = types.ModuleType("transformers.memfit_test_masks")
    exec("import torch\n"
         "def _ignore_causal_mask_sdpa(mask):\n"
         "    return bool(torch.all(mask == 1))\n", module.__dict__)
    return module._ignore_causal_mask_sdpa


class MaskAsked(nn.Module):
    """A layer whose forward asks transformers 4.x's mask question and builds the mask where it is not all ones."""

    def __init__(self):
        super().__init__()
        self.lin, self.ask = nn.Linear(8, 8), _transformers_4x_mask_check()

    def forward(self, x):
        mask = (x[..., 0] > -10).long()                        # (batch, seq): all ones for real
        h = self.lin(x)
        if not self.ask(mask):
            h = h + (1 - mask[:, None, :] * mask[:, :, None]).float().sum(-1, keepdim=True)
        return h


def test_transformers_4x_mask_question_is_answered_no_in_the_op_counting_as_in_the_memory_model():
    """Under transformers 4.46 fit failed on a Llama with an attention mask: the op counting's fake run had no
    answer to `_ignore_causal_mask_sdpa`'s `torch.all(mask == 1)` (DataDependentOutputException) where the memory
    model answers it no (the mask counts). Both answer alike now: the counted step holds the mask's ops."""
    import warnings
    model = MaskAsked()
    x, y = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step, _, _, _ = costs.step_costs(model, x, y, F.mse_loss, [])
        plan = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), F.mse_loss, "1GiB")
    # the reference: the same model with the question's ops run and its answer given by hand, no (the mask built)
    # and yes (skipped); the asked run has one op more, the read itself
    built, skipped = MaskAsked(), MaskAsked()
    built.ask = lambda mask: (torch.all(mask == 1), False)[1]
    skipped.ask = lambda mask: (torch.all(mask == 1), True)[1]
    counts = {k: costs.step_costs(m, x, y, F.mse_loss, [])[0].ops for k, m in (("no", built), ("yes", skipped))}
    assert step.ops == counts["no"] + 1 and counts["no"] > counts["yes"], (step.ops, counts)
    assert plan.micro_batch in (1, 2, 4)
