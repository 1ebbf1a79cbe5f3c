"""One optimizer step on a logical batch that does not fit, run as micro-batches that do.

`accumulate` splits a batch (x, y) into micro-batches, weights each micro-batch's mean loss by its
share of the samples (m_i / N, so an uneven last micro-batch counts right) and accumulates the
gradients, then takes one optimizer step: the gradient equals the full-batch gradient up to float
reassociation. The micro-batch size comes from the training memory model and the budget
(`memfit.memory.micro_batch`), or is given. An out-of-memory error backs off: the failed micro-batch
alone is retried at half its size.

Modules: `run` (`accumulate`, the driver) → `checks` (the batch, the model, the sizes, the loss's terms) →
`micro_step` (forward, weighted loss, backward, back-off; what `.grad` gets when no step follows) → `ranks` (the
agreements between ranks and DDP's one all-reduce) → `result` (`StepResult`, the errors).

Example:
    >>> import torch
    >>> torch.manual_seed(0) and None
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(10, 4), torch.randint(0, 2, (10,))
    >>> from memfit import accumulate
    >>> r = accumulate(model, opt, (x, y), torch.nn.functional.cross_entropy, micro_batch=4)
    >>> r.micro_batches, r.micro_batch, r.retries       # 4 + 4 + 2 samples
    (3, 4, 0)

`memfit.accumulate` is the entry point; this package exports `StepResult` (its result); the errors are in
`memfit.errors` (`NonFiniteLossError`, `BatchDependentError`); `batch_dependent_modules` is in `checks`.
"""

from memfit.accumulation.result import StepResult

__all__ = ["StepResult"]
