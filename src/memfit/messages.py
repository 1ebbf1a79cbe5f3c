"""How memfit words its messages: counts with their noun, an error's first line, text cut at a word."""

from __future__ import annotations

__all__ = ["first_line", "plural", "whole_words"]


def plural(n: int, noun: str, many: str | None = None) -> str:
    """'1 tensor', '3 tensors': a count and its noun, for messages (`many` for an irregular plural).

    Example:
        >>> plural(1, "chunk"), plural(0, "chunk"), plural(2, "retry", "retries")
        ('1 chunk', '0 chunks', '2 retries')
    """
    return f"{n} {noun}" if n == 1 else f"{n} {many or noun + 's'}"


def whole_words(text: str, limit: int) -> str:
    """text, or its first words up to about `limit` characters and '...': never cut mid-word.

    Example:
        >>> whole_words("the planner could not capture the model", 20)
        'the planner could ...'
    """
    if len(text) < limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def first_line(e: BaseException, with_type: bool = True) -> str:
    """'TypeName: first line of the message' (or only the line), whole: never cut mid-word.

    Example:
        >>> first_line(ValueError("bad shape\\nmore detail")), first_line(KeyError(), with_type=False)
        ('ValueError: bad shape', 'KeyError')
    """
    text = str(e).strip()
    if not text:
        return type(e).__name__
    line = text.splitlines()[0].strip()
    return f"{type(e).__name__}: {line}" if with_type else line
