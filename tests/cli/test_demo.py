"""`memfit demo` end to end on a reduced setting (the README's examples run in tests/test_docs.py)."""
import json
from pathlib import Path

import pytest

from memfit.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def demo_json(tmp_path_factory):
    pytest.importorskip("sklearn")
    out = tmp_path_factory.mktemp("demo")
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["demo", "--epochs", "4", "--seed", "1", "--json", "--plot", str(out)])
    assert code == 0
    return json.loads(buf.getvalue().strip().splitlines()[-1]), out


def test_demo_reports_every_figure(demo_json):
    r, out = demo_json
    assert r["data"] == "digits" and r["train"] + r["test"] == 1797
    # a sample: 64 float32 pixels + an int64 label (264 B) against 64 uint8 pixels + a uint8 label (65 B)
    assert r["bytes"]["codec"] == "uint8" and r["bytes"]["ratio"] == pytest.approx(264 / 65, rel=1e-3)
    assert r["loader"]["strategy"] in ("resident", "macro", "stream") and r["loader"]["reason"]
    assert len(r["losses"]) == 4 and r["losses"][-1] < r["losses"][0]
    p = r["plan"]
    assert p["lower_bound"] <= p["planned"] <= p["naive"]
    assert 0 < p["planned_peak"] <= p["eager_peak"]     # the plan never holds more than eager (by the allocator)
    assert r["max_eval_batch"] >= 1
    e = r["evaluate"]
    assert e["n"] == r["test"] and e["chunk_size"] >= 1
    assert e["accuracy"] > 0.9                       # digits are easy: a small CNN gets there in 4 epochs
    for f in r["files"]:
        assert Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {Path(f).name for f in r["files"]} == {"arena.png", "loss.png"}


def test_demo_is_deterministic_with_a_seed(demo_json, tmp_path, capsys):
    r, _ = demo_json
    assert main(["demo", "--epochs", "4", "--seed", "1", "--json", "--no-plot"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["losses"] == r["losses"]
    assert again["evaluate"]["accuracy"] == r["evaluate"]["accuracy"]


def test_a_small_budget_changes_the_choices(capsys):
    pytest.importorskip("sklearn")
    assert main(["demo", "--epochs", "1", "--budget", "1MiB", "--json", "--no-plot"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["evaluate"]["chunk_size"] < r["test"]          # activations of 359 samples need several MiB
    assert r["max_eval_batch"] < r["test"]


def test_readme_starts_with_the_two_commands():
    head = README.read_text()[:1500]
    assert "make demo" in head and "make test" in head


def test_demo_runs_on_two_processes_with_torchrun():
    """`torchrun --nproc-per-node=2 -m memfit demo --distributed`: each rank trains on its shard and
    the evaluation counts every test sample once across the two ranks."""
    pytest.importorskip("sklearn")
    import os
    import subprocess
    import sys
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEMFIT_DIST_TIMEOUT": "60"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "memfit", "demo", "--distributed", "--epochs", "1", "--no-plot", "--json"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert r["world_size"] == 2
    assert r["evaluate"]["n"] == r["test"] == 359            # every test sample counted once, none twice
    assert r["loader"]["batches_per_epoch"] == -(-719 // 64)  # a rank iterates its half of the 1438
    assert r["plan"]["planned_peak"] > 0 and r["max_eval_batch"] >= 1        # rank 0 reports them (only it)


def test_arena_picture_agrees_with_the_table(monkeypatch):
    """The picture the demo writes: each arena tensor's rectangle spans exactly the ops of its lifetime
    in the table (cells centred on op indices) at its offset; the arena and the lower bound are two
    visible lines (the bound dashed, drawn on top); the largest tensor is labelled."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    import torch

    from memfit import plan
    from memfit.cli.demo import small_cnn
    # every op with an out= kernel in the arena, none in place (by default this CNN needs no arena: its ReLUs write
    # over the convolutions' outputs), no stem run in batch slices (planner.slicing)
    monkeypatch.setattr("memfit.planner.slicing.MIN_SAVING", 2.0)
    rep = plan(small_cnn(1, 10, 8).eval(), (torch.empty(64, 1, 8, 8),), inplace=False,
               eager_where_cheaper=False).report
    fig = rep.figure()
    try:
        ax = fig.axes[0]
        scale = 2**20 if rep.arena_bytes >= 2**20 else 2**10
        drawn = {(p.get_x(), p.get_width(), p.get_y(), p.get_height()) for p in ax.patches if not p.get_hatch()}
        arena = [r for r in rep.rows if r.kind == "arena"]
        assert arena
        for r in arena:
            first, last = r.lifetime
            assert (first - 0.5, last - first + 1, r.offset / scale, r.bytes / scale) in drawn, r
        lines = {line.get_label().split()[0]: line for line in ax.get_lines()}
        assert lines["arena"].get_ydata()[0] == rep.arena_bytes / scale
        assert lines["lower"].get_ydata()[0] == rep.lower_bound / scale
        assert lines["lower"].get_linestyle() != "-" and lines["lower"].get_zorder() > lines["arena"].get_zorder()
        largest = max(arena, key=lambda r: r.bytes)
        assert any(largest.name in t.get_text() for t in ax.texts)
    finally:
        plt.close(fig)


def test_demo_augment_gives_the_loader_a_shift_for_digits(monkeypatch):
    """`--augment`: the training loader gets the ops (digits: a random shift, no flip: a mirrored digit is another
    symbol); the evaluation reads the test set, never augmented. Stopped at the loader: the run is tested above."""
    pytest.importorskip("sklearn")
    import memfit

    class Stop(Exception):
        pass

    seen = {}

    def loader(data, batch_size, **options):
        seen.update(options)
        raise Stop

    monkeypatch.setattr(memfit, "loader", loader)
    assert main(["demo", "--augment", "--epochs", "1", "--no-plot", "--json"]) != 0     # stopped there
    assert [repr(op) for op in seen["augment"]] == ["Translate(shift=1, mode='zero', fill=0, layout='CHW')"]
