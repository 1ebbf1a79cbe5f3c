"""The benchmarks' shared table and timing helpers: one number format per column, bytes readable,
and a warning when repeated timings spread too much to be trusted."""
import re
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.budget import format_bytes, parse_bytes
from memfit.cli.bench.common import median, spread, spread_warning, table


def _cells(text: str, column: int) -> list[str]:
    return [line.split()[column] for line in text.splitlines()[2:]]


@settings(max_examples=60, derandomize=True, deadline=None)
@given(st.lists(st.floats(min_value=1e-4, max_value=1e7, allow_nan=False), min_size=1, max_size=8))
def test_a_float_column_has_one_format_and_keeps_three_digits_of_its_smallest_value(values):
    out = _cells(table([{"x": v} for v in values]), 0)
    decimals = {len(c.partition(".")[2]) for c in out}
    assert len(decimals) == 1                                   # one format for the whole column
    d = decimals.pop()
    for cell, v in zip(out, values, strict=True):
        assert abs(float(cell.replace(",", "")) - v) <= 0.5 * 10**-d * (1 + 1e-9)
    smallest = min(values)
    if d < 3:                                                   # at most 3 decimals; below that, 3 digits
        assert smallest >= 10 ** (2 - d) * 0.99


def test_ints_get_separators_bytes_get_units_and_text_passes():
    rows = [{"n": 60000, "held": 3 * 2**20, "name": "uint8", "ratio": 0.25},
            {"n": 512, "held": 700, "name": "float32", "ratio": 1}]
    text = table(rows, bytes_columns={"held"})
    assert _cells(text, 0) == ["60,000", "512"]
    assert [parse_bytes(c) for c in re.findall(r"\d+(?:\.\d+)? (?:B|KiB|MiB)", text)] == [3 * 2**20, 700]
    assert format_bytes(3 * 2**20) in text and "uint8" in text
    assert re.search(r"0\.250\s*$", text.splitlines()[2]) and re.search(r"1\.000\s*$", text.splitlines()[3])


def test_spread_is_the_interquartile_range_over_the_median():
    times = [1.0, 1.1, 1.2, 1.3, 5.0]
    q1, _, q3 = statistics.quantiles(times, n=4)
    assert spread(times) == (q3 - q1) / statistics.median(times)
    assert spread([2.0, 3.0]) == 0.4                              # fewer than 4: the range
    assert spread([1.0]) == 0.0


def test_a_busy_machine_is_reported_once_then_forgotten():
    spread_warning()                                              # forget what other tests timed
    assert median([1.0, 1.01, 0.99, 1.0, 1.02], "steady") == 1.0
    assert spread_warning() is None
    median([1.0, 1.01, 0.99, 1.0, 1.02], "steady")
    median([0.1, 0.4, 0.1, 0.9, 0.2], "noisy")
    warning = spread_warning()
    assert warning and "1 of 2 timings" in warning and "noisy" in warning and "busy" in warning
    assert spread_warning() is None


def test_alternating_medians_runs_the_contenders_in_turn():
    from memfit.cli.bench.common import alternating_medians
    calls = []
    out = alternating_medians({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeat=3, warmup=1)
    assert calls == ["a", "b", "b", "a"] * 2            # one warm-up round, then three timed rounds, in turn (ABBA)
    assert set(out) == {"a", "b"} and all(v >= 0 for v in out.values())


def test_paired_ratio_divides_calls_made_back_to_back(monkeypatch):
    """A busy stretch that starts between the two calls of a round and covers more calls of one contender than
    of the other moves the medians apart; the median of the per-round ratios is unmoved (a fake clock makes the
    times exact)."""
    from memfit.cli.bench import common
    common.spread_warning()                         # clear what earlier tests noted
    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    calls = iter(range(10**6))
    busy = {3, 4, 5, 6, 7}          # calls 0, 1 warm up; rounds then go other-base, base-other, ... (ABBA)

    def run(seconds):
        clock[0] += seconds * (5.0 if next(calls) in busy else 1.0)

    t_base, t_other, ratio = common.paired_ratio(lambda: run(1.0), lambda: run(1.5), repeat=5, warmup=1)
    assert ratio == pytest.approx(1.5)
    assert (t_base, t_other) == (3.0, 1.5)          # the medians alone would say 0.5x
    warning = common.spread_warning()               # only the ratio's spread was noted, not the medians'
    assert warning and "1 of 1 timings" in warning and "a ratio" in warning


def test_a_model_measured_in_its_own_process_brings_its_timing_spreads_back():
    from memfit.cli.bench import common
    spread_warning()
    assert common.in_own_process(common.median, [1.0, 3.0], "a child timing") == 2.0      # spread (3 - 1) / 2
    warning = spread_warning()
    assert warning and "a child timing" in warning


def test_rounds_for_times_a_warm_call_and_clamps(monkeypatch):
    from memfit.cli.bench import common
    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    costs = iter([5.0] + [0.01] * 100)         # the first call carries a one-time cost: not counted

    def call():
        clock[0] += next(costs)
    assert common.rounds_for(call, seconds=1.0, at_least=3, at_most=1000) == 100
    assert common.rounds_for(lambda: clock.__setitem__(0, clock[0] + 2.0), seconds=1.0, at_least=3, at_most=9) == 3
    assert common.rounds_for(lambda: None, seconds=1.0, at_least=3, at_most=9) == 9


def test_csv_rows_with_a_column_only_some_have(tmp_path):
    """A contender measured at the largest batch only adds columns to that row: the CSV holds every column, empty
    where a row has none (csv.DictWriter raised on the first row's columns before)."""
    import csv

    from memfit.cli.bench.common import to_csv
    path = tmp_path / "rows.csv"
    to_csv([{"model": "m", "batch": 2}, {"model": "m", "batch": 8, "compiled_peak": 100}], str(path))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"model": "m", "batch": "2", "compiled_peak": ""},
                    {"model": "m", "batch": "8", "compiled_peak": "100"}]


