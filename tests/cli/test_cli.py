"""The `memfit` command line: every subcommand's --help shows an example, bad usage exits 2 with the
reason on stderr, failures exit 1 with one line, and eval/plan work on a user's model file."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from memfit.cli import main

SUBCOMMANDS = [["info"], ["demo"], ["bench"], ["bench", "codecs"], ["bench", "loaders"], ["bench", "planner"],
               ["bench", "evaluate"], ["bench", "distributed"], ["bench", "train"], ["bench", "fit"], ["plan"],
               ["eval"]]


@pytest.mark.parametrize("cmd", SUBCOMMANDS, ids=" ".join)
def test_help_shows_an_example(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: memfit" in out
    assert "memfit " + cmd[0] in out.split("usage:", 1)[1]
    assert "example" in out.lower() or "Run:" in out


@pytest.mark.parametrize("argv, match", [
    ([], "required"),
    (["nope"], "invalid choice"),
    (["info", "--bogus"], "unrecognized"),
    (["bench", "nope"], "invalid choice"),
    (["bench", "codecs", "--bogus"], "unrecognized"),
    (["demo", "--budget", "lots"], "--budget"),
    (["demo", "--data", "imagenet"], "--data"),
    (["demo", "--epochs", "0"], "--epochs"),
    (["eval"], "MODULE:FACTORY"),
    (["eval", "x:y", "--chunk-size", "-3"], "--chunk-size"),
    (["plan"], "MODULE:FACTORY|required"),
    (["demo", "--seed", "-1"], r"argument --seed: expected a whole number >= 0; found '-1'"),
    (["demo", "--batch-size", "2.5"], r"--batch-size: expected a whole number >= 1"),
    (["demo", "--budget", "1.5"], r"--budget: expected a whole number of bytes"),
    (["demo", "--budget", "1G"], r"--budget: ambiguous unit 'G'.*'1GiB'.*'1GB'"),
    (["demo", "--data", "mnist:"], r"--data: expected mnist:FOLDER"),
    (["demo", "--data", "mnist:/no/such/folder"], r"--data: .*does not exist"),
    (["demo", "--data", "missing.npz"], r"--data: missing.npz: no such file"),
    (["demo", "--data", "synthetic:x"], r"--data: expected synthetic:N"),
    (["eval", "x:y", "--data", "foo"], r"--data: unknown data 'foo'"),
    (["eval", "x:y", "--data", "mnist:"], r"--data: expected mnist:FOLDER"),
    (["eval", "x:y", "--device", "gpu7"], r"--device: expected a device"),
    (["plan", "x:y", "--input", "1,2", "--device", "gpu7"], r"--device: expected a device"),
    (["bench", "codecs", "--sets", "foo"], r"--sets: unknown set 'foo'; expected .*mnist, cifar"),
    (["bench", "codecs", "--codecs", "uint8,jpeg"], r"--codecs: unknown codec 'jpeg'"),
    (["bench", "evaluate", "--budget", "lots"], r"--budget"),
    (["bench", "evaluate", "--device", "gpu7"], r"--device"),
    (["bench", "planner", "--device", "gpu7"], r"--device"),
    (["bench", "planner", "--models", "resnet5"], r"--models: unknown model 'resnet5'"),
    (["bench", "planner", "--batches", "1,x"], r"--batches: expected comma-separated whole numbers"),
    (["bench", "loaders", "--micro", "512,x"], r"--micro: expected comma-separated whole numbers"),
    (["bench", "distributed", "--worlds", "0,2"], r"--worlds: expected comma-separated whole numbers >= 1"),
])
def test_bad_usage_exits_2_with_the_reason(argv, match, capsys):
    try:
        code = main(argv)
    except SystemExit as e:            # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err and __import__("re").search(match, err), err


def test_failure_exits_1_with_one_line_and_no_traceback(tmp_path, capsys):
    code = main(["eval", f"{tmp_path}/missing.py:make", "--data", "synthetic:100"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("memfit: error:") and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_info_json_lists_the_cpu(capsys):
    # in this process: `python -m memfit` itself is launched by test_demo's torchrun test
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] == torch.__version__
    assert info["devices"][0]["device"] == "cpu" and info["devices"][0]["total"] > 0


MODEL_FILE = '''
import torch

def make():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
'''


def test_eval_a_user_model_file_equals_the_reference(tmp_path, capsys):
    (tmp_path / "net.py").write_text(MODEL_FILE)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    torch.save(ref.state_dict(), tmp_path / "w.pt")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (300, 1, 8, 8), dtype=np.uint8)
    y = rng.integers(0, 10, 300)
    np.savez(tmp_path / "d.npz", x_train=x[:200], y_train=y[:200], x_test=x[200:], y_test=y[200:])
    code = main(["eval", f"{tmp_path}/net.py:make", "--weights", str(tmp_path / "w.pt"),
                 "--data", str(tmp_path / "d.npz"), "--normalize", "unit", "--chunk-size", "7", "--json"])
    assert code == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with torch.no_grad():
        expect = (ref(torch.from_numpy(x[200:]).float() / 255).argmax(1).numpy() == y[200:]).mean()
    assert res["n"] == 100 and res["chunks"] == 15
    assert res["metrics"]["accuracy"] == pytest.approx(expect)


def test_eval_normalises_by_every_training_sample(tmp_path, capsys):
    """--normalize dataset takes the statistics of the whole training split, as demo trains (old: of its first
    10,000 samples only, which for a set sorted by class, or any set above 10,000, differ)."""
    (tmp_path / "reg.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(1, 1)\n")
    torch.save({"weight": torch.ones(1, 1), "bias": torch.zeros(1)}, tmp_path / "w.pt")   # the normalised x
    x = np.concatenate([np.zeros(10_000), np.full(2_000, 6.0)]).astype(np.float32).reshape(-1, 1)
    xt, yt = np.array([[0.0], [6.0]], np.float32), np.array([0.0, 1.0], np.float32)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=np.zeros(len(x), np.float32), x_test=xt, y_test=yt)
    assert main(["eval", f"{tmp_path}/reg.py:make", "--weights", str(tmp_path / "w.pt"), "--data",
                 str(tmp_path / "d.npz"), "--metrics", "mae", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    mean, std = float(x.mean(dtype=np.float64)), float(x.std(dtype=np.float64))
    expect = np.abs((xt[:, 0] - mean) / std - yt).mean()
    assert res["metrics"]["mae"] == pytest.approx(expect, rel=1e-6)


def test_eval_weights_that_do_not_match_are_a_clear_error(tmp_path, capsys):
    (tmp_path / "net.py").write_text(MODEL_FILE)
    torch.save(torch.nn.Linear(3, 2).state_dict(), tmp_path / "w.pt")
    code = main(["eval", f"{tmp_path}/net.py:make", "--weights", str(tmp_path / "w.pt"), "--data", "synthetic:50"])
    assert code == 1
    assert "does not match the model" in capsys.readouterr().err


MLP_FILE = '''
import torch

def make():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
'''


def test_plan_prints_the_report(tmp_path, capsys):
    import memfit
    (tmp_path / "mlp.py").write_text(MLP_FILE)
    code = main(["plan", f"{tmp_path}/mlp.py:make", "--input", "4,1,8,8"])
    assert code == 0
    out = capsys.readouterr().out
    assert "lower bound" in out.lower()
    assert main(["plan", f"{tmp_path}/mlp.py:make", "--input", "4,1,8,8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    ref = memfit.plan(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                          torch.nn.Linear(32, 10)).eval(), (torch.empty(4, 1, 8, 8),)).report
    assert got["arena_bytes"] == ref.arena_bytes > 0                 # the same plan as the Python API
    assert got["lower_bound"] == ref.lower_bound and got["naive_bytes"] == ref.naive_bytes


LEAVES = [c for c in SUBCOMMANDS if c != ["bench"]]


@pytest.mark.parametrize("cmd", LEAVES, ids=" ".join)
def test_help_names_only_options_that_exist(cmd, capsys):
    """Every --option a subcommand's help mentions (description, examples) is one of its options."""
    import re
    with pytest.raises(SystemExit):
        main([*cmd, "--help"])
    out = capsys.readouterr().out
    options = set(re.findall(r"^\s+(?:-\w, )?(--[\w-]+)", out.split("options:", 1)[1], re.M))
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", out)) - {"--help", "--nproc-per-node", "--standalone"}
    assert mentioned <= options | {"--debug"}, f"mentioned but not options: {mentioned - options}"


