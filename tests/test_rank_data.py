"""What each rank holds and the check that ranks hold what they must (memfit.rank_data)."""
import time

import numpy as np
import pytest
import torch

from memfit import evaluate
from memfit import loader as memfit_loader
from memfit.compact import CompactDataset
from memfit.rank_data import check_same_data, content_checksum, data_identity, layout_of
from memfit.testing.ranks import run_ranks


def _set(n=2000, seed=4, y=None):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 1, 4, 4), dtype=np.uint8)
    return x, (rng.integers(0, 10, n) if y is None else y)


def test_two_whole_sets_differing_in_one_row_off_the_sampled_ones_differ():
    """Whole sets were compared on 16 sampled rows: a set differing elsewhere (here row 7, or two rows swapped)
    passed as the same set, and each rank would evaluate its shard of another set, silently."""
    x, y = _set()
    a = CompactDataset.from_arrays(x, y, device="cpu")
    changed = x.copy()
    changed[7, 0, 0, 0] ^= 1
    swapped = x.copy()
    swapped[[5, 6]] = swapped[[6, 5]]
    ids = [data_identity(a, False)] + [data_identity(CompactDataset.from_arrays(v, y, device="cpu"), False)
                                       for v in (changed, swapped)]
    assert ids[0][:3] == ids[1][:3] == ids[2][:3]                     # same kind, size and layout
    assert len({i[3] for i in ids}) == 3 and len({i[4] for i in ids}) == 1
    with pytest.raises(ValueError, match=r"different whole sets of the same size \(2000 samples\): the stored "
                                         r"samples \(x\) of rank 1 differ from rank 0's"):
        check_same_data(ids[:2], "evaluate")
    y2 = y.copy()
    y2[1999] = (y2[1999] + 1) % 10
    other = data_identity(CompactDataset.from_arrays(x, y2, device="cpu"), False)
    with pytest.raises(ValueError, match=r"the stored targets \(y\) of rank 1 differ"):
        check_same_data([ids[0], other], "evaluate")


def test_shards_carry_their_wholes_checksums():
    """Shards were not content-checked: each rank's shard of a different whole of one size passed."""
    x, y = _set()
    a = CompactDataset.from_arrays(x, y, device="cpu")
    b = CompactDataset.from_arrays(x[::-1].copy(), y[::-1].copy(), device="cpu")
    same = [data_identity(a.shard(r, 2), False) for r in range(2)]
    check_same_data(same, "evaluate")
    check_same_data([data_identity(a, False), same[1]], "evaluate")          # a whole and a shard of it
    with pytest.raises(ValueError, match=r"stored samples \(x\) of rank 1 differ from rank 0's"):
        check_same_data([same[0], data_identity(b.shard(1, 2), False)], "evaluate")


def test_the_target_encoding_is_in_the_layout_and_a_difference_is_named():
    """The layout hash said only whether there were targets: class ids and float targets of the same rows
    passed as the same layout."""
    x, y = _set(200)
    ids = CompactDataset.from_arrays(x, y, device="cpu")
    floats = CompactDataset.from_arrays(x, y.astype(np.float32), device="cpu")
    q8 = CompactDataset.from_arrays(x.astype(np.float32) / 3, y, codec="q8", device="cpu")
    ranks = [data_identity(d, True) for d in (ids, floats, q8)]
    assert len({r[2] for r in ranks}) == 3
    with pytest.raises(ValueError, match=r"encoded differently.*rank 1 differs from rank 0 in targets: rank 0 "
                                         r"class ids.*rank 1 float targets.*pass the same codec="):
        check_same_data(ranks[:2], "evaluate", lambda: [layout_of(ids), layout_of(floats)])
    with pytest.raises(ValueError, match=r"rank 1 differs from rank 0 in codec: rank 0 uint8 \(lossless\), rank 1 "
                                         r"q8 \(LOSSY"):
        check_same_data([ranks[0], ranks[2]], "evaluate", lambda: [layout_of(ids), layout_of(q8)])


def test_the_checksum_reads_every_byte_in_chunks(monkeypatch):
    import memfit.rank_data as rd
    monkeypatch.setattr(rd, "CHUNK_BYTES", 1000)          # 16 rows of 784 bytes: several chunks
    t = torch.randint(0, 256, (16, 784), dtype=torch.uint8)
    ref = content_checksum(t)
    for i in (0, 999, 1000, 16 * 784 - 1):
        u = t.clone()
        u.view(-1)[i] ^= 1
        assert content_checksum(u) != ref
    assert content_checksum(t.numpy()) == content_checksum(t.clone()) == ref      # numpy and tensors alike
    assert content_checksum(t.float()) != content_checksum(t.double())             # dtype and bytes count
    assert content_checksum(t.view(8, 2, 784)) != ref                              # so does the shape


def _ranks_given(rank, world):
    """Each case on rank r: what each rank was given, and what it raised (the same on both ranks)."""
    out = {}
    x, y = _set(600)
    lo, hi = np.zeros((300, 1, 4, 4), np.float32), np.full((300, 1, 4, 4), 900.0, np.float32)

    def attempt(case, fn):
        t0 = time.perf_counter()
        try:
            fn()
            out[case] = ("no error", time.perf_counter() - t0)
        except Exception as e:
            out[case] = (f"{type(e).__name__}: {e}", time.perf_counter() - t0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 10))
    # each rank its shard of another whole of the same size (rows in another order on rank 1)
    whole = CompactDataset.from_arrays(x if rank == 0 else x[::-1].copy(), y, device="cpu")
    attempt("shards of different wholes", lambda: evaluate(model, whole.shard(), metrics=("accuracy",),
                                                           distributed=True))
    # a loader over the same whole on every rank, rows in another order on rank 1
    attempt("loader over different wholes", lambda: memfit_loader(whole, 50, distributed=True))
    # each rank its own part, encoded on that rank: 'auto' picks uint8 for rank 0's, another codec for rank 1's
    part = (lo if rank == 0 else hi, np.arange(300) % 10)
    attempt("own parts encoded differently", lambda: memfit_loader(part, 50, distributed=True, sharded=True))
    same = CompactDataset.from_arrays(x, y, device="cpu")
    attempt("the same whole", lambda: memfit_loader(same, 50, distributed=True))
    return out


def test_ranks_given_different_data_all_raise_naming_what_differs():
    out = run_ranks(_ranks_given, 2, timeout=120, env={"MEMFIT_DIST_TIMEOUT": "30"})
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    for rank in (0, 1):
        r = out[rank][1]
        msg, took = r["shards of different wholes"]
        assert msg.startswith("ValueError: evaluate(distributed=True): the ranks were given different whole sets of "
                              "the same size (600 samples): the stored samples (x) of rank 1 differ"), msg
        msg, _ = r["loader over different wholes"]
        assert "the ranks were given different whole sets of the same size (checksums of the stored samples (x)" \
            in msg, msg
        msg, _ = r["own parts encoded differently"]
        assert "the ranks were given parts encoded differently" in msg and "pass codec=" in msg, msg
        assert r["the same whole"][0] == "no error"
        assert took < 10
