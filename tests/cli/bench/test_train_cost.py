"""`memfit bench train`'s cost table: the memory model and max_batch_size timed against real steps."""
import pytest
import torch
import torch.nn.functional as F

import memfit
from memfit.cli.bench import train_cost
from memfit.cli.bench.train_cases import Case


def _mlp_case():
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return Case("mlp", make, lambda n: (torch.randn(n, 32), torch.randint(0, 10, (n,))), F.cross_entropy)


def test_a_cost_row_times_the_prediction_and_max_batch_size_that_memfit_gives():
    case = _mlp_case()
    row = train_cost.cost_row(case, 8, "200KiB", repeat=2, warmup=0)
    model = case.make()
    x, y = case.batch(2)
    expected = memfit.max_batch_size(model, x, "200KiB", train=True, optimizer=torch.optim.AdamW(model.parameters(),
                                     lr=1e-3), loss_fn=F.cross_entropy, target=y)
    assert row["max batch"] == expected > 8
    assert 1.0 <= row["pred/meas"] <= 1.05, row
    for k in ("model s", "step s", "max_batch_size s", "step at max s"):
        assert row[k] > 0, k
    assert row["model/step"] > 0 and row["max_batch_size/step"] > 0


def test_the_verdicts_judge_the_cnn_in_seconds_and_width_768_in_steps(capsys):
    rows = [{"model": "cnn 3 blocks, 64x64", "batch": 32, "model s": 2.5, "model/step": 3.0, "max batch": 97,
             "max_batch_size/step": 1.2},
            {"model": "bert 768x2, seq 128", "batch": 8, "model s": 1.0, "model/step": 0.4, "max batch": 12,
             "max_batch_size/step": 0.5},
            {"model": "gpt2 768x2, seq 128", "batch": 8, "model s": 3.0, "model/step": 1.1, "max batch": 11,
             "max_batch_size/step": 0.6}]
    train_cost.cost_verdicts(rows, lambda ok, text: print(f"{'PASS' if ok else 'MISS'}  {text}"))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS  memory model of the small CNN") and "2.50 s" in out[0]
    assert out[1].startswith("MISS  memory model / one real step at width 768: worst 1.10x (gpt2")
    assert out[2].startswith("INFO  max_batch_size(train=True)") and "cnn 1.20x (batch 97)" in out[2]


def test_the_cost_table_alone_takes_none_of_the_other_tables_options(capsys):
    from memfit.cli.bench.train import main
    with pytest.raises(SystemExit):
        main(["--cost", "--models", "mlp"])
    assert "--cost runs its own models and sizes; drop --architectures, --overhead, --models and --sizes" in \
        capsys.readouterr().err
