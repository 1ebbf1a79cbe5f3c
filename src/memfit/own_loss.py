"""A model's own loss, as Hugging Face models train: the labels go in with the inputs (`model(**x)` with
`x["labels"]`) and the model returns its loss (`out.loss`). `loss_fn=None` or `loss_fn="model"` asks for it in
`memfit.fit`, `plan.step`, `memfit.accumulate` and `memfit.evaluate`: no target beside the inputs, no loss callable.

transformers' losses are means over the labels that are not -100 (a causal LM's shifted by one: the logits at t
against the label at t + 1, so the first label of each row counts for nothing). Micro-batches (or chunks) weighted by
samples would then not give the full batch's loss and gradient where rows hold different numbers of -100;
`label_terms` counts, per sample, the labels that count, as `terms=` would, so each part is weighted by its share
of them. The count is transformers' own (`Trainer`'s `num_items_in_batch`): `x["shift_labels"]` as given where the
batch has them, else `x["labels"][:, 1:]` for a causal LM, else `x["labels"]`.

Example:
    >>> import torch
    >>> x = {"input_ids": torch.zeros(2, 4, dtype=torch.long),
    ...      "labels": torch.tensor([[1, 2, 3, 4], [1, 2, -100, -100]])}
    >>> label_terms(torch.nn.Linear(1, 1), x).per_sample     # not a causal LM: every label that is not -100
    [4, 2]
"""

from __future__ import annotations

import sys

import torch

from memfit.batches import plain_batch
from memfit.targets import IGNORE_INDEX

__all__ = ["MODEL", "LabelTerms", "is_causal_lm", "is_own", "label_terms", "model_loss", "no_target", "own_batch"]

MODEL = "model"          # loss_fn="model": the model's own loss (None says the same where it has no other meaning)


def is_own(loss_fn) -> bool:
    """loss_fn asks for the model's own loss: None, "model" or `model_loss`; another string is refused."""
    if isinstance(loss_fn, str):
        if loss_fn != MODEL:
            raise ValueError(f"loss_fn must be a callable (loss_fn(output, y) -> the loss), None or 'model' (the "
                             f"model's own loss, out.loss); found the string {loss_fn!r}")
        return True
    return loss_fn is None or loss_fn is model_loss


def model_loss(out, y=None) -> torch.Tensor:
    """The loss the model computed itself: `out.loss` (a transformers ModelOutput), `out["loss"]` (a dict).

    Raises:
        ValueError: the output holds no loss tensor (the labels were not in the inputs).
    """
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    has = type(out).__name__ + (f" (keys {list(out)[:6]})" if isinstance(out, dict) else "")
    # a transformers model asked for return_dict=False returns a plain tuple, its loss first: nothing names it a loss
    plain = " (a transformers model returns a tuple with return_dict=False: leave that out, so that out.loss names " \
            "it)" if isinstance(out, (tuple, list)) else ""
    raise ValueError(f"loss_fn=None (or 'model') trains on the model's own loss, out.loss; the model returned {has} "
                     f"without one{plain}. Fix: put the labels in the inputs (x['labels'], as transformers models take "
                     "them: model(**x) then returns .loss), or pass a loss_fn(output, y) and targets y")


def no_target(y, where: str) -> None:
    """Refuse targets beside the inputs for the model's own loss (they would be left unused, silently)."""
    if y is not None:
        raise ValueError(f"{where}: loss_fn=None (or 'model') takes the model's own loss, computed from the labels "
                         f"inside the inputs (x['labels']); found targets y beside them too ({type(y).__name__}), "
                         "which it would not read. Fix: put them in x['labels'] and pass x alone (or (x, None)), "
                         "or pass a loss_fn(output, y)")


def is_causal_lm(model: torch.nn.Module) -> bool:
    """A `transformers` model whose class (or a base class) is a causal LM: in transformers' causal LM mapping
    (`GPT2LMHeadModel`, `LlamaForCausalLM`, ...) or named `*ForCausalLM`; never an encoder-decoder (whose labels
    are not shifted: its decoder is fed them shifted right)."""
    if "transformers" not in sys.modules or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
        causal = set(names.values())
    except ImportError:            # an older or newer layout: the naming rule alone
        causal = set()
    return any(c.__name__ in causal or c.__name__.endswith("ForCausalLM") for c in type(model).__mro__)


class LabelTerms:
    """terms(x, y) of a model's own loss: how many labels in x count (not -100): `x["shift_labels"]` as given where x
    has them, else `x["labels"]`, from the second position on where `shift` (a causal LM's). `per_sample`: each
    sample's count in the batch it was made for, on the host (a micro-batch's count is then a sum of ints: no read
    of the device per micro-batch). Labels that are not integers (a regression's) count one term per sample."""

    def __init__(self, shift: bool, per_sample: list[int] | None = None):
        self.shift, self.per_sample = shift, per_sample

    def counted(self, x) -> torch.Tensor:
        """(n,) int64: each sample's labels that count."""
        if "shift_labels" in x:
            labels = x["shift_labels"]
        else:
            labels = x["labels"]
            labels = labels[:, 1:] if self.shift and labels.dim() >= 2 else labels
        if not _integer(labels):
            return torch.ones(labels.shape[0], dtype=torch.long, device=labels.device)
        return (labels != IGNORE_INDEX).reshape(labels.shape[0], -1).sum(1)

    def __call__(self, x, y=None) -> torch.Tensor:
        return self.counted(x).sum()


def _integer(labels) -> bool:
    return isinstance(labels, torch.Tensor) and labels.dim() >= 1 and not labels.is_floating_point() \
        and labels.dtype != torch.bool


def label_terms(model: torch.nn.Module, x) -> LabelTerms | None:
    """The terms of `model`'s own loss on the batch x (`LabelTerms`, its counts per sample read in one transfer), or
    None where x holds no integer labels (float labels of a regression, a multi-label target: every sample the same
    number of terms, so samples weigh right)."""
    if not isinstance(x, dict) or not _integer(x.get("shift_labels", x.get("labels"))) \
            or not x.get("shift_labels", x.get("labels")).numel():
        return None
    terms = LabelTerms(is_causal_lm(model))
    terms.per_sample = terms.counted(x).tolist()
    return terms


def own_batch(batch, where: str) -> tuple:
    """(x, None) for a step on the model's own loss: `batch` the inputs x alone (a dict holding its labels) or
    (x, None); targets beside x are refused. A `BatchEncoding` is its dict (`memfit.batches.plain_batch`)."""
    batch = plain_batch(batch)
    if isinstance(batch, dict):
        batch = (batch, None)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"{where}: with loss_fn=None (or 'model') the batch is the inputs x, a dict holding the labels "
                        f"(x['labels']), or (x, None); found {type(batch).__name__}"
                        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    no_target(batch[1], where)
    return batch[0], None
