"""One FSDP2 rank's step on fake tensors: the modules it wraps (`units=`), and only what a real step allocates."""
import pytest
import torch

from memfit.memory.fsdp_run import RANK_KINDS, fsdp_fake_run
from memfit.memory.kinds import MemoryKind
from memfit.memory.ranks import rank_memory_model
from memfit.memory.step import ExampleBatch


def _nested():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)),
                               torch.nn.Linear(64, 8))


def _total(model, units) -> int:
    return rank_memory_model(model, (64,), optimizer=torch.optim.AdamW(model.parameters()), world_size=2,
                             units=units, probes=(4,)).total_bytes(4)


def test_units_name_the_models_modules_or_the_originals_mapped_by_name():
    """The run wraps a structural copy: `units=lambda m: [m[0][0]]` names the copy's modules; a lambda that closes
    over the original (`model[0][0]`), or a list of the original's modules, means the same modules and predicts
    the same bytes (it failed inside torch before). Each is a real wrapping: a unit more changes the bytes."""
    m = _nested()
    copy = _total(m, lambda f: [f[0][0], f[0]])
    assert _total(m, lambda f: [m[0][0], m[0]]) == copy == _total(m, [m[0][0], m[0]])
    assert _total(m, lambda f: [f[0]]) != copy


def test_units_that_are_not_the_models_are_refused_saying_what_was_found():
    """A module built elsewhere (`Linear(1000, 1000)`) was wrapped and counted: 2,743,076 bytes against 1,405,728."""
    m = _nested()
    for units, error, match in (
            (lambda f: [torch.nn.Linear(1000, 1000)], ValueError, r"Linear \(1,001,000 parameters\), which is not one "
                                                                  r"of them.*units=lambda m: \[m.layers\[0\]"),
            (lambda f: [f[0], f], ValueError, "found the model itself: leave it out"),
            (lambda f: [f[0], m[0]], ValueError, "found Sequential twice"),
            (lambda f: [f[0], f[0][2]], ValueError, "found '0' before its submodule '0.2': list '0.2' first"),
            (lambda f: f[0], TypeError, "found Sequential: return a list"),
            (lambda f: ["0.0"], TypeError, "found a str")):
        with pytest.raises(error, match=match):
            _total(m, units)


def test_dtensors_sharding_propagation_is_not_counted():
    """SGD with momentum updates DTensors in its second step with ops DTensor has not propagated yet: it runs them
    on empty tensors of the global shapes under the fake mode it finds, this run's, where a real step allocates
    nothing. The step allocates nothing (momentum and parameters updated in place); before, the whole 256 x 255
    weight, 261,120 bytes, was counted as a step transient."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 255))
    run = fsdp_fake_run(m, ExampleBatch((64,)), 4, world_size=2, rank=0, loss_fn=None, target=None,
                        optimizer=torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    steps = run.live[run.phase_ends["backward"]:run.phase_ends["step"], RANK_KINDS.index(MemoryKind.STEP_TRANSIENT)]
    assert steps.max() == 0 and run.scaling is not None
