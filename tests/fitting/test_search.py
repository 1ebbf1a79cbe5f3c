"""memfit.fitting.search: the pure search core, on made-up costs and peaks (no model)."""
import itertools
from dataclasses import replace

import pytest

from memfit.fitting.search import (
    CLEAR,
    CLOSE,
    Alternative,
    Choice,
    Cost,
    Machine,
    Setting,
    checkpoint_sets,
    confirm,
    interpolate,
    keep_plain,
    micro_batch_sizes,
    micro_step_seconds,
    search,
    step_seconds,
    trial_order,
    wide_lead,
)

MACHINE = Machine(op_seconds=1e-5)
STEP = Cost(ops=200, kernels=((1, 3e-3), (16, 4.8e-2)))          # 3 ms of kernels per sample
BLOCK = Cost(ops=20, kernels=((1, 2e-4), (16, 3.2e-3)))
BLOCKS = {f"b{i}": BLOCK for i in range(4)}
SETS = [Setting(s) for s in checkpoint_sets(list(BLOCKS))]


def peaks(fixed=1000, per_sample=100, saved_per_block=20):
    """Peak bytes: fixed + m * (per_sample - saved per checkpointed block); calls counted."""
    calls = []

    def bytes_of(setting):
        calls.append(setting)
        return lambda m: fixed + m * (per_sample - saved_per_block * len(setting.checkpoint))
    return bytes_of, calls


def brute_force(n, budget, bytes_of):
    """The reference: every alternative's time and bytes, the fastest that fits (ties to the larger micro-batch,
    then to fewer checkpointed)."""
    best = None
    for s, m in itertools.product(SETS, micro_batch_sizes(n)):
        t = step_seconds(n, m, STEP, BLOCKS, s, MACHINE)
        if bytes_of(s)(m) <= budget and (best is None or (t, -m, len(s.checkpoint)) < best[3]):
            best = (t, m, s, (t, -m, len(s.checkpoint)))
    return best


def test_sizes_and_sets():
    assert micro_batch_sizes(1) == [1]
    assert micro_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert micro_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert checkpoint_sets(["a", "b"]) == [(), ("a",), ("a", "b")]        # 1/4 and 1/2 of 2 round alike
    assert checkpoint_sets([]) == [()]
    with pytest.raises(ValueError, match="at least 1"):
        micro_batch_sizes(0)


def test_step_seconds_counts_micro_batches_and_recompute():
    plain = step_seconds(10, 10, STEP, BLOCKS, Setting(), MACHINE)
    # 4 + 4 + 2: three launches of every op, the same arithmetic
    assert step_seconds(10, 4, STEP, BLOCKS, Setting(), MACHINE) == pytest.approx(plain + 2 * 200 * 1e-5)
    ckpt = step_seconds(10, 10, STEP, BLOCKS, Setting(("b0",)), MACHINE)
    assert ckpt == pytest.approx(plain + BLOCK.recomputed(10, MACHINE))
    with pytest.raises(ValueError, match="micro-batch in"):
        step_seconds(10, 11, STEP, BLOCKS, Setting(), MACHINE)


@pytest.mark.parametrize("budget", [500, 1300, 1600, 2000, 2100, 3000, 10**6])
def test_search_finds_the_fastest_that_fits_as_brute_force_does(budget):
    n = 16
    bytes_of, calls = peaks()
    choice = search(SETS, micro_batch_sizes(n), n, STEP, BLOCKS, MACHINE, bytes_of, budget)
    ref = brute_force(n, budget, peaks()[0])
    if ref is None:
        assert choice.best is None and "nothing fits" in choice.reason
        return
    assert (choice.best.micro_batch, choice.best.setting) == (ref[1], ref[2])
    assert choice.best.bytes <= budget
    assert len(calls) == len(set(calls))                       # each setting's bytes at most once


def test_lazy_search_skips_bytes_it_does_not_need():
    bytes_of, calls = peaks()
    choice = search(SETS, micro_batch_sizes(16), 16, STEP, BLOCKS, MACHINE, bytes_of, budget=10**6)
    assert calls == [Setting()]                                # the plain step fits: nothing else computed
    assert choice.best.micro_batch == 16 and choice.reason.startswith("the plain step fits")
    assert sum(a.bytes is not None for a in choice.alternatives) == len(micro_batch_sizes(16))
    bytes_of, calls = peaks()
    full = search(SETS, micro_batch_sizes(16), 16, STEP, BLOCKS, MACHINE, bytes_of, budget=10**6, exhaustive=True)
    assert len(calls) == len(SETS) and all(a.bytes is not None for a in full.alternatives)
    assert full.best.micro_batch == 16 and full.best.setting == Setting()


def test_checkpointing_wins_where_micro_batching_would_crawl():
    # per micro-batch overhead dominates: checkpointing every block at m = n beats micro-batches of 4
    n, budget = 16, 1000 + 16 * 20
    bytes_of, _ = peaks()
    slow_launch = Machine(op_seconds=1e-3)
    choice = search(SETS, micro_batch_sizes(n), n, STEP, BLOCKS, slow_launch, bytes_of, budget)
    assert choice.best.micro_batch == 16 and len(choice.best.setting.checkpoint) == 4
    assert "every faster alternative needs more" in choice.reason


