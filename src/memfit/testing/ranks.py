"""Start N processes of one process group on 127.0.0.1 (gloo on the CPU, or nccl with one GPU each), run a
function in each and collect what each returned or raised, within a bounded time: the one rank spawner of
the tests and the benchmarks.

Every wait is bounded: the answers within `timeout` seconds in all (not per rank), then each process gets a
few seconds to exit and is killed if it has not; a rank that hangs (waiting in a collective for a rank that
failed) shows up as missing, never as a hung caller.

Example (functions must be importable by name: `spawn` starts fresh interpreters):
    >>> from memfit.testing.ranks import run_ranks
    >>> run_ranks(my_module.rank_fn, 2, 64, timeout=60)     # doctest: +SKIP
    {0: ('ok', ...), 1: ('ok', ...)}
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable

__all__ = ["free_port", "run_ranks", "spawn"]

EXIT_GRACE_S = 10.0     # after the answers: time each process gets to leave its process group and exit
FAILED_GRACE_S = 5.0    # the same when a rank failed or did not answer (the others may be stuck: kill them)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, args, queue, env, backend, threads):
    """One rank: join the group through the caller's store on 127.0.0.1:`port`, run `fn`, put its answer."""
    import os

    os.environ.update(env or {})
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)          # the processes share the machine's cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, is_master=False)       # the caller's: already listening
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        # pickled here: a tensor put on the queue as is travels as a file descriptor that dies with this process
        queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException as e:
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args, timeout: float = 120.0, env: dict | None = None,
              backend: str = "gloo", threads: int = 1, stop_at_first_error: bool = False) -> dict:
    """`fn(rank, world, *args)` in `world` processes of one process group; {rank: ("ok", value) or
    ("error", message)}. A rank with no answer within `timeout` seconds (all ranks together) is left out
    of the dict and its process killed.

    Args:
        fn: a module-level function (the processes are spawned: they import it by name).
        env: set in each process before torch is imported (e.g. MEMFIT_DIST_TIMEOUT).
        backend: "gloo" (CPU) or "nccl" (rank r takes GPU r).
        threads: torch intra-op threads per process (and OMP_NUM_THREADS unless `env` sets it).
        stop_at_first_error: stop collecting at the first rank that raises and kill the others (which may
            wait for it in a collective); otherwise every rank's answer is awaited until `timeout`.
    """
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # The group's store listens here, on a port the system picks as it binds: no rank can lose its port to
    # another process between a free_port() and its bind (runs in parallel, e.g. pytest-xdist workers)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, queue, env, backend, threads), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    out: dict = {}
    try:
        while len(out) < world:
            rank, status, value = queue.get(timeout=max(0.0, deadline - time.monotonic()))
            out[rank] = (status, value)
            if status == "error" and stop_at_first_error:
                break
    except queue_module.Empty:      # a rank hung: the caller sees it missing
        pass
    finally:
        grace = EXIT_GRACE_S if len(out) == world and all(s == "ok" for s, _ in out.values()) else FAILED_GRACE_S
        for p in procs:
            p.join(timeout=grace)
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
