"""memfit.memory.held_grads: the memory model of a step with every gradient held, derived from the plain step's fake
runs, against the held step's own fake runs (`step_memory_model(grads_held=True)`): the same bytes at every op, or
declined."""
import pytest
import torch
from model_checks import assert_same_model
from torch import nn
from torch.nn import functional as F

from accumulation.cases import data, make
from memfit.memory import held_grads
from memfit.memory.fake_run import FakeRunError
from memfit.memory.micro_batch import training_peak
from memfit.memory.step_model import forget_step_model, step_memory_model

transformers = pytest.importorskip("transformers")


def _bn_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _text(kind: str) -> nn.Module:
    """A one-layer transformers model with random weights: BERT, GPT-2 (its head tied to the embedding), Llama."""
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    if kind == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100))
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=100))


def _logits_loss(out, y=None):
    return F.cross_entropy(out.logits.flatten(0, -2).float(), torch.zeros(out.logits[..., 0].numel(),
                                                                             dtype=torch.long))


def _case(kind: str):
    """(model, x, y, loss_fn, whether derived; a reason it is not)."""
    if kind == "bn_cnn":
        g = torch.Generator().manual_seed(1)
        return _bn_cnn(), torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g), \
            F.cross_entropy, ""
    if kind in ("bert", "gpt2", "llama"):
        ids = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(1))
        return _text(kind), ids, None, _logits_loss, ""
    x, y = data(8)
    views = "view of a larger or shared storage"
    return make(kind), x, y, F.cross_entropy, views if kind in ("frozen_cat", "batch_cat", "cls_token") else ""


def _models(model, x, y, loss_fn, autocast=None):
    """(derived, its own) held-step models of accumulate's step, after the plain one (the order training_peak makes
    them in)."""
    opt = torch.optim.AdamW(model.parameters())
    kw = dict(train=True, optimizer=opt, loss_fn=loss_fn, target=y, keep_output=False, autocast=autocast)
    forget_step_model(model)
    runs: dict = {}
    step_memory_model(model, x, plain_runs=runs, **kw)
    derived = step_memory_model(model, x, grads_held=True, plain_runs=runs, **kw)
    assert not runs                                      # let go
    forget_step_model(model)
    return derived, step_memory_model(model, x, grads_held=True, **kw)


def _assert_same(derived, own):
    assert derived.method == own.method
    assert_same_model(derived, own)


@pytest.mark.parametrize("kind", ["mlp", "bn_cnn", "tied", "bert", "gpt2", "llama", "frozen_cat", "cls_token"])
def test_the_derived_held_model_is_the_held_steps_own_or_declined(kind):
    """Every op's bytes per kind, the gradients' bytes, the peak by phase and `method` of the held step's model
    derived from the plain step's runs are those of its own runs; where a gradient is a slice of torch.cat's buffer
    (frozen rows, the batch's rows, a class token at batch 1: freed later than its AccumulateGrad) it is declined."""
    model, x, y, loss_fn, declined = _case(kind)
    derived, own = _models(model, x, y, loss_fn)
    assert derived.held_runs.startswith("own runs" if declined else "derived"), derived.held_runs
    assert declined in derived.held_runs
    _assert_same(derived, own)


def test_under_bf16_autocast_and_checkpointed_blocks_as_fit_sets_them():
    """A checkpointed block (non-reentrant, recomputed in backward), and a forward under bfloat16 autocast, as
    `memfit.fit`'s search runs a setting (`finder.Peaks`)."""
    from memfit.fitting.finder import Peaks
    from memfit.fitting.search import Setting
    model, x, _, loss_fn, _ = _case("bert")
    opt = torch.optim.AdamW(model.parameters())
    for setting in (Setting(("bert.encoder.layer.0",)), Setting((), "bfloat16")):
        peaks = Peaks(model, model, opt, loss_fn, x, None, setting)
        with peaks._on():
            derived, own = _models(model, x, None, loss_fn)
        assert derived.held_runs.startswith("derived"), derived.held_runs
        _assert_same(derived, own)


class _Scale(nn.Module):
    """Parameters whose gradient is an expanded view (backward of a sum, passed on by an add to both): AccumulateGrad
    copies it (`clone_obey_contract`)."""

    def __init__(self):
        super().__init__()
        self.lin, self.a, self.b = nn.Linear(6, 3), nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.lin(x) * (self.a + self.b).sum()


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        return self.used(x)


class _Clipped(nn.Module):
    """Its forward puts a hook on a weight's gradient (clipped before AccumulateGrad takes it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        if torch.is_grad_enabled():
            self.lin.weight.register_hook(lambda g: g.clamp(-1, 1))
        return self.lin(x)


@pytest.mark.parametrize("model, why", [(_Scale, "copied, not stolen"), (_Unused, "no gradient"),
                                        (_Clipped, "hook")])
def test_a_copied_gradient_a_parameter_without_one_or_a_hook_declines(model, why):
    """AccumulateGrad copies a gradient it cannot steal (`clone_obey_contract`): the held step adds into `.grad`
    instead, no copy made; a parameter without a gradient is left alone by the plain step's optimizer and stepped by
    the held one's; a hook on a gradient runs ops of its own around AccumulateGrad."""
    x, y = data(8)
    derived, own = _models(model(), x, y, F.cross_entropy)
    assert derived.held_runs.startswith("own runs") and why in derived.held_runs, derived.held_runs
    _assert_same(derived, own)


def test_training_peak_is_the_same_derived_or_not(monkeypatch):
    """accumulate's predicted peak at every micro-batch size, with the held model derived and with its own runs."""
    model, x, y, loss_fn, _ = _case("tied")
    opt = torch.optim.AdamW(model.parameters())
    made = []
    real = held_grads.held_probes
    monkeypatch.setattr(held_grads, "held_probes", lambda plain: made.append(real(plain)) or made[-1])
    forget_step_model(model)
    peak, _ = training_peak(model, opt, loss_fn, x, y)
    derived = [peak(m) for m in (1, 2, 3, 5, 8)]
    assert len(made) == 1

    def declined(plain):
        raise held_grads.Declined("the test's")
    monkeypatch.setattr(held_grads, "held_probes", declined)
    forget_step_model(model)
    peak, _ = training_peak(model, opt, loss_fn, x, y)
    assert derived == [peak(m) for m in (1, 2, 3, 5, 8)]


def test_a_derived_fit_that_fails_leaves_the_held_model_to_its_own_runs(monkeypatch):
    """The derived model may run sizes the plain runs did not; where such a run fails (a value read that the batch
    size answers otherwise), the held model is made from its own runs, which make every run again without reading
    values, instead of the failure ending the prediction."""
    from memfit.memory import step_model
    model, x, y, loss_fn, _ = _case("mlp")
    fit = step_model._fit

    def failing(spec, *args, made=None, **kw):
        if made is not None:
            raise FakeRunError("a run at another size failed")
        return fit(spec, *args, **kw)
    monkeypatch.setattr(step_model, "_fit", failing)
    derived, own = _models(model, x, y, loss_fn)
    assert derived.held_runs == "own runs (a run at another size failed)", derived.held_runs
    _assert_same(derived, own)
