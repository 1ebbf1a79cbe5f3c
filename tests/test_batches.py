"""A batch of several inputs (a tuple: positional, a dict: keyword) means the same to evaluate, accumulate and
the memory model, and each agrees with a plain PyTorch loop over `model(feats, ids)`."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.batches import batch_len, batch_nbytes, batch_slice, batch_tensors, batch_to, forward
from memfit.compact import CompactDataset
from memfit.device.measure import track_memory, unique_bytes

N, F_IN, L, V, H, C = 24, 16, 5, 50, 32, 3


class TwoInputs(nn.Module):
    """forward(feats, ids): two inputs of different dtypes, so swapping or packing them fails loudly."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(F_IN, H)
        self.emb = nn.Embedding(V, H)
        self.head = nn.Linear(H, C)

    def forward(self, feats, ids):
        assert feats.is_floating_point() and not ids.is_floating_point(), "inputs swapped or packed"
        return self.head(torch.relu(self.lin(feats) + self.emb(ids).mean(1)))


def data(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randint(0, 256, (n, F_IN), generator=g).float() / 64      # exact in a uint8 codec + scale
    ids = torch.randint(0, V, (n, L), generator=g)
    y = torch.randint(0, C, (n,), generator=g)
    return feats, ids, y


def model_(seed=0):
    torch.manual_seed(seed)
    return TwoInputs()


def shapes(feats, ids, kind):
    return (feats, ids) if kind == "tuple" else {"feats": feats, "ids": ids}


def batches(kind, size=7):
    feats, ids, y = data()
    return [(shapes(feats[s:s + size], ids[s:s + size], kind), y[s:s + size]) for s in range(0, N, size)]


def plain_metrics(model):
    feats, ids, y = data()
    with torch.no_grad():
        out = model(feats, ids)
    return (out.argmax(1) == y).double().mean().item(), F.cross_entropy(out, y).item()


# ---- the helpers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["tensor", "tuple", "list", "dict"])
def test_helpers_treat_every_kind_alike(kind):
    a, b = torch.arange(12.0).view(6, 2), torch.arange(6)
    x = {"tensor": a, "tuple": (a, b), "list": [a, b], "dict": {"a": a, "b": b, "flag": True}}[kind]
    want = [a] if kind == "tensor" else [a, b]
    assert [t.data_ptr() for t in batch_tensors(x)] == [t.data_ptr() for t in want]
    assert batch_len(x) == 6 and batch_nbytes(x) == sum(t.nbytes for t in want)
    part = batch_slice(x, 2, 5)
    assert type(part) is type(x) and [t.tolist() for t in batch_tensors(part)] == [t[2:5].tolist() for t in want]
    assert all(p.data_ptr() == t[2:].data_ptr() for p, t in zip(batch_tensors(part), want, strict=True))  # views
    moved = batch_to(x, torch.device("cpu"))
    assert type(moved) is type(x) and all(m is t for m, t in zip(batch_tensors(moved), want, strict=True))
    if kind == "dict":
        assert part["flag"] is True and moved["flag"] is True            # non-tensors pass through
    args, kwargs = forward(lambda *args, **kw: (args, kw), x)
    if kind == "dict":                      # model(**x)
        assert args == () and kwargs.keys() == x.keys() and all(kwargs[k] is x[k] for k in x)
    else:                                   # model(x) or model(*x)
        assert kwargs == {} and len(args) == len(want) and all(g is t for g, t in zip(args, want, strict=True))


def test_copies_to_the_cpu_block_and_copies_to_a_device_do_not(monkeypatch):
    """A non-blocking copy from CUDA to the CPU returns before its bytes arrive and the host reads them at once
    (evaluate's chunks of a dataset on the GPU decoded on the CPU, a batch on the GPU for a model on the CPU):
    only copies onto a device may be non-blocking. The moves are recorded (this machine may have no GPU)."""
    moves = []

    def to(self, device, non_blocking=False):
        moves.append((torch.device(device).type, non_blocking))
        return self
    monkeypatch.setattr(torch.Tensor, "to", to)
    x = {"a": torch.zeros(2, device="meta"), "b": (torch.ones(2, device="meta"), None)}   # elsewhere: moved
    batch_to(x, torch.device("cpu"))
    batch_to(x, torch.device("cuda", 0))
    assert moves == [("cpu", False)] * 2 + [("cuda", True)] * 2
    here = {"a": torch.zeros(2)}
    assert batch_to(here, torch.device("cpu"))["a"] is here["a"] and len(moves) == 4     # there already: not moved


def test_batch_len_of_no_tensors_says_what_it_expected():
    with pytest.raises(TypeError, match="expected a batch"):
        batch_len({"flag": True})


# ---- evaluate ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_evaluate_batches_of_two_inputs_equal_a_plain_loop(kind):
    model = model_()
    r = memfit.evaluate(model, batches(kind), device="cpu", progress=False)
    acc, loss = plain_metrics(model)
    assert r.n == N and r.metrics["accuracy"] == pytest.approx(acc) and r.metrics["loss"] == pytest.approx(loss)


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_evaluate_halves_a_batch_of_two_inputs_on_out_of_memory(kind):
    """The halves of a tuple batch are halves of each input, not the first and second input."""
    class OOMAbove4(TwoInputs):
        def forward(self, feats, ids):
            if feats.shape[0] > 4:
                raise torch.OutOfMemoryError("out of memory (simulated above 4 samples)")
            return super().forward(feats, ids)
    model = OOMAbove4()
    model.load_state_dict(model_().state_dict())
    r = memfit.evaluate(model, batches(kind), device="cpu", progress=False)
    acc, loss = plain_metrics(model_())
    assert r.retries > 0 and max(r.oom_sizes) == 7
    assert r.n == N and r.metrics["accuracy"] == pytest.approx(acc) and r.metrics["loss"] == pytest.approx(loss)


def test_evaluate_a_loader_and_arrays_over_dict_fields_equal_a_plain_loop():
    feats, ids, y = data()
    arrays = {"feats": feats.numpy(), "ids": ids.numpy()}
    ds = CompactDataset.from_arrays(arrays, y.numpy(), device="cpu")
    decoded = ds.batch(np.arange(N))[0]
    assert torch.equal(decoded["feats"], feats) and torch.equal(decoded["ids"], ids)     # stored exactly
    model = model_()
    acc, loss = plain_metrics(model)
    for data_ in (memfit.loader(ds, 5, shuffle=False, device="cpu"), (arrays, y.numpy()), ds):
        r = memfit.evaluate(model, data_, device="cpu", progress=False)
        assert r.n == N, type(data_).__name__
        assert r.metrics["accuracy"] == pytest.approx(acc) and r.metrics["loss"] == pytest.approx(loss, rel=1e-5)


# ---- accumulate --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["tuple", "dict"])
@pytest.mark.parametrize("micro_batch", [5, "auto"])
def test_accumulate_two_inputs_equals_a_plain_full_batch_step(kind, micro_batch):
    feats, ids, y = data()
    ref, mod = model_(), model_()
    ref_opt, mod_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mod))
    loss = F.cross_entropy(ref(feats, ids), y)
    loss.backward()
    ref_opt.step()
    r = memfit.accumulate(mod, mod_opt, (shapes(feats, ids, kind), y), F.cross_entropy, micro_batch=micro_batch,
                          budget="1GiB")
    assert r.loss == pytest.approx(loss.item(), rel=1e-6)
    assert r.micro_batches == (5 if micro_batch == 5 else 1)      # 1 GiB holds the whole batch
    for (name, p), q in zip(mod.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name


# ---- the memory model ------------------------------------------------------------------------------------------
def plain_step_bytes(model, opt, feats, ids, y) -> int:
    """Live bytes at the peak of a plain training step (after one warm-up step), plus what is held before it."""
    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(feats, ids), y).backward()
        opt.step()
    step()
    opt.zero_grad(set_to_none=True)
    held = unique_bytes([*model.parameters(), *model.buffers(), feats, ids, y,
                         *(v for st in opt.state.values() for v in st.values())])
    with track_memory("cpu") as mem:
        step()
    return held + mem.peak


def test_memory_model_of_a_tuple_and_a_dict_agree_with_a_plain_step():
    model = model_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    feats, ids, y = data(2)
    mms = {kind: memfit.memory_model(model, shapes(feats, ids, kind), train=True, optimizer=opt,
                                     loss_fn=F.cross_entropy, target=y) for kind in ("tuple", "dict")}
    infer = {kind: memfit.memory_model(model, shapes(feats, ids, kind)) for kind in ("tuple", "dict")}
    for n in (3, 11):
        assert mms["tuple"].total_bytes(n) == mms["dict"].total_bytes(n)
        assert infer["tuple"].total_bytes(n) == infer["dict"].total_bytes(n)
        real_model = copy.deepcopy(model)
        real = plain_step_bytes(real_model, torch.optim.AdamW(real_model.parameters(), lr=1e-3), *data(n))
        assert 1.0 <= mms["tuple"].total_bytes(n) / real <= 1.05, (n, mms["tuple"].total_bytes(n), real)
