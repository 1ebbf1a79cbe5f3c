"""Chunked evaluation against the unchunked computation: exact metrics whatever the chunking."""
import functools
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit import evaluate, loader
from memfit.budget import is_oom, largest_fitting
from memfit.compact import CompactDataset
from memfit.evaluation.chunks import Chunks
from memfit.evaluation.estimates import choose_chunk

torch.manual_seed(0)
RNG = np.random.default_rng(0)


def make_data(n, classes=10):
    x = RNG.integers(0, 256, (n, 1, 4, 4), dtype=np.uint8)
    y = RNG.integers(0, classes, n)
    return x, y


def make_model(classes=10):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, classes))


def unchunked(model, x, y, k=3):
    """The reference: the whole set through the model at once, metrics the textbook way."""
    with torch.no_grad():
        logits = model(torch.from_numpy(x).float())
    y = torch.from_numpy(y)
    return {"accuracy": (logits.argmax(1) == y).double().mean().item(),
            "loss": F.cross_entropy(logits.double(), y).item(),
            f"topk:{k}": (logits.topk(k, 1).indices == y[:, None]).any(1).double().mean().item(),
            "confusion": torch.bincount(y * 10 + logits.argmax(1), minlength=100).view(10, 10)}


METRICS = ("accuracy", "loss", "topk:3", "confusion")


@pytest.mark.parametrize("n, chunk", [(1001, 1), (1001, 7), (1001, 50), (1001, 999), (1001, 1001),
                                      (10_000, 50), (10_001, 50), (10_001, 10_001)])
