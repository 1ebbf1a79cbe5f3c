"""memfit.memory.fsdp_log: what FSDP2 does is logged in the tagging thread only (its collectives, gloo's copies, the
storage resizes, DTensor's sharding lock), and torch's functions are left as found."""
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from device.threads import in_thread
from memfit.device.torch_private import fsdp_collectives, fsdp_param_group
from memfit.memory.fsdp_log import RankLog, gloo_copies, tagging
from memfit.memory.fsdp_run import _fake_group


def test_resizes_are_logged_in_the_tagging_thread_and_the_resize_found_is_put_back():
    """The resize wrapper was set on torch.UntypedStorage for the whole process and deleted on the way out: another
    thread's resizes were logged into this run's log, and a resize_ set on the class before (a user's wrapper; torch's
    MemTracker leaves the base method set there) was lost."""
    calls = []

    def users(storage, size):
        calls.append(size)
        return users.base(storage, size)
    users.base = torch.UntypedStorage.resize_
    own = vars(torch.UntypedStorage).get("resize_")
    log = RankLog(torch.device("cpu"), 2)
    try:
        torch.UntypedStorage.resize_ = users
        with tagging(log):
            s = torch.UntypedStorage(8)
            s.resize_(16)                                   # logged, through the user's wrapper
            logged = len(log.log)
            t = torch.UntypedStorage(8)
            in_thread(lambda: t.resize_(32))                # another thread: not this run's
            assert s.nbytes() == 16 and t.nbytes() == 32 and len(log.log) == logged > 0
        assert vars(torch.UntypedStorage)["resize_"] is users and calls == [16, 32]
    finally:
        if own is None:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = own
    with tagging(log):
        pass
    assert vars(torch.UntypedStorage).get("resize_") is own        # nothing set on it after, where nothing was


def _originals() -> dict:
    """What torch's FSDP2, torch.distributed and DTensor hold under each name `tagging` and `gloo_copies` replace."""
    group, collectives = fsdp_param_group(), fsdp_collectives()
    found = {n: getattr(group, n) for n in ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")}
    found |= {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single")}
    found["foreach_reduce_scatter_copy_in"] = collectives.foreach_reduce_scatter_copy_in
    found["resize_"] = vars(torch.UntypedStorage).get("resize_")
    found["lock"] = _sharding_lock()
    return found


def _sharding_lock():
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    return ShardingPropagator._fake_mode_lock


def _fsdp2_steps():
    """Two real FSDP2 steps of a 2-unit MLP on rank 0 of 2 (torch's fake backend: collectives move no data); SGD
    with momentum, whose second step propagates shardings DTensor has not seen (its lock)."""
    torch.manual_seed(0)
    with _fake_group(2, 0) as mesh:
        m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            m(torch.ones(3, 8)).sum().backward()
            opt.step()
            opt.zero_grad()


def _inside(log: RankLog, entered: threading.Event, leave: threading.Event, failed: list):
    try:
        with tagging(log), gloo_copies(log):
            entered.set()
            if not leave.wait(60):
                failed.append("never told to leave")
    except Exception as e:                                # (a thread's exception would not fail the test)
        failed.append(repr(e))


def test_another_threads_fsdp2_step_gets_torchs_own_functions_while_a_thread_is_inside():
    """The wrappers were set on torch's modules for the whole process: an FSDP2 step in any other thread ran them and
    logged into the tagging thread's log (its all-gathers' groups, gloo's copies, chunk_cat's copies, resizes)."""
    originals = _originals()
    held, entered, leave, failed = RankLog(torch.device("cpu"), 2), threading.Event(), threading.Event(), []
    t = threading.Thread(target=_inside, args=(held, entered, leave, failed), daemon=True)
    t.start()
    try:
        assert entered.wait(60)
        _fsdp2_steps()                                    # this thread: through memfit's replacements to torch's own
        assert (held.ops, held.log, held.events, held.race, held.group, held.paused) == ([], [], [], [], None, False)
        now = _originals()
        for name in ("foreach_all_gather", "foreach_reduce", "all_gather_single", "foreach_reduce_scatter_copy_in"):
            assert getattr(now[name], "_memfit_replaces", None) is originals[name]        # installed, wrapping torch's
    finally:
        leave.set()
        t.join(60)
    assert not t.is_alive() and failed == []
    assert _originals() == originals
    mine = RankLog(torch.device("cpu"), 2)
    with tagging(mine), gloo_copies(mine):               # the same steps from a thread inside are logged
        _fsdp2_steps()
    assert any("gloo's copy in all_gather_single" in op for op in mine.ops)
    assert any("chunk_cat" in op for op in mine.ops) and mine.events and mine.race


@pytest.mark.parametrize("first_out", [0, 1])
def test_torchs_functions_are_put_back_when_threads_leave_in_any_order(first_out):
    """Each `tagging` saved what it found and set it back on the way out: with two threads inside, the first to leave
    put torch's back under the second (whose run then went unlogged) and the second put the first's wrappers back
    for good."""
    originals, failed = _originals(), []
    logs = [RankLog(torch.device("cpu"), 2) for _ in range(2)]
    entered, leave = [threading.Event() for _ in logs], [threading.Event() for _ in logs]
    threads = [threading.Thread(target=_inside, args=(log, e, lv, failed), daemon=True)
               for log, e, lv in zip(logs, entered, leave, strict=True)]
    try:
        for t, e in zip(threads, entered, strict=True):
            t.start()
            assert e.wait(60)
        leave[first_out].set()                            # the first or the second in leaves first
        threads[first_out].join(60)
        assert _originals()["foreach_reduce"] is not originals["foreach_reduce"]      # still in for the other
    finally:
        for lv in leave:
            lv.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads) and failed == []
    assert _originals() == originals
