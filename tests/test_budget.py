import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.budget import BudgetExceeded, Ledger, format_bytes, parse_bytes, resolve_budget
from memfit.device.machine import device_memory, devices, resolve_device


@pytest.mark.parametrize("text, expected", [
    ("1.5GiB", 3 * 2**29), ("1.5 gib", 3 * 2**29), ("64MiB", 64 * 2**20), ("64 MB", 64 * 10**6),
    ("2kb", 2000), ("2KiB", 2048), ("512", 512), (" 7 B ", 7), ("0", 0), (".5KiB", 512), ("1TB", 10**12),
    (1000, 1000), (0, 0),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "5 parsecs", "-1", "-2 GiB", "", "1.2.3MB", "GiB"])
def test_parse_bytes_rejects_garbage_naming_the_forms(bad):
    with pytest.raises(ValueError, match="KiB/MiB/GiB"):
        parse_bytes(bad)


def test_parse_bytes_rejects_negative_ints_and_wrong_types():
    with pytest.raises(ValueError, match=">= 0"):
        parse_bytes(-5)
    with pytest.raises(TypeError, match="bool"):
        parse_bytes(True)
    with pytest.raises(TypeError, match="list"):
        parse_bytes([1])


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1536, 2**20 * 3, 2**30 * 5 // 2, 2**40])
def test_format_bytes_round_trips_through_parse(n):
    text = format_bytes(n)
    # two decimals: the parsed value is within 0.5% of the original
    assert abs(parse_bytes(text.replace(" ", "")) - n) <= n * 0.005 + 1


def test_format_bytes_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"


def test_ledger_reports_every_item_when_over():
    led = Ledger(budget=1000, what="loader").add("dataset", 700).add("batches", 400)
    assert not led.fits and led.total == 1100
    with pytest.raises(BudgetExceeded, match=r"(?s)loader needs 1.07 KiB.*dataset.*700 B.*batches.*400 B") as e:
        led.check(hint="use a smaller batch")
    assert isinstance(e.value, MemoryError)
    assert e.value.needed == 1100 and e.value.budget == 1000
    assert "use a smaller batch" in str(e.value)
    Ledger(budget=1100).add("x", 1100).check()     # exactly at the budget fits


def test_cpu_memory_is_sane():
    info = device_memory("cpu")
    assert 0 < info.free <= info.total
    assert info.held > 0                      # this process holds at least the interpreter
    assert devices()[0].device == "cpu"
    assert 0 < resolve_budget(None, "cpu") < info.free
    assert resolve_budget("1MiB", "cpu") == 2**20


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="expected a device"):
        resolve_device("gpu7")
    if not torch.cuda.is_available():
        assert resolve_device(None) == torch.device("cpu")
        with pytest.raises(ValueError, match="no CUDA"):
            resolve_device("cuda")


