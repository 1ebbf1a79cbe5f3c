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
               ["bench", "evaluate"], ["bench", "distributed"], ["plan"], ["eval"]]


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


def test_info_json_lists_the_cpu():
    out = subprocess.run([sys.executable, "-m", "memfit", "info", "--json"], capture_output=True, text=True,
                         check=True)
    info = json.loads(out.stdout)
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
