"""memfit.planner.capture on its own: what `capture` returns (core ATen ops, the model's own parameters), the
one-line CaptureError for each way a capture fails (and its `kind`), the input checks, and that a failed
capture leaves torch's logging and the RNG as it found them. `capture_model`'s contract (one symbolic-batch
capture, or a static one with the reason) is here too: it is the capture the planner uses.

Run: python -m pytest -q tests/planner/test_capture.py
"""
import logging

import pytest
import torch
from torch import nn

from memfit.errors import CaptureError
from memfit.planner.capture import DEBUG_ENV, as_inputs, capture, constants, decompositions
from memfit.planner.planned import capture_model


def _ops(ep) -> list[str]:
    return [n.target.__name__ for n in ep.graph.nodes if n.op == "call_function"]


class Consts(nn.Module):
    """A parameter, a buffer and a constant tensor the forward makes (export lifts it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("shift", torch.ones(3))

    def forward(self, x):
        return self.lin(x) + self.shift + torch.tensor([1.0, 2.0, 3.0])


def test_capture_returns_core_aten_ops_and_keeps_the_devices_fused_kernels():
    """silu and hardswish have their own CPU kernels: kept whole (eager runs them so), not decomposed into
    sigmoid-then-mul and five ops as the default table does."""
    class Acts(nn.Module):
        def forward(self, x):
            return nn.functional.silu(x) + nn.functional.hardswish(x)

    ep = capture(Acts(), (torch.randn(2, 3),))
    assert _ops(ep) == ["silu.default", "hardswish.default", "add.Tensor"]
    table = decompositions("cpu")
    assert torch.ops.aten.silu.default not in table and torch.ops.aten.silu.default in \
        torch.export.default_decompositions()
    x = torch.randn(2, 3)
    assert torch.equal(ep.module()(x), Acts()(x))


def test_constants_are_the_models_own_tensors_and_the_lifted_ones():
    model = Consts()
    ep = capture(model, torch.randn(2, 3))                  # one tensor: wrapped as a tuple
    consts = constants(ep, model)
    assert consts["p_lin_weight"] is model.lin.weight and consts["p_lin_bias"] is model.lin.bias
    assert consts["b_shift"] is model.shift                 # by reference: later in-place updates are seen
    lifted = [v for k, v in consts.items() if k.startswith("c_")]
    assert len(lifted) == 1 and torch.equal(lifted[0], torch.tensor([1.0, 2.0, 3.0]))
    user = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert len(user) == 1 and user[0] not in consts


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:            # Python control flow on a value: export cannot capture it
            return x * 2
        return x - 1


class RefusesExport(nn.Module):
    """Runs eagerly, fails under export with an error that is not about data-dependence."""

    def forward(self, x):
        if torch.compiler.is_exporting():
            raise RuntimeError("this module refuses to be exported")
        return x * 2


def test_each_failure_is_one_line_with_its_kind_and_a_fix(capfd):
    x = torch.randn(2, 3)
    with pytest.raises(CaptureError, match=r"^DataDependent has control flow or output shapes that depend on "
                                           r"tensor values .*run the model eagerly") as e:
        capture(DataDependent(), (x,))
    assert e.value.kind == "data-dependent" and "\n" not in str(e.value)
    with pytest.raises(CaptureError, match=r"^torch.export could not capture RefusesExport \(RuntimeError: this "
                                           rf"module refuses to be exported\).*run it eagerly.*{DEBUG_ENV}=1") as e:
        capture(RefusesExport(), (x,))
    assert e.value.kind == "export" and "\n" not in str(e.value)
    with pytest.raises(CaptureError, match=r"^Linear fails on the example inputs, before any capture: .*found "
                                           r"\(2, 3\)") as e:
        capture(nn.Linear(4, 2), (x,))
    assert e.value.kind == "inputs"
    with pytest.raises(CaptureError, match=r"writes to .*BatchNorm in training mode.*call model.eval\(\)") as e:
        capture(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).train(), (x,))
    assert e.value.kind == "mutation"
    assert capfd.readouterr().err == ""                    # torch's log lines and graph dumps are silenced


def test_explain_false_skips_the_diagnosis_and_runs_nothing_eagerly():
    calls = []

    class Counts(DataDependent):
        def forward(self, x):
            if not torch.compiler.is_exporting():
                calls.append(1)
            return super().forward(x)

    with pytest.raises(CaptureError) as e:
        capture(Counts(), (torch.randn(2, 3),), explain=False)
    assert not calls and e.value.kind == "export"           # no eager run, so no diagnosis
    with pytest.raises(CaptureError, match="control flow"):
        capture(Counts(), (torch.randn(2, 3),))
    assert calls == [1]                                      # the diagnosis ran the model once


def test_a_failed_capture_leaves_logging_and_the_rng_as_found(monkeypatch):
    """The diagnosis runs the model eagerly: its dropout draws are not the user's."""
    class DrawsThenFails(DataDependent):
        def forward(self, x):
            return super().forward(nn.functional.dropout(x, 0.5, training=True))

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    lg = logging.getLogger("torch._subclasses.fake_tensor")
    before = (lg.level, lg.disabled, lg.propagate)
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    state = torch.get_rng_state()
    with pytest.raises(CaptureError) as e:
        capture(DrawsThenFails(), (x,))
    assert torch.equal(torch.get_rng_state(), state)
    assert (lg.level, lg.disabled, lg.propagate) == before
    assert e.value.__cause__ is None                         # torch's traceback only with MEMFIT_DEBUG=1
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(CaptureError) as e:
        capture(DataDependent(), (torch.randn(2, 3),))
    assert e.value.__cause__ is not None


