"""Sharding and exact distributed evaluation on CPU with gloo, 2 and 3 processes started here."""
import time

import numpy as np
import pytest
import torch

from memfit import evaluate
from memfit import loader as memfit_loader
from memfit.compact import CompactDataset
from memfit.distributed import RankFailed, agree, epoch_batch_sizes, shard_indices, shard_sizes
from memfit.testing.ranks import run_ranks, spawn

N = 1003                      # not a multiple of 2 or 3: uneven shards


def data():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (N, 1, 4, 4), dtype=np.uint8), rng.integers(0, 10, N)


def model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 10))


@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("mode", ["contiguous", "strided"])
def test_shards_partition_the_data(world, mode):
    parts = [shard_indices(N, r, world, mode) for r in range(world)]
    allidx = torch.cat(parts)
    assert len(allidx) == N and torch.equal(allidx.sort().values, torch.arange(N))   # no overlap, union all
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert sorted(map(len, parts)) == sorted(shard_sizes(N, world))


def test_dataset_shard_holds_its_part_only():
    x, y = data()
    ds = CompactDataset.from_arrays(x, y, device="cpu")
    parts = [ds.shard(r, 3) for r in range(3)]
    assert sum(len(p) for p in parts) == N
    for p in parts:
        idx = p.shard_info.indices
        assert torch.equal(p.batch(range(len(p)))[0], ds.batch(idx)[0])
        assert abs(p.nbytes - ds.nbytes / 3) <= ds.row_nbytes + 64        # about 1/world of the bytes
        assert p.num_classes == ds.num_classes
    with pytest.raises(ValueError, match="already shard 0 of 3"):
        parts[0].shard(0, 2)
    with pytest.raises(ValueError, match="not initialised"):
        ds.shard()
    with pytest.raises(ValueError, match=r"0 <= rank < world_size"):
        ds.shard(3, 3)


@pytest.mark.parametrize("n_max, world, batch", [(5, 2, 2), (10, 3, 4), (334, 3, 64), (7, 4, 2), (3, 2, 2)])
def test_epoch_batch_sizes_equal_counts_no_empty_no_repeat(n_max, world, batch):
    sizes = [n_max - (r > 0) for r in range(world)]
    for drop_last in (False, True):
        per_rank = [epoch_batch_sizes(n, min(sizes), max(sizes), batch, drop_last) for n in sizes]
        assert len({len(b) for b in per_rank}) == 1                         # same number of batches
        for n, b in zip(sizes, per_rank, strict=True):
            assert all(s >= 1 for s in b) and all(s <= batch for s in b)
            assert sum(b) == n if not drop_last else sum(b) <= n


def test_epoch_batch_sizes_says_when_it_cannot_balance():
    with pytest.raises(ValueError, match="cannot fill 7 batches.*drop_last=True"):
        epoch_batch_sizes(6, 6, 7, 1, False)


def _eval_rank(rank, world, chunk_size, fail_rank):
    x, y = data()
    m = model()
    if rank == fail_rank:
        def boom(*_):
            raise RuntimeError("model exploded on purpose")
        m.register_forward_hook(boom)
    ds = CompactDataset.from_arrays(x, y, device="cpu")
    r = evaluate(m, ds, metrics=("accuracy", "loss", "confusion"), chunk_size=chunk_size, device="cpu",
                 progress=False, distributed=True)
    return r.metrics["accuracy"], r.metrics["loss"], r.metrics["confusion"].tolist(), r.n


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_evaluation_equals_single_process(world, request):
    x, y = data()
    single = evaluate(model(), (x, y), metrics=("accuracy", "loss", "confusion"), chunk_size=64, device="cpu",
                      progress=False)
    out = request.getfixturevalue(f"clean_checks_{world}")["eval"]
    assert sorted(out) == list(range(world)), out
    for status, (acc, loss, conf, n) in out.values():
        assert status == "ok"
        assert acc == single.metrics["accuracy"] and n == N                     # exactly, on every rank
        assert loss == pytest.approx(single.metrics["loss"], rel=1e-6)                 # float rounding
        assert conf == single.metrics["confusion"].tolist()


