"""Per-rank memory benchmark: DDP and FSDP2 training steps predicted in one process against real gloo ranks.

For each model (an MLP, a CNN, a transformer encoder, a causal LM from a `transformers` config), world size
(2 and 4 processes on 127.0.0.1) and wrapping (DDP; FSDP2 with `fully_shard` on every block and the root),
`rank_memory_model(..., backend="gloo")` predicts one rank's peak at two batch sizes per rank, and each
rank measures one real AdamW step at the allocator (`measure_rank_step`). Target: predicted / the worst
rank's real peak in [1.00, 1.05] on every row. Then the FSDP2 prediction at world size 8 is set beside
torch's `FSDPMemTracker` run on the same model in one process under a fake process group (its tests accept
+-10% of CUDA's bytes; here it counts CPU tensors).

Run:
    memfit bench distributed --memory --quick
    memfit bench distributed --memory
"""

from __future__ import annotations

import functools

import torch

from memfit.cli.bench.common import machine_header, table
from memfit.testing.ranks import spawn

TARGET = (1.00, 1.05)
DIGITS = 4      # the ratio is judged to 4 decimals: kernels wrap Python scalars in 0-d tensors of 4-8 bytes
#                 (12-24 bytes live at a peak here) that no op outputs and no fake run can see


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 255), torch.nn.ReLU(),
                               torch.nn.Linear(255, 7))


def cnn():
    from memfit.testing.zoo import lenet
    torch.manual_seed(0)
    return lenet()


def encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def causal_lm():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=2))


def _lm_example():
    ids = torch.zeros(1, 32, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


CASES = {"mlp": (mlp, (64,)), "cnn": (cnn, (1, 28, 28)), "encoder": (encoder, (16, 64)), "causal-lm": (causal_lm, None)}


def _example(name):
    return _lm_example() if CASES[name][1] is None else CASES[name][1]


def _build(name: str, parallel: str):
    model = CASES[name][0]()
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    from memfit.memory.fsdp_run import default_units
    for unit in default_units(model):
        fully_shard(unit)
    return fully_shard(model)


def _rank_job(rank: int, world: int, name: str, parallel: str, sizes) -> dict:
    from memfit.memory.step import measure_rank_step
    return {n: measure_rank_step(functools.partial(_build, name, parallel), _example(name), torch.optim.AdamW, n=n)
            for n in sizes}


def _predict(name: str, parallel: str, world: int, backend: str = "gloo", **options):
    from memfit.memory.ranks import rank_memory_model
    model = CASES[name][0]()
    return rank_memory_model(model, _example(name), optimizer=torch.optim.AdamW(model.parameters()),
                             parallel=parallel, world_size=world, backend=backend, **options)


def _tracker_peak(name: str, n: int, world: int) -> int:
    """FSDPMemTracker's peak total for one AdamW step (after a warm-up step) of rank 0 of `world` ranks, on
    real CPU tensors under a fake process group (initialised by the caller)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from memfit.memory.step import ExampleBatch, training_step
    model = _build(name, "fsdp")
    opt = torch.optim.AdamW(model.parameters())
    batch = ExampleBatch(_example(name)).at(n, torch.device("cpu"))
    training_step(model, batch, opt)
    tracker = FSDPMemTracker(model, opt)
    with tracker:
        training_step(model, batch, opt)
    return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


def run(quick: bool = False, worlds=(2, 4)) -> list[dict]:
    names = list(CASES)
    sizes = (4, 16) if quick else (8, 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # as each rank runs (`_worker`): oneDNN's scratch depends on the threads
    try:
        return _run(names, sizes, worlds)
    finally:
        torch.set_num_threads(threads)


def _run(names, sizes, worlds) -> list[dict]:
    print(machine_header("cpu"))
    rows = []
    for world in worlds:
        for parallel in ("ddp", "fsdp"):
            for name in names:
                real = spawn(_rank_job, world, name, parallel, sizes)
                mm = _predict(name, parallel, world)
                # gloo's race (memory.fsdp_run._gloo_copies): the prediction is its upper case; beside it the
                # lower case (every work dropped as its call returns), to see which one the ranks ran
                lower = _predict(name, parallel, world, gloo_works_kept=0) if parallel == "fsdp" else None
                for n in sizes:
                    worst = max(r[n] for r in real.values())
                    ratio = mm.total_bytes(n) / worst
                    rows.append({"model": name, "parallel": parallel, "ranks": world, "batch/rank": n,
                                 "predicted": mm.total_bytes(n), "real (worst rank)": worst, "ratio": f"{ratio:.5f}",
                                 "lower case / real": f"{lower.total_bytes(n) / worst:.5f}" if lower else "",
                                 "": "PASS" if TARGET[0] <= round(ratio, DIGITS) <= TARGET[1] else "MISS"})
                print(table(rows[-len(sizes):], bytes_columns={"predicted", "real (worst rank)"}), flush=True)
    print(f"# predicted / real per-rank peak (gloo, 127.0.0.1, AdamW, allocator bytes), target {TARGET[0]:.2f}-"
          f"{TARGET[1]:.2f} to {DIGITS} decimals; FSDP2 predicted in the upper case of gloo's race (a collective's "
          "tensors kept by gloo's worker thread until the next collective returns), its lower case beside it")
    print(table(rows, bytes_columns={"predicted", "real (worst rank)"}))
    missed = [r for r in rows if r[""] == "MISS"]
    print(f"{'PASS' if not missed else 'MISS'}  predicted / real in [{TARGET[0]:.2f}, {TARGET[1]:.2f}] on every row "
          f"({len(rows) - len(missed)} of {len(rows)})")
    rows += _against_tracker(names, sizes[-1], 8)
    return rows


def _against_tracker(names, n: int, world: int) -> list[dict]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    predicted = {name: _predict(name, "fsdp", world, backend="nccl").total_bytes(n) for name in names}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        rows = []
        for name in names:
            tracked = _tracker_peak(name, n, world)
            rows.append({"model": name, "ranks": world, "batch/rank": n, "memfit": predicted[name],
                         "FSDPMemTracker": tracked, "memfit / tracker": f"{predicted[name] / tracked:.4f}"})
    finally:
        dist.destroy_process_group()
    print(f"# FSDP2 at world size {world}, one process: memfit's prediction (no collective copies: NCCL) beside "
          "torch's FSDPMemTracker (real CPU tensors, fake process group); its own tests accept +-10%")
    print(table(rows, bytes_columns={"memfit", "FSDPMemTracker"}))
    near = all(0.9 <= float(r["memfit / tracker"]) <= 1.1 for r in rows)
    print(f"{'PASS' if near else 'MISS'}  memfit within +-10% of FSDPMemTracker on every model")
    return rows
