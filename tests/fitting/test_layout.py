"""plan.step refuses a batch larger than the plan's in any dimension (its step could exceed the plan silently),
and runs smaller ones; checked against the real peak of the same step at the allocator."""
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.accumulation.run import Walked
from memfit.device.measure import optimizer_state, track_memory, unique_bytes
from memfit.fitting.layout import apart as layout_apart


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)) for _ in range(2)])


def _real_peak(model, opt, batch, micro_batch) -> int:
    """Live bytes at the peak of two of accumulate's steps (what plan.step runs) from no gradients, held bytes
    included: the second holds the first's gradients on entry, the steady state a plan is made for."""
    opt.zero_grad(set_to_none=True)
    held = unique_bytes([*model.parameters(), *optimizer_state(opt), *batch])
    with track_memory("cpu") as mem:
        for _ in range(2):
            memfit.accumulate(model, opt, batch, F.mse_loss, micro_batch=micro_batch)
    return held + mem.peak


def test_step_refuses_a_batch_larger_than_the_plans_and_runs_smaller_ones():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)
    plan = memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB")
    wider = (torch.randn(24, 3, 16, generator=g), torch.randn(24, 3, 16, generator=g))    # 3 rows per sample
    more = (torch.randn(48, 16, generator=g), torch.randn(48, 16, generator=g))
    for batch in (wider, more):            # each would run above the plan's peak: it ran before, silently
        assert _real_peak(model, opt, batch, plan.micro_batch) > plan.peak_bytes
    with pytest.raises(ValueError, match=r"x is \(3, 16\) per sample .* made for \(16,\) per sample"):
        plan.step(wider)
    with pytest.raises(ValueError, match="holds 48 samples on the model's device; the plan was made for 24"):
        plan.step(more)
    with pytest.raises(ValueError, match=r"y is \(16,\) per sample \(torch.float64\)"):
        plan.step((x, y.double()))
    assert plan.step((x[:10], y[:10])).n == 10             # a shorter last batch runs
    assert plan.step([x, y]).n == 24                         # a list is the same layout as the tuple fit saw