def test_a_failing_rank_makes_the_others_fail_clearly(clean_checks_2):
    out = clean_checks_2["fails"]
    assert max(clean_checks_2.took["fails"].values()) < 60
    assert out[1][0] == "error" and "model exploded on purpose" in out[1][1]
    assert out[0][0] == "error"
    assert "another rank failed (rank 1: RuntimeError: model exploded on purpose)" in out[0][1]


def _prep_fails_rank(rank, world, where):
    x, y = data()
    if rank == 1:
        y = y[:-1]                            # fails while the rank prepares its data: before any collective
    r = evaluate(model(), (x, y), chunk_size="auto", device="cpu", progress=False, distributed=True)
    return r.n


def test_a_rank_failing_before_the_auto_chunk_agreement_stops_every_rank_quickly(clean_checks_2):
    """Its collective timeout is 120 s (CLEAN_CHECKS): a rank waiting for it instead of the agreement takes that."""
    out = clean_checks_2["prep fails"]
    took = max(clean_checks_2.took["prep fails"].values())
    assert sorted(out) == [0, 1], f"a rank hung: {out}"
    assert out[1][0] == "error" and out[1][1].startswith("ValueError") and "1002" in out[1][1]   # its own error
    assert out[0][0] == "error" and "another rank failed (rank 1: ValueError:" in out[0][1] and "1002" in out[0][1]
    assert took < 60, f"{took:.0f} s: a rank waited for the collective timeout instead of the agreement"


def _loader_mistakes(rank, world):
    """Several mistakes in a row on one process group: each stops both ranks, the group stays usable."""
    x, y = data()
    cases = {"labels": ((x, y[:-1] if rank else y), 0), "sizes": ((x[:N - 5 * rank], y[:N - 5 * rank]), 0),
             "seeds": ((x, y), rank), "fine": ((x, y), None)}
    out = {}
    for name, (arrays, seed) in cases.items():
        try:
            ld = memfit_loader(arrays, 64, device="cpu", seed=seed, distributed=True, strategy="stream")
            out[name] = ("ok", len(ld), ld.seed)
        except Exception as e:
            out[name] = ("error", f"{type(e).__name__}: {e}")
    try:                                   # the ranks at two different agreement points: both stop, none waits
        agree(None, "one step" if rank == 0 else "another step")
        out["points"] = ("ok",)
    except RankFailed as e:
        out["points"] = ("error", str(e))
    return out


def test_a_loader_mistake_on_one_rank_stops_every_rank_with_its_reason(clean_checks_2):
    out = clean_checks_2["mistakes"]
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    r0, r1 = out[0][1], out[1][1]
    assert r1["labels"][0] == "error" and "1002" in r1["labels"][1]                  # its own error
    assert r0["labels"][0] == "error" and "another rank failed (rank 1: ValueError:" in r0["labels"][1]
    for r in (r0, r1):
        assert "different sizes (rank 0: 1003, rank 1: 998)" in r["sizes"][1]
        assert "different seeds (rank 0: 0, rank 1: 1)" in r["seeds"][1]
    assert r0["fine"][0] == r1["fine"][0] == "ok" and r0["fine"][2] == r1["fine"][2]   # rank 0's seed, shared
    assert "different agreement points ('one step' here on rank 0)" in r0["points"][1]
    assert "different agreement points ('another step' here on rank 1)" in r1["points"][1]


def _rank_and_world(rank, world):
    return rank, world


def test_ranks_start_while_another_process_holds_the_port_free_port_found(clean_checks_2):
    """Ranks spawned from two pytest-xdist workers at once: a port found free, then bound by rank 0 seconds
    later, could be taken in between (here: at once). The caller's store binds its port as it picks it. The
    spawn of `clean_checks_2` ran while another socket listened on the port `free_port` gave."""
    out = clean_checks_2["rank and world"]
    assert out == {0: ("ok", (0, 2)), 1: ("ok", (1, 2))}, out
    assert clean_checks_2.port_taken


