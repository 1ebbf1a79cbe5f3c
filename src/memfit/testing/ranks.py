"""Start N processes of one process group on 127.0.0.1 (gloo on the CPU, or nccl with one GPU each), run a
function in each and collect what each returned or raised, within a bounded time: the one rank spawner of
the tests and the benchmarks.

Every wait is bounded: the answers within `timeout` seconds in all (not per rank), then each process gets a
few seconds to exit and is killed if it has not; a rank that hangs (waiting in a collective for a rank that
failed) shows up as missing, never as a hung caller.

Example (functions must be importable by name: each rank is a new process, forked from a server that has
imported torch and memfit, which imports the function's module by its name):
    >>> from memfit.testing.ranks import run_ranks
    >>> run_ranks(my_module.rank_fn, 2, 64, timeout=60)     # doctest: +SKIP
    {0: ('ok', ...), 1: ('ok', ...)}
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager

__all__ = ["context", "free_port", "run_ranks", "settled_gloo", "spawn"]

EXIT_GRACE_S = 10.0     # after the answers: time each process gets to leave its process group and exit
FAILED_GRACE_S = 5.0    # the same when a rank failed or did not answer (the others may be stuck: kill them)
POLL_S = 0.5            # how often the wait for answers looks for a rank whose process died without one


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SETTLE_TIMEOUT_S = 10.0  # how long a collective's return waits for gloo's worker thread to drop its tensors


@contextmanager
def settled_gloo(timeout: float = SETTLE_TIMEOUT_S):
    """Within the block, each all-gather and reduce-scatter FSDP2 makes (`dist.all_gather_single`,
    `dist.reduce_scatter_single`) returns only once gloo's worker thread has dropped the work that holds its
    tensors: one schedule of gloo's race out of many, chosen so that a measured peak is not a random variable.

    A gloo collective's work object keeps the tensors it was given until the worker thread that ran it lets it
    go, some time after the call has returned (`memfit.memory.fsdp_log.gloo_copies`); the rank goes on
    meanwhile, so one collective's tensors may outlive FSDP2's own reference to them, or not. Settled, they
    never do: the rank waits (at most `timeout` seconds, then raises) until the storages the work holds have no
    more references than before the call. gloo's reduce-scatter holds a clone of its input that the caller
    cannot see; settled, it runs as gloo runs it (clone the input, all-reduce the clone, keep this rank's
    chunk) with the clone made here, so that its release is seen too. `rank_memory_model(backend="gloo",
    gloo_race=False)` predicts this schedule. `settled_gloo.waits` counts the calls that had to wait.
    """
    import torch.distributed as dist

    from memfit.device.torch_private import storage_use_count
    uses = lambda t: storage_use_count(t.untyped_storage())
    originals = {k: getattr(dist, k) for k in ("all_gather_single", "reduce_scatter_single")}

    def settle(name, tensors, call):
        before = [uses(t) for t in tensors]
        # the collective is handed aliases of the tensors, new TensorImpls on the same storages: a work that
        # keeps the very tensor it was given holds its TensorImpl, which adds nothing to the storage's use
        # count (4 ranks of the bench's CNN: the reduce-scatter's clone, 192,480 bytes, kept that way past the
        # check in 19 of 120 rank-runs); an alias it keeps holds the storage, and the wait below sees it
        aliases = [t.detach() for t in tensors]
        out = call(*aliases)
        del aliases
        deadline, waited = time.monotonic() + timeout, False
        while any(uses(t) > b for t, b in zip(tensors, before, strict=True)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"expected gloo's worker thread to drop the tensors of {name} within "
                                   f"{timeout:.0f} s of its return; found them still held")
            waited = True
            time.sleep(0)
        settled_gloo.waits += waited
        return out

    def synchronous(name, async_op):
        if async_op:
            raise RuntimeError(f"expected {name} with async_op=False under settled_gloo (FSDP2's default); found "
                               "async_op=True, whose work the caller holds with its tensors: measure without it")

    def all_gather(output_tensor, input_tensor, group=None, async_op=False):
        synchronous("all_gather_single", async_op)
        return settle("all_gather_single", [output_tensor, input_tensor],
                      lambda out, inp: originals["all_gather_single"](out, inp, group=group))

    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        synchronous("reduce_scatter_single", async_op)
        whole = input.clone()                       # as c10d::_reduce_scatter_base_ on gloo: a clone of the input
        settle("reduce_scatter_single", [whole], lambda alias: dist.all_reduce(alias, op=op, group=group))
        output.copy_(whole.chunk(dist.get_world_size(group))[dist.get_rank(group)].view_as(output))

    dist.all_gather_single, dist.reduce_scatter_single = all_gather, reduce_scatter
    try:
        yield
    finally:
        for k, fn in originals.items():
            setattr(dist, k, fn)


settled_gloo.waits = 0


# What every rank imports, imported once in the server its processes are forked from: a spawned rank took 3-5 s
# to import torch and memfit on 2 busy cores, a forked one starts in ~0.1 s. Nothing here reads the environment
# at import (the `env` of run_ranks is set in each rank before it runs; memfit reads MEMFIT_DIST_TIMEOUT at each
# wait), and importing touches no GPU (CUDA cannot be used in a child forked after it was initialised); torch
# resets its thread pools in a forked child, as in DataLoader's forked workers. torch.compile's front end
# (torch_private.DYNAMO_MODULE): every optimizer imports it as it is made, 1.1 s of a rank's CPU, and it touches no
# GPU either.
PRELOAD = ["torch", "torch.distributed", "memfit"]  # and DYNAMO_MODULE, where torch is imported


def context():
    """The multiprocessing context the ranks start in ("forkserver", its server importing PRELOAD once per
    calling process, from the caller's sys.path): for the Events or Queues a test hands its ranks."""
    from multiprocessing import forkserver

    from memfit.device.torch_private import DYNAMO_MODULE
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD[:2] + [DYNAMO_MODULE] + PRELOAD[2:])
    # the server is a fresh interpreter that imports PRELOAD from its own sys.path: Python 3.11's forkserver.main
    # ignores the sys_path it is handed, so a memfit the caller found through a sys.path entry (pytest's
    # pythonpath=src in a worktree) lost to the venv's (an editable install of another checkout), silently
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()         # started here if not yet (else as it was: `_worker` checks memfit)
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def _worker(fn_pickled, rank, world, port, args, queue, env, backend, threads, caller_file):
    """One rank: join the group through the caller's store on 127.0.0.1:`port`, run `fn`, put its answer. `fn`
    comes pickled, unpickled once the caller's environment is set: its module, imported as it unpickles, runs
    its top-level code under that environment (not the server's), as a spawned rank did."""
    os.environ.clear()              # the caller's environment now (the server's is the one it had when it started)
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import gc

    import torch
    import torch.distributed as dist
    # what the server imported stays for the rank's life: set aside, every gc.collect() of the rank (two per step
    # `measure_rank_step` measures) walks the rank's own objects, not torch's (0.1-0.2 s a full one)
    gc.freeze()
    torch.set_num_threads(threads)          # the processes share the machine's cores
    store = None
    try:
        if __file__ != caller_file:      # this module as the server imported it, against the caller's
            raise RuntimeError(f"expected the caller's memfit ({caller_file}) in the rank; found {__file__}, which "
                               "the forkserver's server imported from its sys.path when it started: start the "
                               "ranks before sys.path changes")
        fn = pickle.loads(fn_pickled)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, is_master=False)       # the caller's: already listening
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        # pickled here: a tensor put on the queue as is travels as a file descriptor that dies with this process
        queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException as e:
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if store is not None:
            _leave_together(store, world)
        if dist.is_initialized():
            dist.destroy_process_group()