def test_a_plan_made_on_a_tensor_given_twice_holds_for_batches_of_two():
    """An autoencoder fit on (x, x) (or a causal LM on labels=input_ids) is stepped later on batches whose two
    tensors are apart (a collator's labels = input_ids.clone()): the plan counts them as two, so that it holds there
    (counted once, such a step ran above the plan's peak: refused it would stop the user's loop instead)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    plan = memfit.fit(model, opt, (x, x), F.mse_loss, "1GiB")
    apart = _real_peak(model, opt, (x, x.clone()), plan.micro_batch)
    assert apart <= plan.peak_bytes <= apart * 1.001
    assert _real_peak(model, opt, (x, x), plan.micro_batch) < apart         # the same tensor twice: less
    assert plan.step((x, x.clone())).n == 24 and plan.step((x, x)).n == 24 and plan.step((x[:10], x[:10])).n == 10
    ids = torch.randint(0, 50, (24, 8))
    named = namedtuple("Named", "a b")(ids, ids)
    got_x = layout_apart((named, {"labels": ids}), None)[0]
    assert got_x[0].a is ids and got_x[0].b is not ids and torch.equal(got_x[0].b, ids)    # a copy after the first
    assert got_x[1]["labels"] is not ids and type(got_x[0]).__name__ == "Named"


def test_step_lets_shorter_sequences_through_a_plan_for_dict_inputs():
    torch.manual_seed(0)
    lm = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids):
            return self.lm(input_ids)
    model = Tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = lambda out, y: F.cross_entropy(out.transpose(1, 2), y)
    ids = torch.randint(0, 50, (8, 12))
    plan = memfit.fit(model, opt, ({"input_ids": ids}, ids), loss, "1GiB")
    assert plan.step(({"input_ids": ids[:, :6]}, ids[:, :6])).n == 8
    with pytest.raises(ValueError, match=r"x\['input_ids'\] is \(24,\) per sample"):
        plan.step(({"input_ids": ids.repeat(1, 2)}, ids.repeat(1, 2)))
    with pytest.raises(ValueError, match=r"the batch lacks x\['input_ids'\]; has x\['ids'\] beside what the plan "
                                         r"was made for: it holds x\['ids'\] a tensor of \(12,\) per sample "
                                         r"\(torch.int64\); "
                                         r"y .*; the plan was made for x\['input_ids'\] a tensor .* "
                                         r"\(in that structure: a tuple of 2 \(a dict of input_ids, a tensor\), "
                                         r"found a tuple of 2 \(a dict of ids, a tensor\)\)"):
        plan.step(({"ids": ids}, ids))
    with pytest.raises(ValueError, match=r"the batch lacks y: it holds x\['input_ids'\] a tensor of \(12,\) per "
                                         r"sample \(torch.int64\); the plan .*: step on batches holding what the plan "
                                         r"was made for"):
        plan.step(({"input_ids": ids}, None))
    with pytest.raises(TypeError, match=r"plan.step takes torch tensors, .*; found numpy arrays at x\['input_ids'\], "
                                        r"y. Fix: torch.from_numpy"):
        plan.step(({"input_ids": ids.numpy()}, ids.numpy()))


def _frozen_first():
    model = _model()
    model[0].requires_grad_(False)
    return model


def test_step_refuses_a_model_changed_since_fit():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)
    changes = {
        r"parameter '0.0.weight' now requires grad": lambda m, o: m[0][0].weight.requires_grad_(True),
        r"module '1' was replaced by another module": lambda m, o: m.__setitem__(1, nn.Sequential(
            nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 16))),
        r"attribute 'forward' of module '1.1' changed": lambda m, o: setattr(m[1][1], "forward", torch.sin),
    }
    for said, change in changes.items():
        model = _frozen_first()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        plan = memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB")
        plan.step((x, y))                                  # the model as planned steps
        change(model, opt)
        if "requires grad" in said:                        # its gradient and AdamW state: above the plan, silently
            assert _real_peak(model, opt, (x, y), plan.micro_batch) > plan.peak_bytes
        with pytest.raises(ValueError, match=f"the model changed since memfit.fit made this plan \\({said}\\).*call "
                                             "memfit.fit again"):
            plan.step((x, y))


def test_step_refuses_an_optimizer_given_other_parameters_or_state_and_lets_a_schedule_through():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)
    model = _frozen_first()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 2))      # lr 0 at the first step
    plan = memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB")
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(3):                                     # lr moves (from 0): no byte changes
        plan.step((x, y))
        warmup.step()
    for _ in range(2):
        plan.step((x, y))
        schedule.step()
    model.eval()
    model.train()                                          # a round trip through eval mode: the model as planned
    plan.step((x, y))
    opt.param_groups[0]["momentum"] = 0.9                  # a momentum buffer per parameter, never counted
    memfit.accumulate(model, opt, (x, y), F.mse_loss, micro_batch=plan.micro_batch)      # the buffers made
    assert _real_peak(model, opt, (x, y), plan.micro_batch) > plan.peak_bytes
    with pytest.raises(ValueError, match=r"optimizer's parameter groups changed .*\(option momentum changed\)"):
        plan.step((x, y))
    opt.param_groups[0]["momentum"] = 0
    plan.step((x, y))
    opt.add_param_group({"params": list(model[0].parameters())})      # a group the plan never saw
    with pytest.raises(ValueError, match=r"1 group\(s\) of \[4\] parameters then, 2 of \[4, 4\] now"):
        plan.step((x, y))


def test_what_a_models_own_forward_sets_is_not_a_change_and_a_change_between_steps_is():
    """transformers' Swin sets an attribute (`shift_size`) in its first forward: checked against the model as fit
    saw it, every step after the first was refused. Each step is checked against the model as the last one left it."""
    class SetsInForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.width = _model(), None

        def forward(self, x):
            self.width = x.shape[1]                   # a plain attribute, set by the forward itself
            return self.body(x)
    model = SetsInForward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)
    plan = memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB")
    for _ in range(3):
        plan.step((x, y))
    model.body[1] = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 16))
    with pytest.raises(ValueError, match=r"module 'body.1' was replaced"):
        plan.step((x, y))


def test_steps_check_the_model_without_building_its_fingerprint_and_every_change_is_still_refused(monkeypatch):
    """plan.step checks the model before and after every step by `State.holds` (no `model_state` walk while nothing
    changed: counted here); a change made after any number of steps is refused as before: a hook, a flag, a field
    changed in place, a parameter's storage or requires_grad, a module replaced."""
    from memfit.fitting import layout as layout_module
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)
    changes = {
        "forward hook": lambda m: m[1][1].register_forward_hook(lambda *a: None),
        "a submodule's training flag": lambda m: m[0].eval(),
        "an attribute set in place on a shared object": lambda m: setattr(m.cfg, "scale", 2.0),
        "a parameter's storage": lambda m: setattr(m[0][0].weight, "data", torch.zeros(64, 32)),
        "requires_grad": lambda m: m[0][0].weight.requires_grad_(True),
        "a module replaced": lambda m: m[1].__setitem__(0, nn.Linear(16, 64)),
    }
    for what, change in changes.items():
        model = _frozen_first()
        model.cfg = type("Config", (), {})()
        model.cfg.scale = 1.0
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        plan = memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB")
        built, walk = [], layout_module.model_state
        monkeypatch.setattr(layout_module, "model_state", lambda m, built=built, walk=walk: built.append(1) or walk(m))
        walked, of = [], Walked.of
        monkeypatch.setattr(Walked, "of", classmethod(lambda cls, m, walked=walked, of=of: walked.append(1) or of(m)))
        for _ in range(3):
            plan.step((x, y))
        assert built == [], what                         # checked three times before and after: no walk built
        assert walked == [1], what                       # parameters and batch statistics walked at the first only
        change(model)
        with pytest.raises(ValueError, match="the model changed since memfit.fit made this plan"):
            plan.step((x, y))
        monkeypatch.undo()