@pytest.mark.parametrize("cmd", [["demo"], ["eval"], ["plan"], ["bench", "codecs"], ["bench", "loaders"],
                                 ["bench", "planner"], ["bench", "evaluate"]], ids=" ".join)
def test_every_command_that_runs_a_model_takes_device(cmd, capsys):
    with pytest.raises(SystemExit):
        main([*cmd, "--help"])
    assert "--device" in capsys.readouterr().out


def test_a_budget_that_does_not_fit_prints_the_whole_breakdown(capsys):
    code = main(["demo", "--data", "synthetic:200", "--budget", "0", "--no-plot", "--epochs", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("memfit: error: BudgetExceeded:")
    lines = err.strip().splitlines()
    assert len(lines) >= 4 and any(line.strip().startswith("total") for line in lines), err
    assert "Traceback" not in err and lines[-1] == "(run with --debug for the traceback)"


def test_demo_checks_its_output_folder_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code = main(["demo", "--data", "synthetic:200", "--plot", str(blocker / "pictures")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""                     # nothing ran: no data line, no epoch
    assert "--plot: cannot write the pictures into" in err and "a-file" in err


def test_debug_anywhere_shows_the_traceback(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        main(["eval", f"{tmp_path}/missing.py:make", "--data", "synthetic:100", "--debug"])
    with pytest.raises(ValueError, match="does not exist"):
        main(["--debug", "plan", f"{tmp_path}/missing.py:make", "--input", "1,64"])


def test_console_script_imports_a_module_from_the_current_folder(tmp_path):
    """`memfit plan my_module:make` finds my_module.py in the current folder, as `python -m memfit` does."""
    import os
    import shutil
    script = shutil.which("memfit", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the memfit console script is not installed beside this interpreter")
    (tmp_path / "my_module_for_cli.py").write_text(MLP_FILE)
    # --train: a fake-tensor step, no export in the child (its capture was a third of the test's time)
    out = subprocess.run([script, "plan", "my_module_for_cli:make", "--input", "2,1,8,8", "--train", "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-1500:]
    made = {}
    exec(MLP_FILE, made)
    # the parameters counted are the module's own: it was imported from the folder
    assert json.loads(out.stdout)["breakdown"]["parameters"] == sum(p.nbytes for p in made["make"]().parameters())


# more tensors than the report's 60 rows, from as few ops as give them: one op per output (a chain of 70 linear
# layers, 3 ops each, took 3.5 s to capture)
MANY_FILE = '''
import torch

class Many(torch.nn.Module):
    def forward(self, x):
        return tuple(x * i for i in range(70))

def make():
    return Many()
'''


def test_plan_all_lists_every_tensor(tmp_path, capsys):
    import re
    (tmp_path / "many.py").write_text(MANY_FILE)
    assert main(["plan", f"{tmp_path}/many.py:make", "--input", "2,16"]) == 0
    short = capsys.readouterr().out
    more = re.search(r"\.\.\. (\d+) more \(--all lists them all\)", short)
    assert more, short[-500:]
    assert main(["plan", f"{tmp_path}/many.py:make", "--input", "2,16", "--all"]) == 0
    full = capsys.readouterr().out
    rows = [line for line in full.splitlines() if re.search(r"\s(arena|call|output|input)\b", line)
            and re.search(r"\d+\.\.\d+", line)]
    assert "more (" not in full and len(rows) == 60 + int(more.group(1))


def test_the_library_never_imports_the_command_line():
    # every module outside memfit.cli, imported in a fresh process: none may pull in the command line
    code = ("import importlib, pathlib, sys, memfit\n"
            "root = pathlib.Path(memfit.__file__).parent\n"
            "for f in sorted(root.rglob('*.py')):\n"
            "    parts = ('memfit',) + f.relative_to(root).with_suffix('').parts\n"
            "    if parts[1] not in ('cli', '__main__'):\n"
            "        importlib.import_module('.'.join(p for p in parts if p != '__init__'))\n"
            "print(len([m for m in sys.modules if m.startswith('memfit.')]), "
            "sorted(m for m in sys.modules if m.startswith('memfit.cli')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, cli = out.stdout.strip().split(" ", 1)
    assert int(count) > 20 and cli == "[]", out.stdout


@pytest.mark.cuda
def test_plan_and_eval_on_cuda(tmp_path, capsys):
    pytest.importorskip("sklearn")
    (tmp_path / "mlp.py").write_text(MLP_FILE)
    assert main(["plan", f"{tmp_path}/mlp.py:make", "--input", "4,1,8,8", "--device", "cuda", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["arena_bytes"] > 0
    assert main(["eval", f"{tmp_path}/mlp.py:make", "--random-weights", "--data", "digits", "--device", "cuda",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n"] == 359


def _lin_file(tmp_path):
    (tmp_path / "lin.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(6, 3)\n")
    torch.manual_seed(1)
    ref = torch.nn.Linear(6, 3)
    torch.save(ref.state_dict(), tmp_path / "w.pt")
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (500, 6), dtype=np.uint8)
    y = rng.integers(0, 3, 500)
    np.savez(tmp_path / "t.npz", x=x, y=y)
    with torch.no_grad():
        pred = ref(torch.from_numpy(x).float()).argmax(1).numpy()
    return pred, y


def test_eval_npz_of_x_y_evaluates_every_sample_and_says_so(tmp_path, capsys):
    pred, y = _lin_file(tmp_path)
    args = ["eval", f"{tmp_path}/lin.py:make", "--weights", str(tmp_path / "w.pt"), "--data", str(tmp_path / "t.npz"),
            "--normalize", "none", "--json"]
    assert main(args) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["n"] == 500 and "all 500 samples of x, y" in res["set"]
    assert res["metrics"]["accuracy"] == pytest.approx((pred == y).mean(), abs=1e-12)
    assert main(args[:-1]) == 0                              # the text output names the set too
    assert "set: " in capsys.readouterr().out


def test_eval_test_fraction_splits_an_npz_of_x_y_and_names_the_split(tmp_path, capsys):
    _lin_file(tmp_path)
    assert main(["eval", f"{tmp_path}/lin.py:make", "--weights", str(tmp_path / "w.pt"), "--data",
                 str(tmp_path / "t.npz"), "--test-fraction", "0.2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["n"] == 100 and "20% test split (100 of 500 samples)" in res["set"]
    assert main(["eval", f"{tmp_path}/lin.py:make", "--weights", str(tmp_path / "w.pt"), "--data",
                 str(tmp_path / "t.npz"), "--test-fraction", "1.5"]) == 2
    assert "--test-fraction" in capsys.readouterr().err


SEG_FILE = "import torch\n\ndef make():\n    return torch.nn.Conv2d(3, 4, 1)\n"


def test_eval_dense_and_float_target_npz_files(tmp_path, capsys):
    (tmp_path / "seg.py").write_text(SEG_FILE)
    (tmp_path / "reg.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(5, 2)\n")
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (41, 3, 4, 5), dtype=np.uint8)
    mask = rng.integers(0, 4, (41, 4, 5))
    mask[rng.random(mask.shape) < 0.2] = 255
    np.savez(tmp_path / "seg.npz", x=x, y=mask)
    torch.manual_seed(0)
    seg = torch.nn.Conv2d(3, 4, 1)
    torch.save(seg.state_dict(), tmp_path / "s.pt")
    assert main(["eval", f"{tmp_path}/seg.py:make", "--weights", str(tmp_path / "s.pt"), "--data",
                 str(tmp_path / "seg.npz"), "--normalize", "unit", "--ignore-index", "255", "--metrics", "accuracy,iou",
                 "--chunk-size", "6", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with torch.no_grad():
        pred = seg(torch.from_numpy(x).float() / 255).argmax(1)
    y, keep = torch.from_numpy(mask), torch.from_numpy(mask != 255)
    assert res["n"] == 41 and set(res["metrics"]) == {"accuracy", "iou"}
    assert res["metrics"]["accuracy"] == pytest.approx((pred == y)[keep].double().mean().item(), rel=1e-15)
    xf = rng.normal(size=(30, 5)).astype(np.float32)
    yf = rng.normal(size=(30, 2)).astype(np.float32)
    np.savez(tmp_path / "reg.npz", x=xf, y=yf)
    torch.manual_seed(0)
    ref = torch.nn.Linear(5, 2)
    torch.save(ref.state_dict(), tmp_path / "r.pt")
    assert main(["eval", f"{tmp_path}/reg.py:make", "--weights", str(tmp_path / "r.pt"), "--data",
                 str(tmp_path / "reg.npz"), "--normalize", "none", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with torch.no_grad():
        err = ref(torch.from_numpy(xf)).double() - torch.from_numpy(yf).double()
    assert list(res["metrics"]) == ["mse", "mae"] and res["n"] == 30
    assert res["metrics"]["mse"] == pytest.approx(float((err ** 2).mean()), rel=1e-12)
    assert res["metrics"]["mae"] == pytest.approx(float(err.abs().mean()), rel=1e-12)
    assert "float targets" in res["data"]