def test_inputs_must_be_a_module_and_tensors():
    x = torch.randn(2, 3)
    assert as_inputs(x) == (x,) and as_inputs([x, x]) == (x, x)
    with pytest.raises(TypeError, match=r"tuple of tensors.*found \['float', 'float'\]"):
        as_inputs([1.0, 2.0])
    with pytest.raises(TypeError, match="tuple of tensors.*found dict"):
        as_inputs({"x": x})
    with pytest.raises(TypeError, match="expected a torch.nn.Module to plan; found function"):
        capture(lambda t: t * 2, (x,))


def test_capture_model_makes_the_batch_symbolic_or_says_why_not():
    mlp = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
    cap = capture_model(mlp, torch.randn(3, 8))
    assert cap.dynamic and cap.batch_range[0] == 2 and cap.static_reason == ""
    assert cap.accepts((torch.randn(50, 8),)) and not cap.accepts((torch.randn(50, 9),))

    one = capture_model(mlp, torch.randn(1, 8))
    assert not one.dynamic and "batch 1 is captured on its own" in one.static_reason

    class FixesItsBatch(nn.Module):
        def forward(self, x):
            return x.reshape(3, -1).sum(0)           # the batch is written into the model

    fixed = capture_model(FixesItsBatch(), torch.randn(3, 8))
    assert not fixed.dynamic and fixed.batch_range == (3, 3) and fixed.static_reason
    assert fixed.accepts((torch.randn(3, 8),)) and not fixed.accepts((torch.randn(4, 8),))

    class Sums(nn.Module):
        def forward(self, x, y):
            return x.sum(0) + y.sum(0)

    two = capture_model(Sums(), (torch.randn(3, 4), torch.randn(2, 4)))
    assert not two.dynamic and "first dimensions differ" in two.static_reason

    static = capture_model(mlp, torch.randn(3, 8), dynamic_batch=False)
    assert not static.dynamic and static.static_reason == "a static capture was asked for"


def test_quiet_torch_restores_levels_without_clearing_every_loggers_cache(monkeypatch):
    """Restoring ~290 torch loggers with setLevel cleared every logger's cache each time (0.1 s a capture): only
    a level that changed inside is set back."""
    from memfit.planner.capture import quiet_torch
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    lg = logging.getLogger("torch.export")
    before = (lg.level, lg.disabled, lg.propagate)
    clears = []
    real_clear = logging.Manager._clear_cache
    monkeypatch.setattr(logging.Manager, "_clear_cache", lambda self: clears.append(1) or real_clear(self))
    with quiet_torch():
        assert lg.disabled
    assert (lg.level, lg.disabled, lg.propagate) == before and clears == []
    with quiet_torch():
        lg.setLevel(logging.CRITICAL)                 # torch changes a level inside: set back
    assert (lg.level, lg.disabled, lg.propagate) == before


def test_the_kernel_layout_check_runs_the_captured_graph_without_unlifting_it(monkeypatch):
    """The check of kernel strides runs the lifted graph on the model's own tensors; `ep.module()` first copied
    the graph into a new module and recompiled it (twice the run itself on ResNet)."""
    unlifted = []
    real_module = torch.export.ExportedProgram.module
    monkeypatch.setattr(torch.export.ExportedProgram, "module",
                        lambda self, *a, **k: unlifted.append(self) or real_module(self, *a, **k))
    model = Consts()
    x = torch.randn(4, 3)
    cap = capture_model(model, x)
    assert cap.kernel_layouts == {} and all(ep is not cap.ep for ep in unlifted)
    with torch.no_grad():                              # the graph it ran gives the model's outputs
        torch.testing.assert_close(cap.ep.module()(x), model(x))
