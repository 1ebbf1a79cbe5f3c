"""Start `world` processes (gloo on the CPU, or nccl with one GPU each) for a test and collect what each
returns (or raised)."""
import multiprocessing as mp
import pickle
import socket
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, args, queue, env, backend):
    import os

    os.environ.update(env or {})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)                # world processes share 2 cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        # pickled here: a tensor put on the queue as is travels as a file descriptor that dies with this process
        queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException as e:
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 120.0, env: dict | None = None, backend: str = "gloo") -> dict:
    """{rank: ("ok", value) or ("error", message)}; processes that do not answer in time are killed.
    `env` is set in each process before torch is imported (e.g. MEMFIT_DIST_TIMEOUT)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, queue, env, backend), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            out[rank] = (status, value)
    except Exception:      # queue.Empty: a rank hung; the test sees it missing
        pass
    for rank, (status, value) in out.items():
        try:
            out[rank] = (status, pickle.loads(value) if status == "ok" else value)
        except Exception as e:      # a result that does not unpickle here is that rank's error, not a hang
            out[rank] = ("error", f"its result did not unpickle: {type(e).__name__}: {e}")
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    return out
