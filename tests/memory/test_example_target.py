"""The example target built from the model's output for the common losses (`memfit.memory.example_target`): the
prediction with it equals the prediction with an explicit target of that form, and any other loss without a
target gets an error saying what to pass."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.memory.example_target import CLASS_IDS, LIKE_OUTPUT, loss_target


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))


def segmenter() -> nn.Module:
    """(n, 3, 8, 8) -> (n, 5, 8, 8): a class score per pixel."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 5, 1))


def log_probs() -> nn.Module:
    return nn.Sequential(classifier(), nn.LogSoftmax(dim=1))


# (loss, model, sample shape, the explicit target of the form the built one should have, at batch 2)
CASES = {
    "F.cross_entropy": (F.cross_entropy, classifier, (16,), torch.zeros(2, dtype=torch.long)),
    "CrossEntropyLoss per pixel": (nn.CrossEntropyLoss(), segmenter, (3, 8, 8), torch.zeros(2, 8, 8, dtype=torch.long)),
    "NLLLoss": (nn.NLLLoss(), log_probs, (16,), torch.zeros(2, dtype=torch.long)),
    "F.nll_loss": (F.nll_loss, log_probs, (16,), torch.zeros(2, dtype=torch.long)),
    "F.mse_loss": (F.mse_loss, classifier, (16,), torch.zeros(2, 10)),
    "MSELoss": (nn.MSELoss(), segmenter, (3, 8, 8), torch.zeros(2, 5, 8, 8)),
    "L1Loss": (nn.L1Loss(), classifier, (16,), torch.zeros(2, 10)),
    "F.smooth_l1_loss": (F.smooth_l1_loss, classifier, (16,), torch.zeros(2, 10)),
    "BCEWithLogitsLoss": (nn.BCEWithLogitsLoss(), classifier, (16,), torch.zeros(2, 10)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_target_built_from_the_output_predicts_as_the_explicit_one(case):
    loss_fn, make, shape, explicit = CASES[case]
    model = make()
    opt = torch.optim.Adam(model.parameters())
    built = memfit.memory_model(model, shape, train=True, optimizer=opt, loss_fn=loss_fn)
    given = memfit.memory_model(model, shape, train=True, optimizer=opt, loss_fn=loss_fn, target=explicit)
    for n in (1, 3, 64):
        assert built.breakdown(n) == given.breakdown(n), n
    assert "no target given" in built.method and "no target given" not in given.method
    kind = "class ids" if explicit.dtype == torch.long else "the output's shape and dtype"
    assert kind in built.explain()


def test_the_readme_form_without_a_target_gives_what_a_real_step_fits():
    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = memfit.max_batch_size(model, (16,), "64KiB", train=True, optimizer=opt, loss_fn=F.cross_entropy)
    y = torch.zeros(n, dtype=torch.long)
    assert memfit.measure_step(model, torch.randn(n, 16), opt, F.cross_entropy, y) <= 64 * 1024
    y = torch.zeros(n + 1, dtype=torch.long)
    assert memfit.measure_step(model, torch.randn(n + 1, 16), opt, F.cross_entropy, y) > 64 * 1024


def test_every_common_loss_is_recognised_as_a_function_a_module_and_a_partial():
    for f, m, kind in [(F.cross_entropy, nn.CrossEntropyLoss(), CLASS_IDS), (F.nll_loss, nn.NLLLoss(), CLASS_IDS),
                       (F.mse_loss, nn.MSELoss(), LIKE_OUTPUT), (F.l1_loss, nn.L1Loss(), LIKE_OUTPUT),
                       (F.smooth_l1_loss, nn.SmoothL1Loss(), LIKE_OUTPUT),
                       (F.binary_cross_entropy_with_logits, nn.BCEWithLogitsLoss(), LIKE_OUTPUT)]:
        assert loss_target(f) == loss_target(m) == loss_target(functools.partial(f, reduction="sum")) == kind
    assert loss_target(F.kl_div) is None and loss_target(lambda o, t: o.sum()) is None and loss_target(None) is None


def test_another_loss_without_a_target_says_what_to_pass():
    model = classifier()
    with pytest.raises(TypeError, match=r"takes a target.*pass target=.*target=y\[:2\].*dtype=torch.long"):
        memfit.max_batch_size(model, (16,), "1MiB", train=True, loss_fn=lambda out, y: F.kl_div(out, y))


def test_a_common_loss_on_an_output_that_is_not_one_tensor_says_what_to_pass():
    class Pair(nn.Module):
        def forward(self, x):
            return x * 2, x

    with pytest.raises(TypeError, match=r"cross_entropy takes a target \(the model's output is a tuple.*pass target="):
        memfit.memory_model(Pair(), (4,), train=True, loss_fn=F.cross_entropy)