def test_ranks_leave_together_and_never_wait_past_the_bound_for_a_rank_that_died():
    """A rank done early waits for the others before closing its connections (closing at once failed a slower rank
    still in gloo's connectFullMesh: "Connection closed by peer", seen under load), but not past its bound."""
    import torch.distributed as dist

    from memfit.testing.ranks import _leave_together
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.add("memfit/done", 1)                     # the other rank, done first
    start = time.monotonic()
    _leave_together(store, 2, wait_s=30)
    assert time.monotonic() - start < 5              # both done: no wait
    start = time.monotonic()
    _leave_together(store, 4, wait_s=0.5)            # rank 4 of 4 never comes
    assert 0.5 <= time.monotonic() - start < 5


def _rank_1_dies(rank, world):
    import torch.distributed as dist
    dist.barrier()                  # both connected first: a rank gone while rank 0 was still in gloo's
    if rank == 1:                   # connectFullMesh failed rank 0 too ("Connection closed by peer", a loaded VM)
        import os
        os._exit(3)                 # no answer, no exception: as a rank killed or crashing in its work
    return rank


def test_a_rank_that_dies_without_an_answer_is_reported_at_once_not_at_the_timeout():
    import time
    start = time.monotonic()
    out = run_ranks(_rank_1_dies, 2, timeout=120)
    took = time.monotonic() - start
    assert out[0] == ("ok", 0), out
    assert out[1][0] == "error" and "exited with code 3 before answering" in out[1][1], out
    assert took < 60, took          # the old wait lasted the whole 120 s timeout


def _environ(rank, world):
    import os
    return os.environ.get("MEMFIT_TEST_SET_AFTER_START"), os.environ.get("MEMFIT_TEST_ENV")


def test_ranks_see_the_callers_environment_at_the_call_and_env_on_top(monkeypatch):
    """Ranks fork from a server started at the first call, with the environment of that moment: a variable the
    caller sets later must still reach them, as it reached a spawned rank."""
    run_ranks(_rank_and_world, 2, timeout=60)                     # the server runs from here on
    monkeypatch.setenv("MEMFIT_TEST_SET_AFTER_START", "set")
    monkeypatch.delenv("MEMFIT_TEST_ENV", raising=False)
    assert spawn(_environ, 2, timeout=60) == {0: ("set", None), 1: ("set", None)}
    assert spawn(_environ, 2, timeout=60, env={"MEMFIT_TEST_ENV": "given"}) == {0: ("set", "given"),
                                                                                1: ("set", "given")}


