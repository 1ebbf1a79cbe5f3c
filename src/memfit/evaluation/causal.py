"""Causal language models' labels. `evaluate` scores each output position against the label at the same position.
A `transformers` causal LM (`GPT2LMHeadModel`, `*ForCausalLM`) is trained and evaluated the transformers way with
`labels=input_ids`: its own loss shifts them (the logits at t against the label at t+1, the last position
scored against nothing). The same labels given to `evaluate` score the logits at t against token t, the token
the model was given, not the one it predicts: a different loss and perplexity, silently (GPT-2 from a config:
perplexity 34.4 against the model's own 50.2).

`shift_labels=True` does transformers' shift on each chunk (labels[:, 1:], then the ignore index where there is
no next token), so every metric, `loss_fn` and `terms=` sees the labels the model's own loss scores;
`shift_labels=False` compares position by position as given; None (the default) refuses a causal LM's labels that
equal its input ids at every counted position (and not at the shifted ones), naming both options.

Example:
    >>> import torch
    >>> shifted(torch.tensor([[5, 6, 7], [1, 2, -100]]), -100)
    tensor([[   6,    7, -100],
            [   2, -100, -100]])
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.own_loss import is_causal_lm

__all__ = ["is_causal_lm", "label_rule", "shifted"]


def shifted(y: torch.Tensor, ignore: int) -> torch.Tensor:
    """transformers' shift of causal LM labels (n, T): position t takes the label at t + 1, the last `ignore`."""
    return torch.cat([y[:, 1:], torch.full_like(y[:, :1], ignore)], dim=1)


def label_rule(model: torch.nn.Module, shift_labels: bool | None) -> Callable | None:
    """rule(x, y, ignore) -> the labels to score a chunk against (or raises), None: as given, unchecked."""
    if shift_labels is not None and not isinstance(shift_labels, bool):
        raise TypeError(f"shift_labels must be True, False or None; found {shift_labels!r}")
    if shift_labels is False or (shift_labels is None and not is_causal_lm(model)):
        return None
    name = type(model).__name__

    def rule(x, y, ignore: int):
        if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.is_floating_point():
            if shift_labels:
                raise ValueError(f"shift_labels=True shifts token labels (n, sequence length) of integers; found "
                                 f"{_what(y)}: pass them as one integer tensor, or leave shift_labels out")
            return y
        if shift_labels:
            return shifted(y, ignore)
        ids = _input_ids(x)
        if ids is not None and ids.shape == y.shape and _unshifted(ids, y, ignore):
            raise ValueError(
                f"the labels equal the input ids at every position that counts, and {name} is a causal LM: "
                "transformers' own loss (labels=input_ids) scores the logits at t against the token at t+1, but "
                "evaluate scores each position against the label at the same position, which would give another "
                "loss and perplexity than the model's own. Fix: pass shift_labels=True (transformers' shift), or "
                "shifted labels (labels[:, :-1] = input_ids[:, 1:], the last -100), or shift_labels=False to score "
                "position by position as given")
        return y
    return rule


def _input_ids(x) -> torch.Tensor | None:
    """The token ids a causal LM is given: x itself, x['input_ids'] or x[0]."""
    if isinstance(x, dict):
        x = x.get("input_ids")
    elif isinstance(x, (tuple, list)) and x:
        x = x[0]
    return x if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point() else None


def _unshifted(ids: torch.Tensor, y: torch.Tensor, ignore: int) -> bool:
    """y equals ids where it counts, and is not also the shifted labels (a run of one repeated token is both)."""
    counted = y != ignore
    if not bool(counted.any()) or not bool(((y == ids) | ~counted).all()):
        return False
    as_shifted = (y[:, :-1] == ids[:, 1:]) | ~counted[:, :-1]
    return not bool(as_shifted.all() and not counted[:, -1].any())


def _what(y) -> str:
    if isinstance(y, torch.Tensor):
        return f"a {y.dtype} tensor of shape {tuple(y.shape)}"
    return f"a {type(y).__name__}"
