"""Metrics as sums and counts, so that any chunking gives exactly the whole-set value.

Averaging per-chunk accuracies is wrong when the last chunk is smaller: with
10,001 samples in chunks of 50 the last chunk of 1 sample weighs as much as a full one. Here each
chunk contributes sums (correct predictions, summed losses, squared errors, confusion counts) and
counts; the value is computed once at the end. Contributions are computed first and committed
only after the whole chunk succeeded, so a chunk retried after an out-of-memory error is never
counted twice. States add up across processes too (`torch.distributed.all_reduce(SUM)`).

| metric        | targets                                   | value                                            |
|---------------|-------------------------------------------|--------------------------------------------------|
| `accuracy`, `topk:K` | class ids (N,) or labels (N, *d)   | share of positions (not ignore_index) predicted  |
| `loss`        | class ids / labels (default cross entropy), any with `loss_fn` | torch's mean over the whole set |
| `loss` (`OwnLoss`) | labels inside the inputs, `loss_fn="model"` | the model's own `out.loss` over the set |
| `perplexity`  | token labels (N, T)                       | exp of the token-mean cross entropy (non-ignored)|
| `iou`         | labels (N, *d) (segmentation)             | mean over classes present of intersection / union |
| `confusion`   | class ids / labels                        | (C, C) counts, rows true, columns predicted      |
| `mse`, `mae`  | float targets of any shape                | mean squared / absolute error over every value   |

Class scores may lie on dimension 1 (`(N, C, *d)`, torch's convention) or last (`(N, *d, C)`, a language
model's logits); the shapes say which (`class_dim`). Labels equal to `ignore_index` (evaluate's, the loss's, the
data's, else -100) count nowhere. With a dict of targets a metric names its target, `"accuracy@label"`, and
reads the model's output of that name (`output_for`).

The package: `checks` (what a metric compares, checked) → `sums` (pure functions: one chunk's sums) →
`stateful` (the `Metric` classes, thin, holding those sums) → `specs` (metrics by name, the defaults of each
target kind); `outputs` picks what a metric reads from the model's output. Every name is importable from
`memfit.metrics`.

Example:
    >>> import torch
    >>> m = Accuracy()
    >>> m.commit(m.contribution(torch.tensor([[2., 1.], [0., 3.]]), torch.tensor([0, 0])))
    >>> m.commit(m.contribution(torch.tensor([[1., 0.]]), torch.tensor([0])))
    >>> m.compute()
    0.6666666666666666
"""

from __future__ import annotations

from memfit.metrics.checks import class_dim, class_targets, float_targets, type_name
from memfit.metrics.outputs import logits_of, order_error, output_for
from memfit.metrics.specs import DEFAULTS, NAMES, default_metrics, make_metric
from memfit.metrics.stateful import (
           AbsoluteError,
           Accuracy,
           Confusion,
           External,
           IoU,
           Loss,
           Metric,
           OwnLoss,
           Perplexity,
           SquaredError,
           TopK,
)
from memfit.metrics.sums import confusion, correct, correct_topk, cross_entropy_sum, intersection_union

__all__ = ["AbsoluteError", "Accuracy", "Confusion", "DEFAULTS", "External", "IoU", "Loss", "Metric", "NAMES",
           "OwnLoss", "Perplexity", "SquaredError", "TopK", "class_dim", "class_targets", "confusion", "correct",
           "correct_topk", "cross_entropy_sum", "default_metrics", "float_targets", "intersection_union",
           "logits_of", "make_metric", "order_error", "output_for", "type_name"]