def test_chunked_equals_unchunked(n, chunk):
    x, y = make_data(n)
    model = make_model()
    ref = unchunked(model, x, y)
    r = evaluate(model, (x, y), metrics=METRICS, chunk_size=chunk, device="cpu", progress=False)
    assert r.n == n and r.chunks == -(-n // chunk) and r.chunk_size == chunk
    assert r.metrics["accuracy"] == ref["accuracy"]                  # counts: exactly equal
    assert r.metrics["topk:3"] == ref["topk:3"]
    assert torch.equal(r.metrics["confusion"], ref["confusion"])
    assert r.metrics["loss"] == pytest.approx(ref["loss"], rel=1e-6)  # float rounding only


def test_seed_averaging_is_wrong_on_an_uneven_split_and_memfit_is_not():
    x, y = make_data(10_001)
    model = make_model()
    ref = unchunked(model, x, y)["accuracy"]
    with torch.no_grad():                         # the naive way: mean of per-chunk accuracies over chunks of 50
        per_chunk = [(model(torch.from_numpy(x[i:i + 50]).float()).argmax(1) == torch.from_numpy(y[i:i + 50]))
                     .double().mean().item() for i in range(0, 10_001, 50)]
    seed_value = sum(per_chunk) / len(per_chunk)
    assert seed_value != ref
    assert evaluate(model, (x, y), metrics=("accuracy",), chunk_size=50, device="cpu",
                    progress=False).metrics["accuracy"] == ref


class FakeOOM(torch.nn.Module):
    """Raises torch.OutOfMemoryError for chunks above `limit` (or once at call `once`); records calls.

    Inputs carry their sample index in the first pixel, so the record says which chunk was run."""

    def __init__(self, inner, limit=None, once=None):
        super().__init__()
        self.inner, self.limit, self.once, self.calls = inner, limit, once, []

    def forward(self, x):
        first = int(x.flatten(1)[0, 0])
        fail = (self.limit is not None and x.shape[0] > self.limit) or len(self.calls) == self.once
        self.calls.append((first, x.shape[0], not fail))
        if fail:
            big = torch.empty(x.shape[0], 1000)          # held by the frame when the error is raised
            raise torch.OutOfMemoryError(f"fake: {x.shape[0]} samples do not fit ({big.shape})")
        return self.inner(x)


def indexed_data(n):
    x = RNG.integers(0, 256, (n, 1, 4, 4)).astype(np.float32)
    x[:, 0, 0, 0] = np.arange(n)                         # the sample's index, stored exactly
    return x, RNG.integers(0, 10, n)


def test_back_off_retries_only_the_failed_chunk_and_counts_nothing_twice():
    x, y = indexed_data(1000)
    wrapped = FakeOOM(make_model(), limit=60)
    ds = CompactDataset.from_arrays(x, y, codec="float32", device="cpu")
    r = evaluate(wrapped, ds, metrics=METRICS, chunk_size=200, device="cpu", progress=False, planned=False)
    ref = unchunked(make_model(), x, y)
    assert r.metrics["accuracy"] == ref["accuracy"] and torch.equal(r.metrics["confusion"], ref["confusion"])
    assert r.metrics["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    done = [(s, n) for s, n, ok in wrapped.calls if ok]
    covered = np.concatenate([np.arange(s, s + n) for s, n in done])
    assert np.array_equal(np.sort(covered), np.arange(1000))            # each sample exactly once
    for i, (s, n, ok) in enumerate(wrapped.calls):                      # a failure is retried at its own start
        if not ok:
            assert wrapped.calls[i + 1][:2] == (s, n // 2)
    assert r.retries == sum(not ok for *_, ok in wrapped.calls) > 0
    assert max(n for _, n in done) <= 60


def test_back_off_grows_back_after_a_transient_oom():
    x, y = indexed_data(1000)
    wrapped = FakeOOM(make_model(), once=2)
    r = evaluate(wrapped, (x, y), chunk_size=100, device="cpu", progress=False, planned=False)
    sizes = [n for _, n, _ in wrapped.calls]
    assert sizes[:6] == [100, 100, 100, 50, 100, 100]          # fails once at the 3rd, retries 50, grows back
    assert r.retries == 1 and r.n == 1000 and r.oom_sizes == [100]


def test_gives_up_when_one_sample_does_not_fit():
    x, y = indexed_data(10)
    with pytest.raises(torch.OutOfMemoryError, match="a single sample does not fit"):
        evaluate(FakeOOM(make_model(), limit=0), (x, y), chunk_size=4, device="cpu", progress=False, planned=False)


def test_oom_messages_are_recognised():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"))
    assert is_oom(RuntimeError("HIP out of memory. Tried to allocate"))
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_real_out_of_memory_on_cpu_backs_off(tmp_path):
    """RLIMIT_AS caps the address space so that the whole set cannot run in one chunk."""
    script = textwrap.dedent("""
        import resource, sys, numpy as np, torch
        from memfit import evaluate
        torch.manual_seed(0)
        n = 4000
        x = np.random.default_rng(0).integers(0, 256, (n, 1, 8, 8), dtype=np.uint8)
        y = np.random.default_rng(1).integers(0, 10, n)
        # 4000 x 8192 float32 = 125 MiB of hidden activations for the whole set at once
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8192), torch.nn.ReLU(),
                                    torch.nn.Linear(8192, 10))
        ref = evaluate(model, (x, y), chunk_size=50, device="cpu", progress=False, planned=False)
        def vm():
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
        limit = vm() + 160 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        r = evaluate(model, (x, y), chunk_size=n, device="cpu", progress=False, planned=False)
        print(r.retries, r.metrics["accuracy"] == ref.metrics["accuracy"],
              abs(r.metrics["loss"] - ref.metrics["loss"]) < 1e-6 * abs(ref.metrics["loss"]), r.oom_sizes)
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    retries, acc_equal, loss_equal, sizes = out.stdout.split(maxsplit=3)
    assert int(retries) >= 1 and acc_equal == "True" and loss_equal == "True", out.stdout


def test_largest_fitting_is_the_boundary():
    for budget in (0, 5, 99, 100, 101, 10**6):
        peak = lambda n: 37 + 7 * n
        best = largest_fitting(peak, budget, 5000)
        if best:
            assert peak(best) <= budget and (best == 5000 or peak(best + 1) > budget)
        else:
            assert peak(1) > budget


def test_auto_chunk_respects_the_budget_by_memfit_accounting():
    x, y = make_data(3000)
    model = make_model()
    ds = CompactDataset.from_arrays(x, y, device="cpu")
    from memfit.evaluation.estimates import MAX_AUTO_CHUNK
    chunks = Chunks(ds, torch.device("cpu"))
    for budget in (200_000, 1_000_000):
        n, estimate, reason = choose_chunk(model, chunks, budget, model)
        assert 1 <= n <= 3000 and estimate(n) <= budget
        assert n == min(3000, MAX_AUTO_CHUNK) or estimate(n + 1) > budget
        r = evaluate(model, ds, chunk_size="auto", budget=budget, device="cpu", progress=False)
        assert r.chunk_size == n and r.peak_bytes <= budget
        assert r.metrics["accuracy"] == unchunked(model, x, y)["accuracy"]


def test_model_mode_is_restored():
    x, y = make_data(50)
    model = make_model()
    model.train()
    evaluate(model, (x, y), chunk_size=10, device="cpu", progress=False)
    assert model.training
    model.eval()
    evaluate(model, (x, y), chunk_size=10, device="cpu", progress=False)
    assert not model.training
    model.train()
    with pytest.raises(ValueError):
        evaluate(model, (x, y + 100), chunk_size=10, device="cpu", progress=False)
    assert model.training                                      # restored after an error too
    frozen = list(model.modules())[1]
    frozen.eval()                                              # a frozen part of a model in training
    modes = [m.training for m in model.modules()]
    evaluate(model, (x, y), chunk_size=10, device="cpu", progress=False)
    assert [m.training for m in model.modules()] == modes and model.training and not frozen.training


def test_dropout_and_batchnorm_run_in_eval_mode():
    x, y = make_data(64)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Dropout(0.9), torch.nn.Linear(16, 10))
    model.train()
    model(torch.randn(32, 1, 4, 4))                          # move the running stats away from the init
    a = evaluate(model, (x, y), chunk_size=7, device="cpu", progress=False).metrics
    model.eval()
    assert a["accuracy"] == unchunked(model, x, y)["accuracy"]


def test_torchmetrics_objects_match_builtins():
    torchmetrics = pytest.importorskip("torchmetrics")
    x, y = make_data(777)
    model = make_model()
    acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
    top3 = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro", top_k=3)
    r = evaluate(model, (x, y), metrics=("accuracy", "topk:3", acc, top3), chunk_size=50, device="cpu",
                 progress=False)
    assert r.metrics["MulticlassAccuracy"] == pytest.approx(r.metrics["accuracy"])
    assert r.metrics["MulticlassAccuracy_2"] == pytest.approx(r.metrics["topk:3"])
    assert acc.compute().item() == pytest.approx(r.metrics["accuracy"])
    assert top3.compute().item() == pytest.approx(r.metrics["topk:3"])


def test_loss_fn_forms_give_the_same_mean():
    x, y = make_data(333)
    model = make_model()
    ref = unchunked(model, x, y)["loss"]
    for fn in (torch.nn.CrossEntropyLoss(), torch.nn.CrossEntropyLoss(reduction="sum"),
               torch.nn.CrossEntropyLoss(reduction="none"), lambda o, t: F.cross_entropy(o, t, reduction="none")):
        r = evaluate(model, (x, y), metrics=("loss",), loss_fn=fn, chunk_size=50, device="cpu", progress=False)
        assert r.metrics["loss"] == pytest.approx(ref, rel=1e-6)


def test_iterable_of_batches():
    x, y = make_data(100)
    model = make_model()
    ds = CompactDataset.from_arrays(x, y, device="cpu")
    batches = [ds.batch(range(i, min(i + 30, 100))) for i in range(0, 100, 30)]
    r = evaluate(model, batches, chunk_size="auto", device="cpu", progress=False)
    assert r.n == 100 and r.chunks == 4 and r.metrics["accuracy"] == unchunked(model, x, y)["accuracy"]


def test_a_torch_dataloader_over_a_torch_dataset():
    """A plain torch DataLoader (its dataset a TensorDataset, or one whose `.targets` is a list of labels, as
    torchvision's) is an iterable of (x, y) batches: the textbook metrics. (It raised AttributeError: 'TensorDataset'
    object has no attribute 'targets', from the lookup meant for a memfit Loader's CompactDataset.)"""
    x, y = make_data(50)
    model = make_model()
    xt, yt = torch.from_numpy(x).float(), torch.from_numpy(y)

    class Labelled(torch.utils.data.TensorDataset):
        targets = y.tolist()
    want = unchunked(model, x, y)
    for ds in (torch.utils.data.TensorDataset(xt, yt), Labelled(xt, yt)):
        r = evaluate(model, torch.utils.data.DataLoader(ds, batch_size=16), progress=False)
        assert r.n == 50 and r.metrics["accuracy"] == want["accuracy"]
        assert r.metrics["loss"] == pytest.approx(want["loss"], rel=1e-6)


@pytest.mark.parametrize("data, kwargs, error, match", [
    (make_data(20), dict(), None, None),
    ((make_data(20)[0], make_data(20)[1] + 10), dict(), ValueError, r"label 1\d is out of range for a model with 10 "),
    ((np.zeros((0, 1, 4, 4), np.uint8), np.zeros(0)), dict(), ValueError, "empty"),
    ((make_data(20)[0], make_data(19)[1]), dict(), ValueError, "x has 20 samples but y has 19 targets"),
    (make_data(20), dict(metrics=("f1",)), ValueError, "unknown metric 'f1'"),
    (make_data(20), dict(metrics=()), ValueError, "metrics is empty"),
    (make_data(20), dict(chunk_size=0), ValueError, "chunk_size must be 'auto' or an int >= 1"),
    ("images.npy", dict(), TypeError, "data must be a CompactDataset"),
])
def test_bad_input(data, kwargs, error, match):
    model = make_model()
    kwargs = {"chunk_size": 8, "device": "cpu", "progress": False, **kwargs}
    if error is None:
        evaluate(model, data, **kwargs)
        return
    with pytest.raises(error, match=match):
        evaluate(model, data, **kwargs)


def test_output_that_is_not_n_by_classes():
    x, y = make_data(20)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 10, 3))          # (N, 10, 2, 2)
    with pytest.raises(ValueError, match=r"accuracy: found outputs of shape \(8, 10, 2, 2\) and targets of shape "
                                         r"\(8,\); the output must have one more dimension than the targets"):
        evaluate(model, (x, y), metrics=("accuracy",), chunk_size=8, device="cpu", progress=False)


def test_plans_are_reused_across_calls_and_do_not_keep_the_model_alive(monkeypatch):
    """Evaluating every epoch captures the model once; the arena is freed after each call, and the
    cache lets the model be garbage-collected."""
    import gc
    import weakref

    import memfit.planner
    x, y = make_data(300)
    ds = CompactDataset.from_arrays(x, y, device="cpu")
    model = make_model()
    calls = []
    real = memfit.planner.planned.capture_model
    monkeypatch.setattr(memfit.planner.planned, "capture_model",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    first = evaluate(model, ds, chunk_size=128, planned=True, progress=False)   # chunks 128, 128, 44
    captured = len(calls)
    assert captured == 1 and first.runner == "planned"            # one capture, the batch symbolic
    with torch.no_grad():
        model[1].weight.mul_(-1)                                    # in-place updates are seen
    second = evaluate(model, ds, chunk_size=128, planned=True, progress=False)
    assert len(calls) == captured
    ref = unchunked(model, x, y)
    assert second.metrics["accuracy"] == ref["accuracy"] != first.metrics["accuracy"]
    model[1] = torch.nn.Linear(16, 32)                              # a replaced layer: planned again
    evaluate(model, ds, chunk_size=128, planned=True, progress=False)
    assert len(calls) > captured
    model[2] = torch.nn.LeakyReLU(0.01)
    evaluate(model, ds, chunk_size=128, planned=True, progress=False)
    captured = len(calls)
    model[2].negative_slope = 0.5           # an attribute the captured graph baked in as a constant: planned again
    third = evaluate(model, ds, chunk_size=128, planned=True, progress=False)
    assert len(calls) > captured and third.runner == "planned"
    assert third.metrics["loss"] == pytest.approx(unchunked(model, x, y)["loss"], rel=1e-5)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_auto_chunk_is_capped_where_larger_chunks_stop_paying(monkeypatch):
    monkeypatch.setattr(sys.modules["memfit.evaluation.estimates"], "MAX_AUTO_CHUNK", 64)
    x, y = make_data(300)
    model = make_model()
    r = evaluate(model, (x, y), budget="1GiB", progress=False)
    assert r.chunk_size == 64 and r.chunks == 5 and "would fit" in r.reason
    assert r.metrics["accuracy"] == unchunked(model, x, y)["accuracy"]


def test_float_features_are_evaluated_exactly():
    """A model labelled with its own predictions scores exactly 1.0: float inputs are stored losslessly
    (a quantising default once scored 0.9932 here, with one feature 100x the others)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 10).eval()
    x = torch.randn(3000, 32)
    x[:, 5] *= 100
    with torch.no_grad():
        y = model(x).argmax(1)
    r = evaluate(model, (x.numpy(), y.numpy()), metrics=("accuracy",), device="cpu", progress=False)
    assert r.metrics["accuracy"] == 1.0


# ---- any output structure, exact loss sums, dict inputs --------------------------------------------------
class Wrapped(torch.nn.Module):
    """A linear classifier whose logits come back wrapped the way real models return them."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin = kind, torch.nn.Linear(6, 4)

    def forward(self, x):
        z = self.lin(x)
        if self.kind == "tuple":
            return z, z.sum()
        if self.kind == "list":
            return [z]
        if self.kind == "dict":
            return {"hidden": z * 0, "logits": z}
        if self.kind == "object":
            return types.SimpleNamespace(logits=z, loss=None)
        return {"scores": z}


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "object", "custom"])
def test_logits_from_any_output_structure(kind):
    torch.manual_seed(0)
    model = Wrapped(kind).eval()
    x, y = torch.randn(50, 6), torch.randint(0, 4, (50,))
    with torch.no_grad():
        z = model.lin(x)
    ref_acc = (z.argmax(1) == y).double().mean().item()
    ref_loss = torch.nn.functional.cross_entropy(z.double(), y).item()
    fn = (lambda out: out["scores"]) if kind == "custom" else None
    r = evaluate(model, (x.numpy(), y.numpy()), chunk_size=16, device="cpu", progress=False, output_fn=fn)
    assert r.metrics["accuracy"] == ref_acc and r.metrics["loss"] == pytest.approx(ref_loss, rel=1e-6)


def test_dict_output_without_logits_says_how_to_pick_them():
    with pytest.raises(ValueError, match=r"without a 'logits' tensor \(keys \['scores'\]\); pass output_fn="):
        evaluate(Wrapped("custom"), (np.zeros((4, 6), np.float32), np.zeros(4)), device="cpu", progress=False)


def summing(out, y):
    return torch.nn.functional.cross_entropy(out, y, reduction="sum")


@pytest.mark.parametrize("loss_fn, reduction", [
    (torch.nn.CrossEntropyLoss(reduction="sum"), None),
    (functools.partial(torch.nn.functional.cross_entropy, reduction="sum"), None),
    (torch.nn.functional.cross_entropy, None),
    (summing, "sum"),
    (lambda out, y: torch.nn.functional.cross_entropy(out, y), "mean"),
    (lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"), None),
])
def test_loss_is_the_whole_set_mean_whatever_the_reduction(loss_fn, reduction):
    model, x, y = elementwise_problem(101)
    ref = torch.nn.functional.cross_entropy(x.double(), y).item()
    r = evaluate(model, (x, y), metrics=("loss",), loss_fn=loss_fn, loss_reduction=reduction, chunk_size=17,
                 device="cpu", progress=False)
    assert r.metrics["loss"] == pytest.approx(ref, rel=1e-6)


def test_a_scalar_loss_of_unknown_reduction_is_refused():
    model, x, y = elementwise_problem(20)
    with pytest.raises(ValueError, match=r"cannot tell whether it is the mean or the sum.*loss_reduction='mean'"):
        evaluate(model, (x, y), metrics=("loss",), loss_fn=summing, device="cpu", progress=False)


def elementwise_problem(n):
    """A model whose outputs do not depend on how the set is chunked (elementwise ops only)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 5, generator=g) * 30
    y = torch.randint(0, 5, (n,), generator=g)
    return torch.nn.Sequential(torch.nn.Identity()).eval(), x, y


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.integers(1, 300), st.lists(st.integers(1, 300), min_size=1, max_size=3))
def test_loss_is_chunking_invariant(n, sizes):
    model, x, y = elementwise_problem(n)
    # per-sample losses in float32 (as the model's dtype gives them), summed in float64 in one go
    ref = torch.nn.functional.cross_entropy(x, y, reduction="none").double().sum().item() / n
    for size in sizes:
        r = evaluate(model, (x, y), metrics=("loss",), chunk_size=size, device="cpu", progress=False)
        assert abs(r.metrics["loss"] - ref) <= 1e-12 * abs(ref)


def test_all_nan_outputs_warn_once_naming_the_chunk():
    class Broken(torch.nn.Module):
        def forward(self, x):
            return x * float("nan")
    x, y = np.ones((30, 3), np.float32), np.zeros(30, np.int64)
    with pytest.warns(RuntimeWarning, match=r"all NaN for samples 0\.\.9") as rec:
        evaluate(Broken(), (x, y), chunk_size=10, device="cpu", progress=False)
    assert len([w for w in rec if "NaN" in str(w.message)]) == 1


def test_fixed_chunk_size_says_why_no_planner_and_no_fake_peak():
    model, x, y = elementwise_problem(40)
    r = evaluate(model, (x, y), chunk_size=8, device="cpu", progress=False)
    assert r.peak_bytes is None and "peak not measured" in str(r)
    assert "the planner is not used with a fixed chunk_size" in r.reason


def test_reason_is_whole_and_wrapped_when_printed():
    model, x, y = elementwise_problem(40)
    r = evaluate(model, (x, y), chunk_size=8, device="cpu", progress=False)
    r.reason = "x" * 30 + " Eq(u0, 1) data-dependent " + "y" * 150
    text = str(r)
    assert "Eq(u0, 1) data-dependent" in text.replace("\n     ", " ") and "y" * 150 in text


def test_dict_inputs_are_passed_as_keywords():
    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.meta = torch.nn.Embedding(1000, 4), torch.nn.Linear(3, 4)

        def forward(self, input_ids, meta):
            return self.emb(input_ids).sum(1) + self.meta(meta)
    torch.manual_seed(0)
    model = TwoInputs().eval()
    ids, meta = torch.randint(0, 1000, (70, 6)), torch.randn(70, 3)
    y = torch.randint(0, 4, (70,))
    with torch.no_grad():
        ref = (model(ids, meta).argmax(1) == y).double().mean().item()
    data = CompactDataset.from_arrays({"input_ids": ids, "meta": meta}, y, device="cpu")
    for chunk in ("auto", 9):
        r = evaluate(model, data, chunk_size=chunk, device="cpu", progress=False)
        assert r.metrics["accuracy"] == ref and r.n == 70
    r = evaluate(model, loader(data, 16, device="cpu", shuffle=False), device="cpu", progress=False)
    assert r.metrics["accuracy"] == ref


# ---- errors that say what happened, and memfit eval --------------------------------------------------------
def test_float_inputs_to_a_token_model_are_a_dtype_mistake():
    model = torch.nn.Sequential(torch.nn.Embedding(50, 4), torch.nn.Flatten(), torch.nn.Linear(12, 3)).eval()
    ids = np.random.default_rng(0).integers(0, 50, (20, 3))
    r = evaluate(model, (ids, np.zeros(20, np.int64)), device="cpu", progress=False)       # integer data stays int64
    assert r.n == 20
    floats = CompactDataset.from_arrays(ids, np.zeros(20, np.int64), dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match=r"inputs are float32 but the model wants integer inputs.*--dtype int64"):
        evaluate(model, floats, device="cpu", progress=False)


def test_a_loss_fns_own_dtype_error_is_not_blamed_on_the_inputs():
    """torch's 'expected scalar type Long' raised by loss_fn on uint8 masks is the loss's error, not a dtype
    mistake of the (float) inputs (old: 'the inputs are float32 but the model wants integer inputs')."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 5, 1)
    x, y = torch.randn(4, 3, 2, 2), torch.randint(0, 5, (4, 2, 2), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="Long") as err:
        evaluate(model, [(x, y)], metrics=["loss"], loss_fn=torch.nn.CrossEntropyLoss(), progress=False)
    assert "inputs" not in str(err.value)


EVAL_NET = "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))\n"
TOKEN_NET = ("import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Embedding(100, 4), torch.nn.Flatten(),"
             " torch.nn.Linear(24, 3))\n")


def test_eval_refuses_a_whole_pickled_model_naming_the_file(tmp_path, capsys):
    from memfit.cli import main
    (tmp_path / "net.py").write_text(EVAL_NET)
    torch.save(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)), tmp_path / "whole.pt")
    code = main(["eval", f"{tmp_path}/net.py:make", "--weights", str(tmp_path / "whole.pt"), "--data", "synthetic:50"])
    err = capsys.readouterr().err
    assert code == 1 and "\x1b[" not in err
    assert f"{tmp_path / 'whole.pt'}: expected a state_dict" in err and "whole pickled model" in err
    assert "torch.save(model.state_dict()" in err and "weights_only=False" not in err


def test_eval_without_weights_needs_random_weights(tmp_path, capsys):
    from memfit.cli import main
    (tmp_path / "net.py").write_text(EVAL_NET)
    code = main(["eval", f"{tmp_path}/net.py:make", "--data", "digits"])
    assert code == 2 and "--random-weights" in capsys.readouterr().err
    assert main(["eval", f"{tmp_path}/net.py:make", "--data", "digits", "--random-weights", "--json"]) == 0


def test_eval_token_data_and_dtype_mistake(tmp_path, capsys):
    import json

    from memfit.cli import main
    (tmp_path / "tok.py").write_text(TOKEN_NET)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 100, (60, 6)), rng.integers(0, 3, 60)
    np.savez(tmp_path / "t.npz", x_train=x[:40], y_train=y[:40], x_test=x[40:], y_test=y[40:])
    args = ["eval", f"{tmp_path}/tok.py:make", "--random-weights", "--data", str(tmp_path / "t.npz")]
    assert main([*args, "--json"]) == 0                          # integer data: int64 ids, no normalisation
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n"] == 20
    assert main([*args, "--dtype", "float32"]) == 1
    assert "the model wants integer inputs" in capsys.readouterr().err