def test_the_collective_timeout_is_read_at_each_wait_and_a_bad_one_fails_before_the_collective(monkeypatch):
    import memfit.distributed as md
    monkeypatch.delenv("MEMFIT_DIST_TIMEOUT", raising=False)
    assert md.collective_timeout() == md.DEFAULT_TIMEOUT_S == 120
    monkeypatch.setenv("MEMFIT_DIST_TIMEOUT", "30")
    assert md.collective_timeout() == 30
    issued = []
    monkeypatch.setattr(md.dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(md.dist, "all_reduce", lambda *a, **k: issued.append(a))
    for bad in ("soon", "0", "-5", "nan"):
        monkeypatch.setenv("MEMFIT_DIST_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"MEMFIT_DIST_TIMEOUT to be a number of seconds above 0; found '{bad}'"):
            md.all_reduce(torch.ones(2))
    assert issued == []             # no rank left waiting in a collective this one never joins


def test_distributed_needs_a_process_group():
    x, y = data()
    with pytest.raises(ValueError, match="needs an initialised torch.distributed process group"):
        evaluate(model(), (x, y), device="cpu", progress=False, distributed=True)


def _padded():
    x, y = data()
    y = y.copy()
    y[: N // 3][np.random.default_rng(1).random(N // 3) < 0.8] = -100   # the padding sits mostly on one shard
    return x, y


WEIGHT = torch.linspace(0.25, 3.0, 10)


def _weighted_loss_rank(rank, world):
    x, y = _padded()
    ds = CompactDataset.from_arrays(x, y, device="cpu")
    r = evaluate(model(), ds, metrics=("loss",), loss_fn=torch.nn.CrossEntropyLoss(weight=WEIGHT), chunk_size=50,
                 device="cpu", progress=False, distributed=True)
    return r.metrics["loss"]


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_loss_divides_by_the_summed_torch_denominator(world, request):
    """Ignored targets and class weights make ranks' divisors differ: the divisor is all-reduced state."""
    x, y = _padded()
    with torch.no_grad():
        ref = torch.nn.CrossEntropyLoss(weight=WEIGHT)(model()(torch.from_numpy(x).float()), torch.from_numpy(y))
    out = request.getfixturevalue(f"clean_checks_{world}")["loss"]
    assert sorted(out) == list(range(world)), out
    for status, loss in out.values():
        assert status == "ok", loss
        assert loss == pytest.approx(ref.item(), rel=1e-6)


# ---- a loader of per-field inputs, sharded ---------------------------------------------------------
def _fields():
    """Token ids whose first column is the sample's id, a mask, and float features: per-field inputs."""
    rng = np.random.default_rng(2)
    n = 101
    ids = rng.integers(0, 30000, (n, 6))
    ids[:, 0] = np.arange(n)
    x = {"input_ids": ids, "attention_mask": (rng.random((n, 6)) < 0.7).astype(np.int64),
         "feat": rng.normal(5.0, 3.0, (n, 2, 3)).astype(np.float32)}
    return x, rng.integers(0, 4, n)


FIELD_OPTIONS = dict(codec={"feat": "q8"}, normalize={"feat": "dataset"}, device="cpu")


def _epoch(ld):
    """Every sample of one epoch: {field: (n, ...)} and labels, sorted by sample id."""
    batches = list(ld)
    x = {k: torch.cat([b[0][k] for b in batches]) for k in batches[0][0]}
    y = torch.cat([b[1] for b in batches])
    order = x["input_ids"][:, 0].argsort()
    return {k: v[order] for k, v in x.items()}, y[order], len(batches)


def _fields_loader_rank(rank, world):
    x, y = _fields()
    out = {}
    for strategy in ("resident", "stream"):
        ld = memfit_loader((x, y), 8, strategy=strategy, shuffle=True, seed=3, distributed=True, **FIELD_OPTIONS)
        out[strategy] = _epoch(ld)
    return out


def test_a_distributed_loader_of_fields_gives_each_rank_its_shard_decoded_as_the_whole(clean_checks_2):
    """Each rank holds a contiguous shard; together the ranks see every sample once, decoded bit for bit as
    a single-process loader decodes it (the q8 range and the mean/std of the whole, not of a shard)."""
    x, y = _fields()
    ref_x, ref_y, _ = _epoch(memfit_loader((x, y), 8, shuffle=False, **FIELD_OPTIONS))
    out = clean_checks_2["fields"]
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    for strategy in ("resident", "stream"):
        parts = [out[r][1][strategy] for r in range(2)]
        assert parts[0][2] == parts[1][2]                                     # the same number of batches
        for r, (px, _, _) in enumerate(parts):                                # rank r: its shard, no more
            start = sum(shard_sizes(101, 2)[:r])
            assert px["input_ids"][:, 0].tolist() == list(range(start, start + shard_sizes(101, 2)[r]))
        union_x = {k: torch.cat([p[0][k] for p in parts]) for k in ref_x}
        assert torch.equal(torch.cat([p[1] for p in parts]), ref_y)
        for k, v in ref_x.items():
            assert union_x[k].dtype == v.dtype and torch.equal(union_x[k], v), (strategy, k)


# ---- a rank with nothing to evaluate -----------------------------------------------------------------
EMPTY_METRICS = ("accuracy", "loss", "confusion", "topk:3")


def _summary(r):
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in r.metrics.items()}, r.n


EMPTY_CASES = ("loader", "auto", 4)       # a per-rank loader empty on one rank; fewer samples than ranks


def _empty_rank_eval(rank, world):
    x, y = data()
    ds = CompactDataset.from_arrays(x, y, device="cpu")
    kw = dict(metrics=EMPTY_METRICS, device="cpu", progress=False, distributed=True)
    out = {}
    for case in EMPTY_CASES:
        if case == "loader":    # a per-rank list of batches (a user's own loader), empty on the last rank
            mine = [ds.batch(range(s, min(s + 100, N))) for s in range(0, N, 100)] if rank < world - 1 else []
            out[case] = _summary(evaluate(model(), mine, **kw))
        else:                   # a whole dataset with fewer samples than ranks: the last rank's shard is empty
            out[case] = _summary(evaluate(model(), ds.subset(range(world - 1)), chunk_size=case, **kw))
    return out


def test_a_rank_with_nothing_to_evaluate_neither_hangs_nor_changes_the_result(clean_checks_2):
    """Every rank returns the single-process result over the union; a collective one rank skipped would
    hang (the collective timeout is short here, so a hang fails the test instead of blocking)."""
    x, y = data()
    ds = CompactDataset.from_arrays(x, y, device="cpu")
    batches = [ds.batch(range(s, min(s + 100, N))) for s in range(0, N, 100)]     # the ranks' union, as chunked
    single = {case: _summary(evaluate(model(), batches if case == "loader" else ds.subset(range(1)),
                                      metrics=EMPTY_METRICS, device="cpu", progress=False))
              for case in EMPTY_CASES}
    out = clean_checks_2["empty"]
    assert sorted(out) == [0, 1], f"a rank hung: {out}"
    assert max(clean_checks_2.took["empty"].values()) < 60
    for rank, (status, value) in out.items():
        assert status == "ok", (rank, value)
        for case, (metrics, n) in value.items():
            assert n == single[case][1], (rank, case)
            for k, v in single[case][0].items():
                assert metrics[k] == (pytest.approx(v, rel=1e-12) if k == "loss" else v), (rank, case, k)


ENDS_AFTER_A_COLLECTIVE = """
import torch, torch.distributed as dist
from memfit.distributed import all_reduce
dist.init_process_group("gloo")
group = dist.group.WORLD                 # still referenced at exit, as by a DistributedDataParallel model
all_reduce(torch.ones(1000).clone(), what="the last collective")
import memfit.distributed
assert memfit.distributed._last_work is not None, "the last collective's work is not held: the exit may abort"
"""


@pytest.mark.parametrize("backend, held", [("gloo", True), ("undefined", True), ("cpu:gloo,cuda:nccl", True),
                                            ("nccl", False)])
def test_the_last_work_is_held_whenever_memfit_collectives_run_on_gloo(monkeypatch, backend, held):
    """init_process_group() without a backend reports 'undefined', and a backend per device
    'cpu:gloo,cuda:nccl': memfit's collectives run on gloo (CPU tensors) with both, so the race is theirs too."""
    import memfit.distributed as md

    class Work:
        def wait(self, timeout):
            return True
    monkeypatch.setattr(md.dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(md, "_last_work", None)
    work = Work()
    md._wait(work, "a collective", 1.0)
    assert (md._last_work is work) == held


def test_a_script_that_ends_right_after_a_collective_exits_cleanly(tmp_path):
    """gloo's worker thread used to drop the last reference to a finished collective while the interpreter shut
    down; freeing its tensors then needed the GIL and the process aborted (SIGABRT, 2-4 runs in 10). The abort
    is a race, so clean launches alone would miss a regression some of the time: the script also checks, every
    time, that memfit holds the last work (what prevents it; test_the_last_work_is_held_whenever_... checks it
    for every backend name). One launch of two ranks, each a script run to its interpreter's exit, started as
    torchrun starts them (its environment; the store hosted here, as torchrun's agent hosts it) without
    torchrun's own interpreter (a third start-up of torch, 2.5 s of CPU): a rank that aborts is its own
    exit status here."""
    import os
    import subprocess
    import sys

    import torch.distributed as dist
    script = tmp_path / "ends.py"
    script.write_text(ENDS_AFTER_A_COLLECTIVE)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)     # the port the system picks
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path),   # this checkout's memfit
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}          # the ranks join the store above, as torchrun's
    launches = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        for rank, p in enumerate(launches):
            _, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            assert p.returncode == 0, (rank, p.returncode, err[-1500:])
    finally:                                # a failed or hung launch: none is left running
        for p in launches:
            if p.poll() is None:
                p.kill()
                p.communicate()
        del store