def test_no_device_means_the_current_cuda_device_not_cuda_0(monkeypatch):
    """A rank that called torch.cuda.set_device(1) and left device out must get cuda:1 (its data next to its
    model), as device='cuda' does; cuda:0 would put every rank's data on one GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device(None) == torch.device("cuda", 1) == resolve_device("cuda")
    assert resolve_device("cuda:0") == torch.device("cuda", 0)


@pytest.mark.cuda
def test_cuda_memory_uses_mem_get_info():
    free, total = torch.cuda.mem_get_info(0)
    info = device_memory("cuda:0")
    assert info.total == total and abs(info.free - free) < 64 * 2**20


@pytest.mark.parametrize("size, expected", [
    (1e9, 10**9), (2.0, 2), ("1.3 KiB", 1331), ("1.1 TB", 1_100_000_000_000), ("0.5B", None), ("1.5", None),
    (1.5, None), ("3 Gi", None),
])
def test_parse_bytes_never_drops_a_fraction_of_a_byte_silently(size, expected):
    """A whole count passes; a fraction of a larger unit is rounded down to whole bytes (exactly, not
    through a float); a fractional count of bytes is refused, telling the user to round it."""
    if expected is None:
        with pytest.raises(ValueError, match="whole number of bytes|unknown unit"):
            parse_bytes(size)
    else:
        assert parse_bytes(size) == expected


@pytest.mark.parametrize("text, binary, decimal", [("1G", "1GiB", "1GB"), ("64k", "64KiB", "64KB"),
                                                   ("2 M", "2MiB", "2MB"), ("1t", "1TiB", "1TB")])
def test_parse_bytes_refuses_ambiguous_units_offering_both_spellings(text, binary, decimal):
    with pytest.raises(ValueError, match=f"ambiguous unit.*'{binary}'.*'{decimal}'"):
        parse_bytes(text)


def test_parse_bytes_takes_any_integral():
    import numpy as np
    assert parse_bytes(np.int64(4096)) == 4096 and parse_bytes(np.uint32(7)) == 7
    assert parse_bytes(torch.tensor(5)) == 5
    with pytest.raises(TypeError, match="ndarray"):
        parse_bytes(np.array([1, 2]))


def test_check_count_accepts_integrals_and_names_the_argument():
    import numpy as np

    from memfit.budget import check_count
    assert check_count("batch_size", np.int64(32)) == 32 and type(check_count("n", np.int32(3))) is int
    assert check_count("seed", 0, 0) == 0
    with pytest.raises(ValueError, match=r"expected seed to be an int >= 0; found -1"):
        check_count("seed", -1, 0)
    with pytest.raises(TypeError, match=r"expected epochs to be an int >= 1; found float 2\.0"):
        check_count("epochs", 2.0)
    with pytest.raises(TypeError, match="bool"):
        check_count("batch_size", True)


def test_counts_accept_numpy_ints_across_the_api():
    """Every count the API takes goes through the one check: numpy ints work where ints do."""
    import numpy as np

    import memfit
    x, y = memfit.readers.synthetic(np.int64(64), shape=(np.int64(1), 4, 4), seed=np.int64(0))
    ds = memfit.CompactDataset.from_arrays(x, y, device="cpu")
    ld = memfit.loader(ds, np.int64(16), seed=np.int64(1), device="cpu", strategy="macro", macro_batch=np.int64(32))
    assert [len(b) for b, _ in ld] == [16] * 4
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 10))
    r = memfit.evaluate(model, ds, chunk_size=np.int64(10), progress=False)
    assert r.chunks == 7 and r.n == 64
    assert memfit.max_batch_size(model, (np.int64(1), 4, 4), "1MiB", extra_bytes_per_sample=np.int64(16)) > 0


# ---- the model's device and the largest count that fits -------------------------------------------------------
def test_model_device_looks_at_parameters_then_buffers():
    from memfit.budget import model_device
    assert model_device(torch.nn.Linear(2, 2).to("meta")) == torch.device("meta")
    bn = torch.nn.BatchNorm1d(3, affine=False).to("meta")           # buffers only
    assert next(bn.parameters(), None) is None and model_device(bn) == torch.device("meta")
    assert model_device(torch.nn.ReLU()) == torch.device("cpu")       # neither: the CPU


def test_evaluate_checks_the_device_of_a_model_with_only_buffers():
    import memfit
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(3, affine=False)).to("meta")
    with pytest.raises(ValueError, match=r"the model is on meta but device='cpu'; move it with model.to\('cpu'\)"):
        memfit.evaluate(model, (torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)), device="cpu", progress=False)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(0, 5000), st.integers(0, 300), st.integers(0, 40), st.integers(0, 700))
def test_largest_fitting_is_the_brute_force_boundary(budget, a, b, upper):
    from memfit.budget import largest_fitting
    peak = lambda n: a + b * n + (n * n) // 50               # non-decreasing, not affine
    expected = max((n for n in range(1, upper + 1) if peak(n) <= budget), default=0)
    assert largest_fitting(peak, budget, upper) == expected


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.integers(0, 5000), st.integers(0, 300), st.integers(0, 40), st.integers(0, 700), st.integers(0, 2000),
       st.integers(1, 400))
def test_largest_fitting_from_a_lower_function_is_the_brute_force_boundary_and_asks_only_near_it(
        budget, a, b, upper, jump, at):
    """With `below` (never above peak: a model without its per-size measured workspaces) the search asks peak only
    at or below below's answer, and gives what brute force gives, whatever the gap between the two; O(log) calls
    of peak even where its guess (the gap taken as proportional to n) is far off."""
    from memfit.budget import largest_fitting
    lower = lambda n: a + b * n + (n * n) // 50
    peak = lambda n: lower(n) + (jump if n >= at else 0) + n // 3     # non-decreasing, >= lower everywhere
    asked = []
    expected = max((n for n in range(1, upper + 1) if peak(n) <= budget), default=0)
    top = max((n for n in range(1, upper + 1) if lower(n) <= budget), default=0)
    assert largest_fitting(lambda n: asked.append(n) or peak(n), budget, upper, below=lower) == expected
    assert all(n <= top for n in asked)
    assert len(asked) <= 2 * max(top, 1).bit_length() + 3


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.integers(0, 10**7), st.integers(0, 3000), st.integers(1, 400), st.floats(0, 3))
def test_a_gap_in_proportion_to_the_batch_is_found_in_a_few_calls(budget, a, b, ratio):
    """What `below` leaves out (a kernel's workspace: the demo CNN's convolution, a third of its bytes) grows with the
    batch: peak is asked at below's answer, at the guess and beside it, where galloping down from below's answer
    asked 20 times (the demo's max_batch_size, 1348 against 2020 without the workspaces)."""
    from memfit.budget import largest_fitting
    lower = lambda n: a + b * n
    peak = lambda n: lower(n) + int(ratio * b * n)
    asked = []
    expected = max((n for n in range(1, 5001) if peak(n) <= budget), default=0)
    assert largest_fitting(lambda n: asked.append(n) or peak(n), budget, 5000, below=lower) == expected
    assert len(asked) <= 5, asked