@pytest.mark.parametrize("repeat", [3, 5, 6])
def test_paired_ratio_of_a_call_against_itself_is_one_whatever_runs_second(monkeypatch, repeat):
    """A fake clock on which the call made second in a round runs 10% faster: the same call against itself must
    measure 1.0 with an odd number of rounds too (one ratio per round gave 1.11: three rounds of five had the base
    second). paired_ratio and paired_ratios are one implementation (ABBA pairs)."""
    from memfit.cli.bench import common
    clock, position = [0.0], [0]

    def run():
        clock[0] += 0.9 if position[0] % 2 else 1.0          # the second call of a round is faster
        position[0] += 1
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    assert common.paired_ratio(run, run, repeat=repeat, warmup=1)[2] == pytest.approx(1.0)
    assert common.paired_ratios(run, run, repeat=repeat, warmup=1) == pytest.approx([1.0] * ((repeat + 1) // 2))
    common.spread_warning()


def test_paired_ratios_read_the_clock_given():
    from memfit.cli.bench import common
    ticks = iter(range(100))
    ratios = common.paired_ratios(lambda: None, lambda: None, repeat=2, warmup=0, clock=lambda: float(next(ticks)))
    assert ratios == [1.0]                          # each call spans one tick of the given clock, whatever the wall
    common.spread_warning()


def test_median_interval_holds_the_median_and_narrows_with_more_values():
    from memfit.cli.bench.common import median_interval
    few = [1.0, 0.9, 1.1, 0.95, 1.05, 1.2, 0.8, 1.0]
    lo, hi = median_interval(few)
    assert lo <= sorted(few)[4] <= hi
    many = few * 8
    lo2, hi2 = median_interval(many)
    assert lo <= lo2 <= hi2 <= hi and hi2 - lo2 < hi - lo
    assert median_interval([1.0, 2.0]) == (1.0, 2.0)          # too few: the whole range


def test_paired_ratios_until_measures_more_only_while_the_target_is_in_doubt(monkeypatch):
    from memfit.cli.bench import common
    calls = []

    def fake(fns, repeat, warmup, device, clock=None):      # repeat rounds -> repeat / 2 pair ratios
        calls.append(repeat)
        pairs = list(ratios[:repeat // 2])
        return {"base": [1.0] * 2 * len(pairs), "other": [r for r in pairs for _ in (0, 1)]}
    monkeypatch.setattr(common, "in_turn", fake)
    ratios = [1.20, 1.25, 1.18, 1.22, 1.21, 1.19, 1.23, 1.20]      # clearly above 0.95: the first rounds do
    assert len(common.paired_ratios_until(None, None, 0.95, repeat=16, at_most=96)) == 8 and calls == [16]
    calls.clear()
    ratios = [0.80, 0.82, 0.79, 0.81, 0.80, 0.83, 0.78, 0.80]      # clearly below: no more either
    common.paired_ratios_until(None, None, 0.95, repeat=16, at_most=96)
    assert calls == [16]
    calls.clear()
    ratios = [0.90, 1.00, 0.93, 0.97, 0.91, 0.99, 0.94, 0.96]      # straddles 0.95: more, up to at_most rounds
    out = common.paired_ratios_until(None, None, 0.95, repeat=16, at_most=96)
    assert sum(calls) <= 96 and len(calls) > 1 and len(out) == sum(calls) // 2