# ---- ranks given different sets, or their own parts ------------------------------------------------------
def _set_of(n, seed=4):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 4, 4), dtype=np.uint8), rng.integers(0, 10, n)


GIVEN_METRICS = ("accuracy", "loss", "confusion")


def _given_rank(rank, world):
    """Each case on one process group, in a row: a case that raises must raise on every rank, none may hang."""
    x, y = _set_of(2000)
    part = slice(0, 1100) if rank == 0 else slice(1100, 2000)         # each rank's own part, split beforehand
    other = _set_of(2000, seed=5 if rank else 4)                       # same size, other samples on rank 1
    cases = {"whole sets of 2000 and 1700": ((x[:2000 - 300 * rank], y[:2000 - 300 * rank]), {}),
             "own parts, not said": ((x[part], y[part]), {}),
             "own parts, sharded=True": ((x[part], y[part]), {"sharded": True}),
             "own parts as datasets, sharded=True": (CompactDataset.from_arrays(x[part], y[part], device="cpu"),
                                                     {"sharded": True}),
             "own parts in plain loaders, sharded=True": (memfit_loader((x[part], y[part]), 128, shuffle=False,
                                                                        device="cpu"), {"sharded": True}),
             "a plain loader over the whole set": (memfit_loader((x, y), 128, shuffle=False, device="cpu"), {}),
             "different sets of one size": (other, {}),
             "one rank sharded, one not": ((x[part], y[part]), {"sharded": rank == 0})}
    out = {}
    for name, (d, kw) in cases.items():
        try:
            out[name] = ("ok", _summary(evaluate(model(), d, metrics=GIVEN_METRICS, chunk_size=256, device="cpu",
                                                 progress=False, distributed=True, **kw)))
        except Exception as e:
            out[name] = ("error", f"{type(e).__name__}: {e}")
    return out


