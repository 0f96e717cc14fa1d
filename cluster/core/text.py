"""Text that every encoder on the way to a rank takes: valid Unicode."""

from __future__ import annotations


def valid_text(text: str) -> str:
    """``text`` with no lone surrogate: a pair becomes its character, a lone one U+FFFD (a
    JSON ``\\ud800`` escape, a parser's output, or argv's undecodable bytes, which Python
    keeps as surrogates). Unchanged, and not copied, when it is already valid."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
