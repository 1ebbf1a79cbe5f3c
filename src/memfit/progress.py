"""Progress bars for long work: tqdm when it is installed and stderr is a terminal, else nothing."""

from __future__ import annotations

import sys

__all__ = ["progress_bar"]


class _Silent:
    def __init__(self, *args, **kwargs):
        self.n = 0

    def update(self, n=1):
        self.n += n

    def set_postfix_str(self, s, refresh=True):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def progress_bar(total: int | None, desc: str, *, unit: str = "it", enabled: bool | None = True, leave: bool = True,
                 delay: float = 0.0):
    """A tqdm bar counting `unit`s, or a silent stand-in.

    `enabled=None` or `True` shows the bar only when stderr is a terminal (never in logs or CI);
    `False` never shows it. The stand-in keeps `.n`, so callers can count through it either way.
    `delay`: seconds before the bar first shows (work done sooner shows none).
    """
    if enabled is False or not sys.stderr.isatty():
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Silent()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=leave, dynamic_ncols=True, delay=delay)