def test_ranks_given_different_sets_raise_and_own_parts_with_sharded_count_each_sample_once(clean_checks_2):
    """Two whole sets of different sizes used to give n=1850 on both ranks (150 samples counted twice, 300 never
    seen), and own parts of 1100 and 900 n=1000, silently. Now every rank raises naming both sizes, and with
    sharded=True each rank evaluates all of its part: the single-process result over the union, exactly."""
    x, y = _set_of(2000)
    single = _summary(evaluate(model(), (x, y), metrics=GIVEN_METRICS, chunk_size=256, device="cpu", progress=False))
    out = clean_checks_2["given"]
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), f"a rank hung or crashed: {out}"
    assert max(clean_checks_2.took["given"].values()) < 90
    for rank in (0, 1):
        r = out[rank][1]
        for name in ("own parts, sharded=True", "own parts as datasets, sharded=True",
                     "own parts in plain loaders, sharded=True"):
            assert r[name][0] == "ok", (rank, name, r[name])
            metrics, n = r[name][1]
            assert n == 2000 == single[1], (rank, name)
            assert metrics["accuracy"] == single[0]["accuracy"] and metrics["confusion"] == single[0]["confusion"]
            assert metrics["loss"] == pytest.approx(single[0]["loss"], rel=1e-6)
        status, msg = r["whole sets of 2000 and 1700"]
        assert status == "error" and "different sizes (rank 0: 2000, rank 1: 1700 samples)" in msg
        assert "sharded=True" in msg
        status, msg = r["own parts, not said"]
        assert status == "error" and "(rank 0: 1100, rank 1: 900 samples)" in msg and "sharded=True" in msg
        status, msg = r["a plain loader over the whole set"]
        assert status == "error" and "Loader built without distributed=True" in msg
        status, msg = r["different sets of one size"]
        assert status == "error" and "different whole sets of the same size (2000 samples" in msg
        status, msg = r["one rank sharded, one not"]
        assert status == "error" and "rank 0: its own part (sharded=True), rank 1: the whole set" in msg