def _leave_together(store, world: int, wait_s: float = 10.0) -> None:
    """Wait (at most `wait_s`) until every rank is done before closing this rank's connections: a rank that
    finished without a collective and closed its group at once left a slower rank failing in gloo's
    connectFullMesh with "Connection closed by peer" (seen at load 12 on 2 cores). A rank that died never
    arrives: the others go on after `wait_s`."""
    try:
        store.add("memfit/done", 1)
        deadline = time.monotonic() + wait_s
        while store.add("memfit/done", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    except (RuntimeError, OSError):     # the caller's store gone (it gave up on us): nothing to wait for
        pass


def _died_silently(procs, out: dict, queue) -> tuple | None:
    """(rank, "error", why) for a rank whose process exited without an answer (killed, `os._exit`, a crash while
    starting: it put nothing, so waiting on would last the whole timeout), else None. What a process put before
    exiting is in the pipe: one more short read takes it first."""
    for rank, p in enumerate(procs):
        if rank not in out and not p.is_alive():
            try:
                return queue.get(timeout=POLL_S)
            except queue_module.Empty:
                return rank, "error", f"its process exited with code {p.exitcode} before answering"
    return None


def run_ranks(fn: Callable, world: int, *args, timeout: float = 120.0, env: dict | None = None,
              backend: str = "gloo", threads: int = 1, stop_at_first_error: bool = False) -> dict:
    """`fn(rank, world, *args)` in `world` processes of one process group; {rank: ("ok", value) or
    ("error", message)}. A rank with no answer within `timeout` seconds (all ranks together) is left out
    of the dict and its process killed.

    Args:
        fn: a module-level function (each process imports it by name).
        env: set in each process before `fn` runs (e.g. MEMFIT_DIST_TIMEOUT; torch is imported already: a
            variable torch reads at import has no effect).
        backend: "gloo" (CPU) or "nccl" (rank r takes GPU r).
        threads: torch intra-op threads per process (and OMP_NUM_THREADS unless `env` sets it).
        stop_at_first_error: stop collecting at the first rank that raises and kill the others (which may
            wait for it in a collective); otherwise every rank's answer is awaited until `timeout`.
    """
    import torch.distributed as dist

    ctx = context()
    queue = ctx.Queue()
    # The group's store listens here, on a port the system picks as it binds: no rank can lose its port to
    # another process between a free_port() and its bind (runs in parallel, e.g. pytest-xdist workers)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    env = {**os.environ, **(env or {})}
    fn_pickled = pickle.dumps(fn)       # a reference: its module imported in the rank after `env` is set
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn_pickled, r, world, port, args, queue, env, backend, threads, __file__))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    out: dict = {}
    try:
        while len(out) < world and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
            except queue_module.Empty:
                dead = _died_silently(procs, out, queue)
                if dead is None:
                    continue                # still running, or a rank hung: the caller sees it missing at the end
                rank, status, value = dead
            out[rank] = (status, value)
            if status == "error" and stop_at_first_error:
                break
    finally:
        grace = EXIT_GRACE_S if len(out) == world and all(s == "ok" for s, _ in out.values()) else FAILED_GRACE_S
        exit_by = time.monotonic() + grace          # one grace for all: a stuck rank's wait is not added per rank
        for p in procs:
            p.join(timeout=max(0.0, exit_by - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=grace)
        del store                   # after every rank has exited or been killed
    for rank, (status, value) in out.items():
        try:
            out[rank] = (status, pickle.loads(value) if status == "ok" else value)
        except Exception as e:      # a result that does not unpickle here is that rank's error, not a hang
            out[rank] = ("error", f"its result did not unpickle: {type(e).__name__}: {e}")
    return out


def spawn(fn: Callable, world: int, *args, timeout: float = 300.0, **options) -> dict:
    """{rank: value} from `fn(rank, world, *args)` in `world` processes (`run_ranks`, stopping at the first
    error). Raises RuntimeError naming the first rank that failed, or the ranks that gave no answer within
    `timeout` seconds; every process is killed either way (none is left waiting)."""
    out = run_ranks(fn, world, *args, timeout=timeout, stop_at_first_error=True, **options)
    failed = [f"rank {r}: {v}" for r, (s, v) in sorted(out.items()) if s == "error"]
    if failed:
        raise RuntimeError(f"a rank failed: {failed[0]}")
    missing = sorted(set(range(world)) - set(out))
    if missing:
        raise RuntimeError(f"a rank failed: ranks {missing} gave no answer within {timeout:.0f} s")
    return {r: v for r, (_, v) in out.items()}
