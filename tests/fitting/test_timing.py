"""memfit.fitting.timing: how a kernel's seconds are taken (on a fake clock: exact), which kernels it cannot time,
and that it draws nothing from torch's generator."""
import pytest
import torch

from memfit.fitting import timing
from memfit.memory.kernel_scratch import spec_of

DEV = torch.device("cpu")


class FakeKernel:
    """A stand-in for an op: each call advances a fake clock by the cost of that call."""

    tags: list = []

    def __init__(self, clock, name):
        self.clock, self.name = clock, name

    def __call__(self, *args, **kwargs):
        self.clock.call(self.name)


class Clock:
    """Seconds a call costs: 1 ms, or 3 ms for the calls whose place in the whole sequence is in `busy`."""

    def __init__(self, busy=(), slow_first=0):
        self.now, self.calls, self.busy, self.slow_first, self.log = 0.0, 0, set(busy), slow_first, []

    def call(self, name):
        self.log.append(name)
        cost = 3e-3 if self.calls in self.busy or self.calls < self.slow_first else 1e-3
        self.now += cost
        self.calls += 1


@pytest.fixture
def fake_clock(monkeypatch):
    def make(**kwargs):
        clock = Clock(**kwargs)
        monkeypatch.setattr(timing, "clock", lambda device: lambda: clock.now)
        monkeypatch.setattr(timing, "_SECONDS", {})
        return clock
    return make


def test_timed_leaves_out_the_slow_first_calls_of_a_kernel(fake_clock):
    clock = fake_clock(slow_first=2)                    # the first two calls (set-up, cold caches) take 3 ms
    assert timing.timed(lambda: clock.call("k"), DEV) == pytest.approx(1e-3)


def test_kernels_are_timed_in_turn_so_a_busy_moment_falls_on_one_sample_of_each(fake_clock):
    """Two kernels of 1 ms; the machine is busy (3 ms a call) for two calls in a row once the samples start.
    Timed in turn, each keeps a clean sample (timed one after the other, both samples of one would be busy)."""
    clock = fake_clock(busy={2, 3})         # calls 0-1: each kernel's first call (1 ms: the warm-up); then the samples
    a, b = FakeKernel(clock, "a"), FakeKernel(clock, "b")
    keys = [(a, spec_of((), {}), ()), (b, spec_of((), {}), ())]
    got = timing.kernel_seconds(keys, device=DEV)
    assert clock.log[2:] == ["a", "b"] * timing.SAMPLES     # each first sample 3x its warm-up: a second one
    assert got[keys[0]] == pytest.approx(1e-3) and got[keys[1]] == pytest.approx(1e-3)
    calls = clock.calls
    assert timing.kernel_seconds(keys, device=DEV) == got and clock.calls == calls      # kept: not timed again


def test_a_kernel_that_fails_on_its_stand_in_values_is_none_and_a_random_one_draws_nothing_from_torch():
    fails = (torch.ops.aten.linalg_inv.default, spec_of((torch.eye(3),), {}), ())    # a matrix of ones: singular
    dropout = (torch.ops.aten.native_dropout.default, spec_of((torch.ones(64), 0.5, True), {}), ())
    mm = (torch.ops.aten.mm.default, spec_of((torch.ones(4, 4), torch.ones(4, 4)), {}), ())
    torch.manual_seed(1)
    state = torch.get_rng_state()
    got = timing.kernel_seconds([fails, dropout, mm], device=DEV)
    assert torch.equal(state, torch.get_rng_state())
    assert got[fails] is None and got[dropout] > 0 and got[mm] > 0


def test_the_clock_is_the_threads_cpu_time_with_one_thread():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert timing.clock(DEV) is __import__("time").thread_time
        torch.set_num_threads(2)
        assert timing.clock(DEV) is __import__("time").perf_counter
    finally:
        torch.set_num_threads(threads)


def test_kernels_run_on_ones_where_zeros_would_be_a_slow_path_and_on_zeros_for_indices():
    """A square root of zeros took 6x as long as of ones on this CPU: floating arguments are ones; an integer one
    (an index) is zeros, always in range."""
    from memfit.memory.kernel_scratch import real_arguments
    spec = spec_of((torch.empty(2, 3), torch.empty(4, dtype=torch.long), 7), {})
    (x, index, seven), _ = real_arguments(spec, {}, DEV, ones=True)
    assert torch.equal(x, torch.ones(2, 3)) and torch.equal(index, torch.zeros(4, dtype=torch.long)) and seven == 7
    (x, index, _), _ = real_arguments(spec, {}, DEV)                     # the scratch measurement's zeros
    assert torch.equal(x, torch.zeros(2, 3))


def test_a_kernel_timed_in_a_busy_moment_is_counted_unsteady(fake_clock):
    """Two 1 ms kernels; a's first sample falls on a busy moment (3 ms): a takes a second sample and is unsteady
    (3x apart), b's came as its warm-up did and is not; the figures stay the least sample."""
    clock = fake_clock(busy={2})            # calls 0-1: the first calls (the warm-up); call 2: a's first sample
    a, b = FakeKernel(clock, "a"), FakeKernel(clock, "b")
    keys = [(a, spec_of((), {}), ()), (b, spec_of((), {}), ())]
    got = timing.kernel_seconds(keys, device=DEV)
    assert got[keys[0]] == pytest.approx(1e-3) and got[keys[1]] == pytest.approx(1e-3)
    assert timing.unsteady(keys, DEV) == (1, 2)
    assert timing.unsteady(keys[1:], DEV) == (0, 1)
    assert clock.log == ["a", "b", "a", "b", "a"]


def test_a_sample_as_its_warm_up_ran_is_the_second_and_another_is_taken_only_where_it_is_not(fake_clock):
    """A kernel whose first sample comes within `STEADY` of its warm-up takes no second (the warm-up is it); one
    whose warm-up ran slow (set-up: 3 ms against 1) takes two after it, and its figure leaves the warm-up out."""
    clock = fake_clock(busy={0})            # a's first call, its warm-up, is slow; b's is not
    a, b = FakeKernel(clock, "a"), FakeKernel(clock, "b")
    keys = [(a, spec_of((), {}), ()), (b, spec_of((), {}), ())]
    got = timing.kernel_seconds(keys, device=DEV)
    assert clock.log == ["a", "b", "a", "b", "a"]           # first calls, a sample of each, a second of a only
    assert got[keys[0]] == pytest.approx(1e-3) and got[keys[1]] == pytest.approx(1e-3)
    clock = fake_clock(busy={1})            # b's warm-up 3 ms, its first sample 1 ms: 3x apart, a second sample
    a, b = FakeKernel(clock, "a"), FakeKernel(clock, "b")
    keys = [(a, spec_of((), {}), ()), (b, spec_of((), {}), ())]
    got = timing.kernel_seconds(keys, device=DEV)
    assert clock.log == ["a", "b", "a", "b", "b"] and got[keys[1]] == pytest.approx(1e-3)
