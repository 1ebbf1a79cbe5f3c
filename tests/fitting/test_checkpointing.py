"""Checkpointing installed by a plan's step holds only in the thread running that step: another thread's
forward of the same modules, and a memory model predicted there, see the model as it is without the plan."""
import threading

import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.fitting.checkpointing import checkpointed


class Counted(nn.Sequential):
    """A block that counts its forwards (a checkpointed one runs again in backward)."""
    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[Counted(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 16)) for _ in range(3)])


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=120)
    assert out, "the thread did not finish"
    return out[0]


def test_another_threads_forward_and_prediction_do_not_see_the_steps_checkpointing():
    model = _model()
    x, y = torch.randn(64, 16), torch.randn(64, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def predict():
        mm = memfit.memory_model(model, x[:8], train=True, optimizer=opt, loss_fn=F.mse_loss, target=y[:8])
        return mm.total_bytes(64)

    def forward_backward():
        Counted.calls = 0
        F.mse_loss(model(x), y).backward()
        return Counted.calls
    plain = predict()
    with checkpointed(model, ["0", "1", "2"]):       # as while plan.step runs in this thread
        mine = forward_backward()
        theirs = _in_thread(forward_backward)
        predicted = _in_thread(predict)
    assert mine == 6                                  # here: each block's forward, then its recomputation
    assert theirs == 3                                # there: the plain forward (it recomputed before)
    assert predicted == plain                         # there: the plain step's bytes (it was below them before)


def test_a_decoders_key_value_cache_is_off_while_checkpointed():
    """A Llama with its default use_cache=True: a checkpointed block recomputed in backward would append to the
    cache again (a shape error with a padding mask, before); inside `checkpointed` the cache is off, so the gradient
    is the plain step's, and use_cache is put back after. A cache asked for in the batch is refused by name."""
    import pytest
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).train()
    assert model.config.use_cache
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    x = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    model(**x).loss.backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with checkpointed(model, ["model.layers.0", "model.layers.1"]):
        assert not model.config.use_cache
        model(**x).loss.backward()
        with pytest.raises(ValueError, match=r"LlamaDecoderLayer is checkpointed and was given a key/value cache.*"
                                             r"pass use_cache=False"):
            model(**x, use_cache=True)
    assert model.config.use_cache
    for p, g in zip(model.parameters(), plain, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