def test_sharded_needs_distributed():
    with pytest.raises(ValueError, match="sharded=True .* needs distributed=True"):
        evaluate(model(), data(), device="cpu", progress=False, sharded=True)


def _parts_loader_rank(rank, world):
    x, y = _set_of(200)
    x[:, 0, 0, 0] = np.arange(200) % 256                  # the sample's id in its first value (200 < 256)
    part = slice(0, 110) if rank == 0 else slice(110, 200)
    out = {}
    for name, kw in {"sharded": {"sharded": True}, "not said": {}, "dataset statistics": {
            "sharded": True, "normalize": "dataset"}}.items():
        try:
            ld = memfit_loader((x[part], y[part]), 16, shuffle=True, seed=1, device="cpu", distributed=True, **kw)
            epochs = [[(xb[:, 0, 0, 0].long().tolist(), yb.tolist()) for xb, yb in ld] for _ in range(2)]
            out[name] = ("ok", len(ld), epochs)
        except Exception as e:
            out[name] = ("error", f"{type(e).__name__}: {e}")
    return out


def test_a_loader_of_own_parts_with_sharded_sees_every_sample_once_per_epoch(clean_checks_2):
    """Parts of 110 and 90 samples: with sharded=True each rank iterates all of its part, in the same number of
    batches on both ranks; without it the loader raises naming both sizes (it always did) and says how."""
    x, y = _set_of(200)
    out = clean_checks_2["parts"]
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    (s0, n0, e0), (s1, n1, e1) = out[0][1]["sharded"], out[1][1]["sharded"]
    assert s0 == s1 == "ok" and n0 == n1 == 7                     # ceil(110 / 16) batches on both ranks
    for epoch in range(2):
        ids = [i for ranks in (e0, e1) for xb, _ in ranks[epoch] for i in xb]
        labels = [v for ranks in (e0, e1) for _, yb in ranks[epoch] for v in yb]
        assert sorted(ids) == list(range(200))                    # every sample once, none twice
        assert labels == [int(y[i]) for i in ids]
        assert sorted(i for xb, _ in e0[epoch] for i in xb) == list(range(110))      # rank 0: its part only
    assert [i for xb, _ in e0[0] for i in xb] != [i for xb, _ in e0[1] for i in xb]   # a new order each epoch
    for rank in (0, 1):
        status, msg = out[rank][1]["not said"]
        assert status == "error" and "different sizes (rank 0: 110, rank 1: 90)" in msg and "sharded=True" in msg
        status, msg = out[rank][1]["dataset statistics"]
        assert status == "error" and "normalize='dataset' with sharded=True" in msg


# ---- the checks of one process group, in one spawn per world size (those failing on purpose last) ------------
CLEAN_CHECKS = {   # name: (rank function, its extra arguments, worlds, collective timeout its test set, s)
    "eval": (_eval_rank, (64, -1), (2, 3), None),
    "loss": (_weighted_loss_rank, (), (2, 3), None),
    "fields": (_fields_loader_rank, (), (2,), None),
    "empty": (_empty_rank_eval, (), (2,), 20.0),
    "parts": (_parts_loader_rank, (), (2,), 30.0),
    "given": (_given_rank, (), (2,), 30.0),
    "rank and world": (_rank_and_world, (), (2,), None),
    # a rank raises and the group must stay usable: last, the checks that fail on purpose
    "mistakes": (_loader_mistakes, (), (2,), None),
    "fails": (_eval_rank, (64, 1), (2,), None),
    "prep fails": (_prep_fails_rank, ("data",), (2,), 120.0),
}