class _Recorded(nn.Module):
    """_model(), its forward recording the batch's sequence length and, with `count`, how many forwards ran."""
    def __init__(self, count: bool = False):
        super().__init__()
        self.body, self.length, self.count, self.calls = _model(), None, count, 0

    def forward(self, x):
        self.length = x.shape[1]                      # set by the forward itself, from the batch's shape
        if self.count:
            self.calls += 1                           # ... and, with `count`, on every step
        return self.body(x)


def _sequences(length: int, n: int = 6):
    g = torch.Generator().manual_seed(length)
    return torch.randn(n, length, 16, generator=g), torch.randn(n, length, 16, generator=g)


def test_a_step_on_the_shapes_of_one_that_changed_nothing_is_checked_once(monkeypatch):
    """The model is checked before every step and, after it, only until a step on batches of those shapes (and
    dtypes, devices) left it as it found it: one `State.holds` a step then, not two. A forward that sets its model
    from the batch's shape (a shorter sequence) is checked after those steps again, and one that sets it every step
    after every step: neither is refused. A change by the caller between skipped checks is refused as before."""
    from memfit.memory.fingerprint import State
    calls, holds = [], State.holds
    monkeypatch.setattr(State, "holds", lambda self, m: calls.append(1) or holds(self, m))
    for count in (False, True):
        model = _Recorded(count)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        plan = memfit.fit(model, opt, _sequences(8), F.mse_loss, "1GiB")
        per_step = []
        for length in (8, 8, 8, 4, 4, 8, 8):             # a shorter sequence sets `length`: checked after it runs
            calls.clear()
            plan.step(_sequences(length))
            per_step.append(len(calls))
        # every step: before; after: the first (it set `length`), each step on new shapes, and the one after
        # each of those (to see it set nothing); with `count` set every step, after every step
        assert per_step == ([2, 2, 1, 2, 2, 2, 2] if not count else [2] * 7), (count, per_step)
    model = _Recorded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = memfit.fit(model, opt, _sequences(8), F.mse_loss, "1GiB")
    for _ in range(3):
        plan.step(_sequences(8))
    model.body[0][0].weight.requires_grad_(False)          # the caller freezes a weight: fewer bytes, but changed
    with pytest.raises(ValueError, match=r"the model changed since memfit\.fit.*taken for a change by the caller"):
        plan.step(_sequences(8))


def test_a_forward_that_changes_its_model_only_now_and_then_is_refused_saying_why():
    """The price of one check a step: a forward that changes its model on a later step of the same batch shape
    (not the first) is taken for a change by the caller, and the error says so (plan.step's docstring)."""
    forwards = []                                     # counted outside the model: the model itself unchanged

    class Sometimes(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _model()

        def forward(self, x):
            forwards.append(1)
            if len(forwards) == 3:
                self.mode = "warm"                    # set by the forward at its third real step only
            return self.body(x)
    model = Sometimes()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = memfit.fit(model, opt, _sequences(8), F.mse_loss, "1GiB")
    forwards.clear()                                  # fit's runs are on fake tensors; counted from the first step
    with pytest.raises(ValueError, match="a forward that changes its own model only on some steps"):
        for _ in range(4):
            plan.step(_sequences(8))


def test_a_forward_that_unfreezes_a_parameter_is_refused_at_the_next_step():
    """A forward that sets an attribute every step (a call counter: no step is ever 'quiet', so each is taken as the
    model as planned) and unfreezes a frozen layer at its third call (progressive unfreezing inside the model): the
    step after is refused, not run at 3.65x the plan's peak as every later step was before (what a forward sets is
    taken as planned only where the parameters' identities, shapes, dtypes and requires_grad stay). Its message
    does not say the last steps went unchecked: they were checked, the change seen and not taken as planned."""
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.calls = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4), 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 3:
                self.b.requires_grad_(True)
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))
    torch.manual_seed(0)
    model = Counting()
    model.b.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    plan = memfit.fit(model, opt, (x, y), F.mse_loss, "64MiB")
    with pytest.raises(ValueError, match="the model changed since memfit.fit made this plan") as e:
        for _ in range(6):
            plan.step((x, y))
    assert model.b.weight.requires_grad and model.calls == 3        # refused at the step after the unfreezing one
    assert "not checked after they ran" not in str(e.value), str(e.value)


def test_the_quick_optimizer_check_answers_as_the_full_one():
    """`_groups_hold` (run every step) against `_same_groups` of freshly built groups, over changes that matter and
    ones that do not."""
    from memfit.fitting.layout import _groups, _groups_hold, _same_groups
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    planned = _groups(opt)
    changes = [lambda: None,
               lambda: opt.param_groups[0].update(lr=0.01),                  # a schedule: no byte changes
               lambda: opt.param_groups[0].update(momentum=0.9),             # a momentum buffer per parameter
               lambda: opt.param_groups[0].update(momentum=0.0),
               lambda: opt.param_groups[0]["params"].reverse(),              # other parameters in the group
               lambda: opt.param_groups[0]["params"].reverse(),
               lambda: opt.param_groups[0]["params"].pop(),
               lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})]
    answers = []
    for change in changes:
        change()
        answers.append(_groups_hold(opt, planned))
        assert answers[-1] == _same_groups(_groups(opt), planned)
    assert answers == [True, True, False, True, False, True, False, False]