def test_nothing_fits_names_the_least():
    bytes_of, _ = peaks()
    choice = search(SETS, micro_batch_sizes(8), 8, STEP, BLOCKS, MACHINE, bytes_of, budget=100)
    assert choice.best is None
    assert "the least any needs is" in choice.reason and "micro-batch 1" in choice.reason


def _best(step, blocks, machine, bytes_of, budget, n=8):
    settings = [Setting(s) for s in checkpoint_sets(list(blocks))]
    return search(settings, micro_batch_sizes(n), n, step, blocks, machine, bytes_of, budget).best


def test_ranking_takes_the_cheaper_of_recomputing_and_splitting_as_the_costs_say():
    """The same bytes (checkpointing both blocks at m = 8 and m = 4 without it both fit, m = 8 without it does
    not): the costs alone decide which is faster, both ways."""
    bytes_of = lambda s: lambda m: 100 * m - 300 * len(s.checkpoint)      # m=8: 800, ckpt 2 -> 200; m=4: 400
    budget = 450
    launches = Machine(op_seconds=1e-3)                                   # a micro-batch costs 200 launches
    cheap_block = Cost(ops=5, kernels=((1, 1e-6), (8, 8e-6)))
    best = _best(STEP, {"b0": cheap_block, "b1": cheap_block}, launches, bytes_of, budget)
    assert (best.micro_batch, len(best.setting.checkpoint)) == (8, 2)      # recomputing 10 launches < 200
    arithmetic = Machine(op_seconds=1e-9)                                 # launches free, kernels per sample
    heavy_block = Cost(ops=5, kernels=((1, 2e-3), (8, 1.6e-2)))           # each block 2/3 of the step's kernels
    best = _best(STEP, {"b0": heavy_block, "b1": heavy_block}, arithmetic, bytes_of, budget)
    assert (best.micro_batch, best.setting.checkpoint) == (4, ())          # splitting costs nothing extra


def test_ranking_uses_each_micro_batch_size_and_the_uneven_last_one():
    """A fake clock: the step costs a fixed 1 s per micro-batch plus 0.1 s per sample; of micro-batches 4 and 6
    on 10 samples (3 and 2 parts: 4 + 4 + 2, 6 + 4), 6 is faster (2.0 + 1.0 s against 3.0 + 1.0 s)."""
    clock = Machine(op_seconds=1.0)
    step = Cost(ops=1, kernels=((1, 0.1), (10, 1.0)))
    assert step_seconds(10, 4, step, {}, Setting(), clock) == pytest.approx(4.0)
    assert step_seconds(10, 6, step, {}, Setting(), clock) == pytest.approx(3.0)
    choice = search([Setting()], [1, 2, 4, 6], 10, step, {}, clock, lambda s: lambda m: m, budget=6)
    assert choice.best.micro_batch == 6


def test_ties_go_to_fewer_recomputations_then_the_larger_micro_batch():
    """Costs per sample only and free blocks: every alternative takes the same predicted time."""
    flat = Cost(ops=0, kernels=((1, 1e-3), (8, 8e-3)))
    free = Cost(ops=0)
    machine = Machine(op_seconds=1e-6)
    blocks = {"b0": free, "b1": free}
    everything_fits = lambda s: lambda m: 1
    best = _best(flat, blocks, machine, everything_fits, budget=10)
    assert (best.micro_batch, best.setting.checkpoint) == (8, ())
    small_only = lambda s: lambda m: m * (1 if s.checkpoint else 10)       # m = 8 fits only checkpointed
    best = _best(flat, blocks, machine, small_only, budget=8)
    assert (best.micro_batch, best.setting.checkpoint) == (8, ("b0",))    # the fewest that make it fit


def test_a_fitting_alternatives_slower_ones_are_filled_only_where_ready():
    """Once one fits, a slower alternative's bytes are filled in only where bytes_of says no fake run is needed."""
    asked = []

    class Lazy:
        def __init__(self, s):
            self.s = s

        def __call__(self, m):
            asked.append((self.s.checkpoint, m))
            return m

        def ready(self, m):
            return m == 8
    choice = search(SETS, micro_batch_sizes(8), 8, STEP, BLOCKS, MACHINE, Lazy, budget=10**6)
    assert choice.best.micro_batch == 8 and asked == [((), 8)]
    assert [a.micro_batch for a in choice.alternatives if a.bytes is not None] == [8]