def _clean_checks(rank, world):
    """The checks of CLEAN_CHECKS for this world size, on one process group one after the other (starting the
    processes was most of each check's time): {check: (status, its value or the error it raised, seconds)}.
    Each check runs with the collective timeout its own spawn had (MEMFIT_DIST_TIMEOUT, read at each wait)."""
    import os
    default = os.environ.get("MEMFIT_DIST_TIMEOUT")
    out = {}
    for name, (fn, args, worlds, timeout_s) in CLEAN_CHECKS.items():
        if world not in worlds:
            continue
        if timeout_s:
            os.environ["MEMFIT_DIST_TIMEOUT"] = str(timeout_s)
        elif default is None:
            os.environ.pop("MEMFIT_DIST_TIMEOUT", None)
        else:
            os.environ["MEMFIT_DIST_TIMEOUT"] = default
        t0 = time.perf_counter()
        try:
            out[name] = ("ok", fn(rank, world, *args), time.perf_counter() - t0)
        except Exception as e:          # one check's failure must not hide the others' results
            out[name] = ("error", f"{type(e).__name__}: {e}", time.perf_counter() - t0)
    return out


class Checks(dict):
    """{check: {rank: (status, value)}}, and `took`: {check: {rank: seconds that rank spent in it}}."""
    took: dict
    port_taken: bool = False


def _spawn_clean_checks(world):
    out = run_ranks(_clean_checks, world, timeout=300)
    assert sorted(out) == list(range(world)) and all(s == "ok" for s, _ in out.values()), out
    checks = Checks({name: {rank: value[name][:2] for rank, (_, value) in out.items()} for name in out[0][1]})
    checks.took = {name: {rank: value[name][2] for rank, (_, value) in out.items()} for name in out[0][1]}
    return checks


@pytest.fixture(scope="module")
def clean_checks_2():
    """The spawn at world size 2, started while another socket listens on the port `free_port` gives (as when a
    port found free is taken before a rank binds it: test_ranks_start_while_another_process_holds_the_port_...)."""
    import socket

    import memfit.testing.ranks as ranks
    with socket.socket() as taken, pytest.MonkeyPatch.context() as patch:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        patch.setattr(ranks, "free_port", lambda: taken.getsockname()[1])
        checks = _spawn_clean_checks(2)
        checks.port_taken = ranks.free_port() == taken.getsockname()[1]
    return checks


@pytest.fixture(scope="module")
def clean_checks_3():
    return _spawn_clean_checks(3)


def test_a_module_the_rank_imports_to_find_its_function_sees_the_callers_environment(tmp_path, monkeypatch):
    """The caller's environment at the call must reach code that runs at import in the rank, as it did for a
    spawned rank: the module that holds `fn` is imported while the rank unpickles it, before `_worker` sets the
    environment (a config module reading an environment variable at import, as torch._inductor.config does)."""
    import importlib
    import sys
    (tmp_path / "memfit_review_env_at_import.py").write_text(
        "import os\nAT_IMPORT = os.environ.get('MEMFIT_TEST_AT_IMPORT')\n\n\n"
        "def fn(rank, world):\n    return AT_IMPORT\n")
    run_ranks(_rank_and_world, 2, timeout=60)                     # the server runs from here on
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MEMFIT_TEST_AT_IMPORT", "set")
    mod = importlib.import_module("memfit_review_env_at_import")
    assert mod.AT_IMPORT == "set"
    assert spawn(mod.fn, 2, timeout=60) == {0: "set", 1: "set"}
    sys.modules.pop("memfit_review_env_at_import", None)


def _memfit_file(rank, world):
    import memfit
    return memfit.__file__


def test_ranks_run_the_callers_memfit():
    """The forkserver's server imports memfit from its own sys.path (Python 3.11's forkserver.main ignores the
    sys_path it is handed): where the caller found memfit through a sys.path entry (pytest's pythonpath=src in a
    worktree) and the venv has another (an editable install of another checkout), the ranks ran that other
    memfit, silently."""
    import memfit
    assert spawn(_memfit_file, 2, timeout=60) == {0: memfit.__file__, 1: memfit.__file__}
