"""Checks shared by the memory-model tests: two StepMemoryModels the same op for op."""
import numpy as np

from memfit.memory.micro_batch import MICRO_PHASES, STEP_PHASES
from memfit.memory.step_model import PHASES


def assert_same_model(a, b) -> None:
    """The same bytes at every op and kind, by phase at several sizes, and the same gradient bytes."""
    assert a._ops == b._ops and a._ends == b._ends and a._held == b._held
    for field in ("_a", "_b", "_c"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), field
    assert a._measured.keys() == b._measured.keys()
    assert all(np.array_equal(v, b._measured[n]) for n, v in a._measured.items())
    for m in (1, 3, 8):
        assert a.gradient_bytes(m) == b.gradient_bytes(m)
        for phases in (MICRO_PHASES, STEP_PHASES, PHASES):
            assert a.breakdown(m, phases=phases) == b.breakdown(m, phases=phases), (m, phases)