def test_interpolate_is_exact_at_the_sizes_measured_and_linear_between_as_numpy_says():
    import numpy as np
    points = [(1, 0.5), (2, 0.6), (4, 1.0), (8, 1.9)]
    for m in [1, 2, 3, 4, 5, 6, 7, 8]:
        assert interpolate(points, m) == pytest.approx(np.interp(m, [p for p, _ in points], [s for _, s in points]))
    assert interpolate(points, 12) == pytest.approx(1.9 + (1.9 - 1.0) / 4 * 4)     # past the last: its line
    assert interpolate([(4, 1.0), (8, 1.9)], 2) == pytest.approx(0.5)             # below the first: in proportion
    assert interpolate([(4, 1.0)], 6) == pytest.approx(1.5) and interpolate([], 3) == 0.0
    assert interpolate(list(reversed(points)), 3) == pytest.approx(0.8)            # any order


def test_a_micro_batch_sums_host_and_kernels_on_the_cpu_and_takes_the_longer_where_they_overlap():
    cost = Cost(ops=10, backward_ops=20, kernels=((1, 1e-3), (4, 4e-3)), optimizer_ops=0)
    cpu = Machine(op_seconds=1e-4, backward_op_seconds=5e-5)                   # 1 ms + 1 ms of host work
    assert cost.host_seconds(cpu) == pytest.approx(2e-3)
    assert cost.at(4, cpu) == pytest.approx(2e-3 + 4e-3)
    cuda = Machine(op_seconds=1e-4, backward_op_seconds=5e-5, overlap=True)
    assert cost.at(4, cuda) == pytest.approx(4e-3) and cost.at(1, cuda) == pytest.approx(2e-3)


def test_a_checkpointed_block_adds_its_forward_and_checkpoints_own_work_per_call_and_saved_tensor():
    block = Cost(ops=10, kernels=((1, 1e-3), (8, 8e-3)), saved=6)
    machine = Machine(op_seconds=1e-5, checkpoint_seconds=2e-4, saved_seconds=3e-5)
    assert block.recomputed(8, machine) == pytest.approx(10 * 1e-5 + 8e-3 + 2e-4 + 6 * 3e-5)
    step = Cost(ops=100, kernels=((1, 1e-2), (8, 8e-2)))
    one = step_seconds(8, 4, step, {"b": block}, Setting(("b",)), machine)
    assert one == pytest.approx(2 * (step.at(4, machine) + block.recomputed(4, machine)))


def test_the_optimizer_step_runs_once_and_dilutes_the_relative_times_without_reordering_them():
    once = Cost(ops=0, optimizer_ops=100, kernels=((1, 0.05), (16, 0.05)))
    machine = Machine(op_seconds=1e-5, optimizer_op_seconds=1e-6)
    n = 16
    for m in micro_batch_sizes(n):
        with_step = step_seconds(n, m, STEP, BLOCKS, Setting(), machine, once)
        assert with_step == pytest.approx(step_seconds(n, m, STEP, BLOCKS, Setting(), machine) + 0.05 + 1e-4)
    fits = lambda s: lambda m: 1
    plain = search(SETS, micro_batch_sizes(n), n, STEP, BLOCKS, machine, fits, 10, exhaustive=True)
    diluted = search(SETS, micro_batch_sizes(n), n, STEP, BLOCKS, machine, fits, 10, exhaustive=True, once=once)
    order = lambda c: [(a.micro_batch, a.setting) for a in c.alternatives]
    assert order(plain) == order(diluted)
    assert all(1.0 <= d.time <= p.time for p, d in zip(plain.alternatives, diluted.alternatives, strict=True))