def test_an_extrapolated_chunk_estimate_says_it_is_approximate(monkeypatch, caplog):
    """When fake tensors cannot run the model the estimate comes from two small runs: labelled APPROXIMATE."""
    import logging

    from memfit.evaluation import estimates
    x, y = make_data(64)
    model = make_model()
    monkeypatch.setattr(estimates, "_fake_peak", lambda model, chunks, why: (None, why))
    chunks = Chunks(CompactDataset.from_arrays(x, y, device="cpu"), torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="memfit.evaluate"):
        peak, how, source = estimates.eager_peak(model, model, chunks, "")
    assert how.startswith("APPROXIMATE") and "APPROXIMATE" in caplog.text and source is estimates.Source.MEASURED
    assert peak(16) >= peak(4) > 0


def test_a_chunk_sized_for_the_planner_is_sized_again_when_the_planner_cannot_run(monkeypatch):
    """The planned forward holds less than the eager one: when the plan cannot be borrowed after all, the
    chunk is sized again for the eager forward instead of running a planner-sized chunk over the budget."""
    from memfit.planner import kept as cache
    x, y = make_data(3000)
    model = make_model()
    ds = CompactDataset.from_arrays(x, y, device="cpu")
    chunks = Chunks(ds, torch.device("cpu"))
    budget = 100_000
    planned_size, est, _ = choose_chunk(model, chunks, budget, model, use_plan=None)
    eager_size, _, _ = choose_chunk(model, chunks, budget, model, use_plan=False)
    assert est.planned and eager_size < planned_size                 # the case this test is about

    def refuse(*a, **k):
        raise RuntimeError("no arena today")
    monkeypatch.setattr(cache, "borrow_plan", refuse)
    r = evaluate(model, ds, budget=budget, device="cpu", progress=False)
    assert r.runner == "eager" and r.chunk_size == eager_size and "sized again" in r.reason
    assert r.metrics["accuracy"] == unchunked(model, x, y)["accuracy"]


