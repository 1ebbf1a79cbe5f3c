"""The loader benchmark's verdicts, GPU targets included, from rows as `memfit bench loaders` makes them (no GPU
needed: the arithmetic of the targets is what is checked; the rows' timings are given)."""
import pytest
import torch

from memfit.cli.bench.loaders import _plot, against_loop, loop_verdict, targets


def _rows(stream_s: float, inline_s: float, wide_s: float, resident_s: float = 1.0) -> list[dict]:
    n = 60_000

    def row(strategy, data, s, **extra):
        return {"strategy": strategy, "data": data, "macro": "", "micro": 512, "s/epoch": s, "samples/s": n / s,
                "bytes held": "1 MiB", "vs DataLoader": 20.0, "vs float32 gather": 1.1, "vs reused loop": 1.0,
                "vs resident": resident_s / s, **extra}
    return [row("DataLoader", "float32", 20.0), row("gather", "float32", 1.1), row("reused loop", "uint8", 1.0),
            row("resident", "uint8", resident_s), row("stream", "uint8", stream_s),
            row("stream float32", "float32", wide_s), row("stream, no prefetch", "uint8", inline_s)]


def test_gpu_targets_are_judged_on_cuda_and_said_to_be_unmeasured_on_the_cpu():
    cuda = torch.device("cuda", 0)
    # the copy costs 1 s an epoch unhidden (2.0 - 1.0); prefetch brings the epoch to 1.1: 90% hidden
    lines = targets(_rows(stream_s=1.1, inline_s=2.0, wide_s=4.0), cuda).splitlines()
    assert "PASS  stream uint8 3.64x stream float32" in lines[-2]
    assert lines[-1].startswith("PASS  prefetch hides 90% of the copy")
    lines = targets(_rows(stream_s=1.5, inline_s=2.0, wide_s=3.0), cuda).splitlines()
    assert lines[-2].startswith("MISS  stream uint8 2.00x") and lines[-1].startswith("MISS  prefetch hides 50%")
    cpu = targets(_rows(stream_s=1.1, inline_s=2.0, wide_s=4.0), torch.device("cpu"))
    assert cpu.splitlines()[-1].startswith("n/a   GPU targets")
    missing = [r for r in _rows(1.1, 2.0, 4.0) if r["strategy"] != "stream float32"]
    assert targets(missing, cuda).splitlines()[-1].startswith("MISS  GPU targets: the stream rows")


def test_the_plot_colours_every_strategy_a_cuda_run_has(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "loaders.png"
    _plot(_rows(1.1, 2.0, 4.0), str(path))
    assert path.stat().st_size > 0


def test_the_paired_comparison_with_the_hand_written_loop_and_its_verdict():
    rows = against_loop(batches=(64,), rounds=2, device="cpu", n=300)
    assert [(r["data"].split()[0], r["batch"]) for r in rows] == [("MNIST-shaped", 64), ("CIFAR-shaped", 64)]
    assert all(r["vs loop"] > 0 and r["vs loop, 2 buffers"] > 0 for r in rows)
    given = [{**rows[0], "vs loop": 1.2, "vs loop, 2 buffers": 1.3},
             {**rows[1], "vs loop": 0.94, "vs loop, 2 buffers": 1.1, "vs loop, quartiles": "0.90-0.99"}]
    line = loop_verdict(given)
    assert line.startswith("MISS  resident uint8 0.94-1.20x")
    assert "worst: CIFAR-shaped batch 64, quartiles 0.90-0.99" in line
    assert "1.10-1.30x the same loop with two output buffers" in line
    given[1]["vs loop"] = 0.95
    assert loop_verdict(given).startswith("PASS  resident uint8 0.95-1.20x")