def test_a_micro_batch_after_the_first_adds_its_gradients_into_those_held_in_the_time_model_and_in_confirm():
    """k micro-batches pay k - 1 passes of gradient adds (AccumulateGrad into the gradient held); the whole batch
    none. A trial's micro-step holds no gradient, so confirm adds them to the measured steps too: two alternatives
    timed alike per sample come apart by the adds alone."""
    later = Cost(ops=0, kernels=((1, 0.5), (16, 0.5)))               # 0.5 s of adds, whatever the batch
    n = 16
    for m, parts in ((16, 1), (8, 2), (4, 4), (12, 2)):
        added = step_seconds(n, m, STEP, BLOCKS, Setting(), MACHINE, later=later)
        assert added == pytest.approx(step_seconds(n, m, STEP, BLOCKS, Setting(), MACHINE) + (parts - 1) * 0.5)
    choice = _leading_search(peaks()[0](Setting())(4))
    timed = choice.leading
    seconds = {(a.micro_batch, a.setting): 0.01 * a.micro_batch for a in timed}    # alike per sample
    confirm(choice, seconds, n, STEP, BLOCKS, MACHINE)          # (confirm sets `measured` on the alternatives)
    alone = {(a.micro_batch, a.setting): a.measured for a in timed}
    picked = confirm(choice, seconds, n, STEP, BLOCKS, MACHINE, later=later)
    assert len({a.micro_batch for a in timed}) >= 2
    for a in timed:
        parts = -(-n // a.micro_batch)
        assert a.measured == pytest.approx(alone[(a.micro_batch, a.setting)] + (parts - 1) * 0.5)
    assert picked.best.micro_batch == max(a.micro_batch for a in timed)     # the fewest adds


def _leading_search(budget, lead=1.5, leading=3, new_after=4):
    bytes_of, _ = peaks()
    return search(SETS, micro_batch_sizes(16), 16, STEP, BLOCKS, MACHINE, bytes_of, budget, lead=lead,
                  leading=leading, new_after=new_after)


def test_the_leading_alternatives_are_those_that_fit_within_lead_and_not_slower_by_construction():
    """Beside the fastest that fits: others that fit, predicted within `lead` of it, at most `leading` in all; never
    one that is slower by construction (a micro-batch no larger with the best's modules checkpointed and more)."""
    bytes_of, _ = peaks()
    budget = bytes_of(Setting())(4)                     # micro-batch 4 fits unchecked; 8 only with two blocks
    choice = _leading_search(budget)
    best = choice.best
    assert choice.leading[0] is best and (best.micro_batch, best.setting) == (4, Setting())
    assert 1 < len(choice.leading) <= 3
    for a in choice.leading[1:]:
        assert a.bytes <= budget and a.time <= 1.5 * best.time
        assert a.micro_batch != best.micro_batch         # the same one with blocks checkpointed: slower
    assert len(_leading_search(budget, lead=1.0).leading) == 1
    # by default no setting's memory model is built for them: only those whose bytes are at hand
    counted, calls = peaks()
    default = search(SETS, micro_batch_sizes(16), 16, STEP, BLOCKS, MACHINE, counted, budget, lead=1.5, leading=3)
    alone, plain_calls = peaks()
    search(SETS, micro_batch_sizes(16), 16, STEP, BLOCKS, MACHINE, alone, budget)
    assert calls == plain_calls and all(a.setting in plain_calls for a in default.leading)


def test_no_leading_alternative_is_slower_by_construction_than_another_leading_one():
    """Each one timed costs a micro-step: one with the same micro-batch as another leading one and that one's modules
    checkpointed and more is slower for sure, whichever is the best (GPT-2 768x12: micro-batch 4 with 6 blocks timed
    beside 4 with 3, half a step for nothing). Here micro-batch 2 with 3 blocks fits within `lead` of the best (4 with
    all 4), yet 2 with 2 leads already; its slot goes to the next that fits."""
    bytes_of, _ = peaks()
    choice = search(SETS, micro_batch_sizes(16), 16, STEP, BLOCKS, MACHINE, bytes_of, 1120, lead=1.15, leading=3,
                    new_after=4)
    key = lambda a: (a.micro_batch, len(a.setting.checkpoint))
    assert [key(a) for a in choice.leading] == [(4, 4), (2, 2), (1, 0)]
    three = next(a for a in choice.alternatives if key(a) == (2, 3))
    assert three.bytes <= 1120 and three.time <= 1.15 * choice.best.time      # it would qualify but for (2, 2)
    for a, b in itertools.permutations(choice.leading, 2):
        assert not (a.micro_batch == b.micro_batch and a.setting.checkpoint[:len(b.setting.checkpoint)]
                    == b.setting.checkpoint)


def test_the_leading_are_timed_best_first_then_the_plain_step_then_fastest_predicted_first():
    bytes_of, _ = peaks()
    fast8 = Cost(ops=200, kernels=((1, 3e-3), (8, 1.68e-2), (16, 4.8e-2)))        # micro-batch 8 predicted faster
    choice = search(SETS, micro_batch_sizes(16), 16, fast8, BLOCKS, MACHINE, bytes_of, bytes_of(Setting())(16),
                    lead=1.5, leading=3)
    order = trial_order(choice.leading, 16)
    plain = next(a for a in choice.leading if a.micro_batch == 16 and a.setting == Setting())
    assert len(order) == len(choice.leading) >= 3 and order[0] is choice.best and order[1] is plain
    assert [a.time for a in order[2:]] == sorted(a.time for a in order[2:])
    # what a trial of each is predicted to take: its micro-batch's share of the step, not the step's
    a = order[0]
    assert micro_step_seconds(a.micro_batch, fast8, BLOCKS, a.setting, MACHINE) * 16 / a.micro_batch == \
        pytest.approx(step_seconds(16, a.micro_batch, fast8, BLOCKS, a.setting, MACHINE))


def test_the_plain_step_that_fits_stays_unless_another_is_predicted_clearly_faster():
    bytes_of, _ = peaks()
    plain_fits = bytes_of(Setting())(16)
    # the plain step fits: no other is predicted faster (host work per micro-batch): nothing to time
    choice = _leading_search(plain_fits)
    assert (choice.best.micro_batch, choice.best.setting) == (16, Setting()) and len(choice.leading) == 1
    # kernels 30% cheaper per sample at 8 (a cache the whole batch overflows): micro-batch 8 is predicted faster,
    # and is timed against the plain step, which stays unless measured CLEAR of its time or less
    fast8 = Cost(ops=200, kernels=((1, 3e-3), (8, 1.68e-2), (16, 4.8e-2)))
    choice = search(SETS, micro_batch_sizes(16), 16, fast8, BLOCKS, MACHINE, bytes_of, plain_fits, lead=1.5,
                    leading=3)
    assert (choice.best.micro_batch, choice.best.setting) == (8, Setting())
    plain = next(a for a in choice.leading if a.micro_batch == 16 and a.setting == Setting())
    eight = choice.best
    per_micro = {16: 1.0, 8: 0.5 * CLEAR * 1.01}           # not clearly faster: the plain step
    picked = confirm(choice, {(a.micro_batch, a.setting): per_micro[a.micro_batch] for a in (plain, eight)}, 16,
                     fast8, BLOCKS, MACHINE)
    assert picked.best is plain and "the plain step fits" in picked.reason
    assert eight.measured == pytest.approx(2 * per_micro[8]) and plain.measured == pytest.approx(1.0)
    per_micro = {16: 1.0, 8: 0.5 * CLEAR * 0.99}           # measured clearly faster: taken
    picked = confirm(choice, {(a.micro_batch, a.setting): per_micro[a.micro_batch] for a in (plain, eight)}, 16,
                     fast8, BLOCKS, MACHINE)
    assert picked.best is eight and "measured" in picked.reason


def test_the_plain_step_that_fits_is_timed_even_when_more_than_leading_are_predicted_faster():
    """Review: kernels slightly superlinear in the batch put micro-batches 2, 4 and 8 all within LEAD of the best
    and ahead of the plain step; the cap on the leading dropped the plain step, so the trials chose among plans
    without it (docs/fit.md: it stays unless another plan is measured clearly faster)."""
    step = Cost(ops=10, kernels=((1, 1e-3), (2, 2.0e-3), (4, 4.1e-3), (8, 8.6e-3), (16, 20e-3)))
    bytes_of = lambda s: (lambda m: 100 * m)
    choice = search([Setting()], micro_batch_sizes(16), 16, step, {}, MACHINE, bytes_of, 10**9, lead=1.5,
                    leading=3, clear=CLEAR)
    assert choice.best.micro_batch == 2
    faster = [a for a in choice.leading if a.micro_batch != 16]
    assert len(faster) == 3                                       # the cap: three besides the plain step
    assert any(a.micro_batch == 16 for a in choice.leading)       # the plain step fits: timed too
    assert [a.micro_batch for a in trial_order(choice.leading, 16)][:2] == [2, 16]


def test_with_clear_0_the_plain_step_is_taken_wherever_it_fits_however_much_faster_another_is_predicted():
    """fit for another device's bytes (its kernels not here to time): the plain step wherever it fits, weighed even
    once `leading` others fit; where it does not fit, the fastest predicted that does, as without."""
    bytes_of, _ = peaks()
    # kernels far cheaper per sample at small micro-batches: 1, 2, 4 and 8 all predicted faster than the plain step
    cheap = Cost(ops=200, kernels=((1, 1e-4), (8, 8e-4), (16, 4.8e-2)))
    plain_fits = bytes_of(Setting())(16)
    usual = search(SETS, micro_batch_sizes(16), 16, cheap, BLOCKS, MACHINE, bytes_of, plain_fits, lead=1.5, leading=1)
    assert usual.best.micro_batch < 16                       # predicted fastest; the plain step timed beside it
    assert [(a.micro_batch, a.setting) for a in usual.leading] == [(usual.best.micro_batch, usual.best.setting),
                                                                  (16, Setting())]
    chosen = search(SETS, micro_batch_sizes(16), 16, cheap, BLOCKS, MACHINE, bytes_of, plain_fits, lead=1.5,
                    leading=1, clear=0.0)
    assert (chosen.best.micro_batch, chosen.best.setting) == (16, Setting()) and chosen.best.time == 1.0
    assert "the plain step fits" in chosen.reason
    tight = search(SETS, micro_batch_sizes(16), 16, cheap, BLOCKS, MACHINE, bytes_of, plain_fits - 1, lead=1.5,
                   leading=1, clear=0.0)
    reference = search(SETS, micro_batch_sizes(16), 16, cheap, BLOCKS, MACHINE, bytes_of, plain_fits - 1)
    assert (tight.best.micro_batch, tight.best.setting) == (reference.best.micro_batch, reference.best.setting)


def test_without_a_real_timing_the_plain_step_that_fits_is_kept_and_the_reason_says_why():
    """The leading alternatives could not be timed (a model that draws outside its Dropout modules, a meta model):
    the time model alone does not replace a plain step that fits; where the plain step does not fit, or its bytes
    were never computed, the choice stands."""
    bytes_of, _ = peaks()
    fast8 = Cost(ops=200, kernels=((1, 3e-3), (8, 1.68e-2), (16, 4.8e-2)))        # micro-batch 8 predicted faster
    plain_fits = bytes_of(Setting())(16)
    choice = search(SETS, micro_batch_sizes(16), 16, fast8, BLOCKS, MACHINE, bytes_of, plain_fits, lead=1.5,
                    leading=3)
    assert choice.best.micro_batch == 8
    kept = keep_plain(choice, 16, plain_fits, "the model draws random numbers")
    assert (kept.best.micro_batch, kept.best.setting) == (16, Setting()) and kept.leading == [kept.best]
    assert kept.reason.startswith("the plain step fits") and "predicted at" in kept.reason
    assert "not timed for real: the model draws random numbers" in kept.reason
    tight = search(SETS, micro_batch_sizes(16), 16, fast8, BLOCKS, MACHINE, bytes_of, plain_fits - 1, lead=1.5,
                   leading=3)
    assert keep_plain(tight, 16, plain_fits - 1, "why") is tight                 # the plain step does not fit
    plain = next(a for a in choice.alternatives if a.micro_batch == 16 and a.setting == Setting())
    plain.bytes = None                                                           # never computed: unknown
    assert keep_plain(choice, 16, plain_fits, "why") is choice


def test_the_timed_alternatives_decide_and_close_ones_go_to_the_simplest():
    """Without the plain step: the fastest timed, or, within CLOSE of it, the one with the larger micro-batch (fewer
    micro-batches) and then fewer checkpointed modules (repeated fits whose timings move a little keep their
    choice; a trial leaves out what each micro-batch costs beyond its micro-step). Timed
    micro-steps: the step's seconds are its micro-batches', the uneven last one scaled by the time model."""
    bytes_of, _ = peaks()
    choice = _leading_search(bytes_of(Setting())(4))
    timed = choice.leading
    assert len(timed) >= 2
    base = {(a.micro_batch, a.setting): 0.01 * a.micro_batch for a in timed}     # the same seconds per sample
    slow = dict(base)
    slow[(timed[0].micro_batch, timed[0].setting)] *= 1.2                        # the predicted best, 20% slower
    picked = confirm(choice, slow, 16, STEP, BLOCKS, MACHINE)
    assert picked.best is not timed[0] and picked.best.measured == min(a.measured for a in timed)
    close = dict(base)
    for k in close:                                  # the predicted best 1% slower than the fastest: within CLOSE
        close[k] *= 1.0 if k == (timed[0].micro_batch, timed[0].setting) else 0.99
    picked = confirm(choice, close, 16, STEP, BLOCKS, MACHINE)
    simplest = min(timed, key=lambda a: (-a.micro_batch, len(a.setting.checkpoint)))
    assert picked.best is simplest and CLOSE > 1.01
    # micro-batch 8 with a block checkpointed against 4 unchecked: 3% faster or slower, the larger; 6%: the faster
    pair = [next(a for a in timed if a.setting.checkpoint), next(a for a in timed if not a.setting.checkpoint)]
    assert pair[0].micro_batch > pair[1].micro_batch
    two = Choice(pair[1], choice.alternatives, "", pair)
    scale = pair[0].micro_batch // pair[1].micro_batch                        # the same seconds per sample, then
    for apart in (0.97, 1.03, 1.06):                                           # 3% faster, 3% and 6% slower
        seconds = {(pair[0].micro_batch, pair[0].setting): apart * scale, (pair[1].micro_batch, pair[1].setting): 1.0}
        picked = confirm(two, seconds, 16, STEP, BLOCKS, MACHINE)
        assert picked.best is (pair[0] if apart < CLOSE else pair[1])
        assert ("3.0% slower than" in picked.reason) == (apart == 1.03)     # the trade-off said where taken
        assert ("with fewer micro-batches" in picked.reason) == (apart == 1.03)
    # bf16 last: a plan at the step's own precision with more micro-batches, 1% slower, is taken, and said so
    cast = [Alternative(16, Setting((), "bfloat16"), 1.0, 100), Alternative(8, Setting(), 1.0, 100)]
    picked = confirm(Choice(cast[0], choice.alternatives, "", cast), {(16, cast[0].setting): 1.0,
                     (8, Setting()): 0.505}, 16, STEP, BLOCKS, MACHINE)
    assert picked.best is cast[1] and "without bf16 autocast" in picked.reason and "1.0% slower" in picked.reason
    assert confirm(choice, {}, 16, STEP, BLOCKS, MACHINE).best is choice.best      # nothing timed: as it was
    # an uneven last micro-batch: 16 in micro-batches of 12 is one of 12 and one of 4, priced by the time model
    a = next(x for x in timed)
    one = confirm(choice, {(x.micro_batch, x.setting): 1.0 for x in timed}, 16, STEP, BLOCKS, MACHINE)
    assert one.best.measured >= 1.0 and a.measured is not None


def test_the_leading_take_one_alternative_per_setting_first_building_up_to_new_after_memory_models_for_them():
    """GPT-2 768x12 between budgets: micro-batches 2 and 4 without checkpointing, predicted alike, led alone (only
    their setting's bytes were at hand); 8 with half the blocks checkpointed, a step 1.5x faster, was never timed.
    Here micro-batch 4 unchecked is the fastest that fits; 2 unchecked, then 8 with 2 blocks checkpointed, are
    within `lead`: the one slot goes to the other setting, its memory model built for it (at most `new_after`)."""
    step = Cost(ops=100, kernels=((1, 3e-3), (16, 4.8e-2)))            # linear kernels: host work per micro-batch
    key = lambda a: (a.micro_batch, len(a.setting.checkpoint))
    run = lambda new_after, leading=2: search(SETS, micro_batch_sizes(8), 8, step, BLOCKS, MACHINE, counted, 1480,
                                              lead=1.3, leading=leading, new_after=new_after)
    counted, calls = peaks()
    old = run(new_after=0)
    assert key(old.best) == (4, 0) and [key(a) for a in old.leading] == [(4, 0), (2, 0)]
    times = {key(a): a.time for a in old.alternatives}
    assert times[(4, 0)] < times[(2, 0)] < times[(8, 2)] <= 1.3 * times[(4, 0)]
    counted, calls = peaks()
    new = run(new_after=2)
    assert key(new.best) == (4, 0) and [key(a) for a in new.leading] == [(4, 0), (8, 2)]
    # the plain step's before the best (does not fit); then, for the leading, 1 block's (does not fit at 8) and 2's;
    # none for 4 with blocks checkpointed (slower by construction than 4 unchecked)
    assert [len(s.checkpoint) for s in calls] == [0, 1, 2]
    counted, calls = peaks()
    # 1 block's model built (at 8 it does not fit; at 2 slower by construction than 2 unchecked), 2 blocks' not
    assert [key(a) for a in run(new_after=1).leading] == [(4, 0), (2, 0)] and len(calls) == 2
    counted, calls = peaks()
    # a slot left: the best's setting at another micro-batch, after the other setting (8 with 3 blocks and 2 with 1
    # fit too, but are slower by construction than 8 with 2 and 2 unchecked)
    three = run(new_after=2, leading=3).leading
    assert [key(a) for a in three] == [(4, 0), (8, 2), (2, 0)]
    assert [key(a) for a in trial_order(three, 8)] == [(4, 0), (8, 2), (2, 0)]


def test_the_trials_take_another_setting_before_another_micro_batch_of_one_already_ordered():
    from memfit.fitting.search import Alternative
    two, four = Alternative(2, Setting(), 1.0), Alternative(4, Setting(), 1.01)
    ckpt = Alternative(8, Setting(("b0", "b1")), 1.1)
    ckpt4 = Alternative(4, Setting(("b0", "b1")), 1.12)
    order = trial_order([two, four, ckpt, ckpt4], 8)
    assert order == [two, ckpt, four, ckpt4]
    plain = Alternative(8, Setting(), 1.0)
    assert trial_order([two, four, ckpt, plain], 8) == [two, plain, ckpt, four]


def test_a_deferred_alternative_that_does_not_fit_rules_out_nothing():
    """Review (GPT-2 768x12 between budgets, seen for real): micro-batch 8 with 3 blocks checkpointed, deferred (its
    setting led already at 4) and over the budget, ruled out 8 with 6 as slower by construction; 6 was never timed.
    Here kernels superlinear past 2: micro-batch 4 unchecked is deferred and does not fit; 4 with 1 block does."""
    blocks = {f"b{i}": Cost(ops=5, kernels=((1, 1e-5), (8, 8e-5))) for i in range(4)}
    step = Cost(ops=100, kernels=((1, 1e-3), (2, 2e-3), (4, 5.2e-3), (8, 12e-3)))
    bytes_of = lambda s: (lambda m: 1000 + m * (100 - 20 * len(s.checkpoint)))
    choice = search(SETS, micro_batch_sizes(8), 8, step, blocks, MACHINE, bytes_of, 1350, lead=1.15, leading=3,
                    new_after=2)
    key = lambda a: (a.micro_batch, len(a.setting.checkpoint))
    four = next(a for a in choice.alternatives if key(a) == (4, 0))
    assert four.bytes > 1350 and four.time < next(a for a in choice.alternatives if key(a) == (4, 1)).time
    assert [key(a) for a in choice.leading] == [(2, 0), (4, 1)]


def test_exhaustive_computes_more_bytes_but_leads_and_chooses_alike():
    """`exhaustive=True` is for explain() and plots: the memory models it builds for them let no other alternative
    lead (review: 209 of 20,000 random searches led differently, so the plan could differ)."""
    import random
    rng = random.Random(0)
    key = lambda c: ((c.best.micro_batch, c.best.setting) if c.best else None,
                     [(a.micro_batch, a.setting) for a in c.leading])
    for _ in range(300):
        blocks = {f"b{i}": Cost(ops=rng.randint(1, 30), kernels=((1, rng.uniform(1e-5, 5e-4)),
                                                                  (8, rng.uniform(1e-4, 4e-3))))
                  for i in range(rng.choice([2, 4, 8]))}
        n = rng.choice([3, 5, 8, 12])
        sizes, points, t = micro_batch_sizes(n), [], 0.0
        for m in sizes:
            t += rng.uniform(0.5, 2.0) * 1e-3 * (m - (points[-1][0] if points else 0))
            points.append((m, t))
        step = Cost(ops=rng.randint(10, 300), kernels=tuple(points))
        machine = Machine(op_seconds=1e-5, checkpoint_seconds=rng.uniform(0, 1e-4))
        save, noise = rng.uniform(5, 25), {(k, m): rng.randint(0, 30) for k in range(9) for m in sizes}
        bytes_of = lambda s, save=save, noise=noise: (
            lambda size: int(1000 + size * (100 - save * len(s.checkpoint)) + noise[len(s.checkpoint), size]))
        args = ([Setting(s) for s in checkpoint_sets(list(blocks))], sizes, n, step, blocks, machine, bytes_of,
                rng.randint(1000, 1000 + n * 100))
        options = dict(lead=rng.choice([1.15, 1.3, 1.6]), leading=3, new_after=rng.choice([1, 2]))
        assert key(search(*args, **options)) == key(search(*args, exhaustive=True, **options))


def test_where_trials_cost_next_to_nothing_a_wider_window_leads():
    """`bench fit`'s GPT-2 (a step of a few ms): in one fit of five micro-batch 4 unchecked was predicted beyond
    1.15x 8 with 1 block and not timed; for real the two ran alike, and the other four fits, which timed both, took
    4. A plain micro-step predicted at most CHEAP widens the window to WIDE; a long one keeps LEAD."""
    from memfit.fitting.search import CHEAP, LEAD, WIDE
    assert wide_lead(CHEAP / 10) == wide_lead(CHEAP) == WIDE > LEAD == wide_lead(CHEAP * 1.01) == wide_lead(1.0)
    step = Cost(ops=100, kernels=((1, 3e-3), (16, 4.8e-2)))
    key = lambda a: (a.micro_batch, len(a.setting.checkpoint))
    bytes_of, _ = peaks()
    run = lambda lead: search(SETS, micro_batch_sizes(8), 8, step, BLOCKS, MACHINE, bytes_of, 1400, lead=lead,
                              leading=2, new_after=3)
    narrow, wide = run(1.15), run(wide_lead(micro_step_seconds(8, step, BLOCKS, Setting(), MACHINE)))
    assert micro_step_seconds(8, step, BLOCKS, Setting(), MACHINE) <= CHEAP
    times = {key(a): a.time for a in narrow.alternatives}
    assert 1.15 * times[(4, 0)] < times[(8, 3)] <= WIDE * times[(4, 0)]       # 8 with 3 blocks: the other setting
    assert [key(a) for a in narrow.leading] == [(4, 0), (2, 0)] and [key(a) for a in wide.leading] == [(4, 0), (8, 3)]


def test_the_adds_cost_their_kernels_only():
    """Each add takes the place of the detach AccumulateGrad runs where it takes a gradient over (counted in the
    step's backward): a later micro-batch's host work is the first's."""
    later = Cost(ops=0, backward_ops=100, kernels=((1, 0.25), (16, 0.25)))
    host = Machine(op_seconds=1e-5, backward_op_seconds=1e-3)              # 0.1 s of host work if counted
    added = step_seconds(16, 8, STEP, BLOCKS, Setting(), host, later=later) - \
        step_seconds(16, 8, STEP, BLOCKS, Setting(), host)
    assert added == pytest.approx(0.25)


def test_confirm_adds_what_the_trials_dropout_at_p0_leaves_out_of_each_recomputation():
    """A trial runs Dropout at p = 0: each checkpointed block's `Cost.dropped` (its Dropout modules' work, run again
    in the recomputation) is added once per micro-batch, the uneven last one at its own size; nothing where no
    block is checkpointed."""
    drop = Cost(ops=3, kernels=((1, 1e-3), (16, 1.6e-2)))            # 1 ms a sample
    blocks = {k: replace(BLOCK, dropped=drop) for k in BLOCKS}
    choice = _leading_search(10**9)
    pair = [Alternative(16, Setting(), 1.0, 100), Alternative(16, Setting(("b0", "b1")), 1.0, 100),
            Alternative(12, Setting(("b0",)), 1.0, 100)]
    two = Choice(pair[0], choice.alternatives, "", pair)
    seconds = {(a.micro_batch, a.setting): 1.0 for a in pair}
    base = {k: replace(BLOCK) for k in BLOCKS}
    confirm(two, seconds, 16, STEP, base, MACHINE)
    without = [a.measured for a in pair]
    confirm(two, seconds, 16, STEP, blocks, MACHINE)
    assert pair[0].measured == without[0]
    assert pair[1].measured == pytest.approx(without[1] + 2 * drop.at(16, MACHINE))
    # 16 in micro-batches of 12: one of 12 and one of 4, each recomputing b0's dropout at its size
    assert pair[2].measured == pytest.approx(without[2] + drop.at(12, MACHINE) + drop.at(4, MACHINE))