def test_eval_result_reads_as_a_mapping():
    x, y = make_data(30)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 10))
    res = evaluate(model, (x, y), chunk_size=7, device="cpu", progress=False)
    assert res["accuracy"] == res.metrics["accuracy"] and list(res) == ["accuracy", "loss"]
    assert dict(res) == res.metrics and len(res) == 2 and "loss" in res
    with pytest.raises(KeyError, match=r"no metric 'mse' in this result; it has \['accuracy', 'loss'\]"):
        res["mse"]


def test_a_drop_last_loader_is_said_to_leave_samples_out():
    """A loader built with drop_last=True scores only its full batches: the result says n and a warning says why,
    never a silent part of the set."""
    import warnings

    import memfit
    x, y = make_data(10)
    model = make_model()
    with pytest.warns(UserWarning, match="drop_last=True.*not over the whole set"):
        r = evaluate(model, memfit.loader((x, y), 4, drop_last=True, device="cpu", seed=0), progress=False)
    assert r.n == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert evaluate(model, memfit.loader((x, y), 4, device="cpu", seed=0), progress=False).n == 10


def test_an_ignore_index_that_is_not_the_datas_is_refused():
    # ignore_index=0 replaced the data's 255 silently: torch's raw "Target 255 is out of bounds", or 255s counted
    x = np.random.default_rng(0).standard_normal((20, 3, 5, 5)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 4, (20, 5, 5)).astype(np.uint8)
    y[:, 0, 0] = 255
    ds = CompactDataset.from_arrays(x, y, ignore_index=255)
    m = torch.nn.Conv2d(3, 4, 1)
    with pytest.raises(ValueError, match=r"ignore_index=0, but the data marks .* with 255.*pass ignore_index=255"):
        evaluate(m, ds, ignore_index=0, loss_fn=torch.nn.CrossEntropyLoss(ignore_index=0))
    said = evaluate(m, ds, ignore_index=255, loss_fn=torch.nn.CrossEntropyLoss(ignore_index=255))
    with torch.no_grad():
        out, t = m(torch.from_numpy(x)), torch.from_numpy(y).long()
    ref = torch.nn.functional.cross_entropy(out, t, ignore_index=255)
    assert said.metrics["loss"] == pytest.approx(float(ref), rel=1e-5)
    assert said.metrics["loss"] == pytest.approx(evaluate(m, ds).metrics["loss"], rel=1e-6)
