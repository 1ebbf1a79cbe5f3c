"""Command-line usage: `UsageError` and the argparse types of the options every command shares.

Bad usage exits with code 2 and names the option: argparse reports a failing `type=` as
"argument --seed: expected an int >= 0; found '-1'", and a command raises `UsageError` for what
it can only check after parsing. A module of its own so that `memfit.cli`, `memfit.cli.plan`,
the demo and the benchmarks share it without the library importing the command line.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


class UsageError(Exception):
    """Bad usage found after parsing (exit code 2); the message names the option and the fix."""


def budget_arg(text: str) -> str:
    """--budget: a size such as 64MiB (checked here, parsed by the command)."""
    from memfit.budget import parse_bytes
    try:
        parse_bytes(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def budgets_arg(text: str) -> tuple[str, ...]:
    """--budget of a benchmark: one size or several, comma-separated."""
    sizes = tuple(s.strip() for s in text.split(",") if s.strip())
    if not sizes:
        raise argparse.ArgumentTypeError(f"expected sizes such as 8MiB,16MiB; found {text!r}")
    return tuple(budget_arg(s) for s in sizes)


def device_arg(text: str) -> str:
    """--device: cpu, cuda, cuda:1, checked against this machine."""
    from memfit.device.machine import resolve_device
    try:
        resolve_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def device_name_arg(text: str) -> str:
    """--device where a CUDA device may be predicted from a machine without one: 'cpu', 'cuda' or 'cuda:N', by name
    only (`device_arg` checks it against this machine)."""
    import torch
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected a device such as 'cpu', 'cuda' or 'cuda:1'; found {text!r}")
    return text


def data_arg(text: str) -> str:
    """--data: a spec of `memfit.cli.data` whose file or folder exists (its contents are read later)."""
    from memfit.cli.data import check_spec
    try:
        return check_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def count_arg(low: int = 1) -> Callable[[str], int]:
    """An argparse type for a whole number >= `low` (--epochs, --batch-size, --seed, --repeat, ...)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}; found {text!r}")
        return n
    parse.__name__ = f"int >= {low}"                  # argparse names the type in some messages
    return parse


def counts_arg(low: int = 1) -> Callable[[str], tuple[int, ...]]:
    """An argparse type for comma-separated whole numbers >= `low` (--batches 1,32)."""
    one = count_arg(low)

    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(one(s.strip()) for s in text.split(","))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= {low} such as 1,32; "
                                             f"found {text!r}") from None
    parse.__name__ = f"list of int >= {low}"
    return parse


def names_arg(valid, what: str) -> Callable[[str], tuple[str, ...]]:
    """An argparse type for comma-separated names from `valid` (--sets mnist,cifar; --models ...)."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(s.strip() for s in text.split(",") if s.strip())
        unknown = [n for n in names if n not in valid]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, unknown)) or repr(text)}; "
                                             f"expected comma-separated names from {', '.join(valid)}")
        return names
    parse.__name__ = what
    return parse
