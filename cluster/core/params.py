"""One declaration per parameter: a spec field's default, range, help and flag name, and its
name in the API, live on the field (``param``); the click options (cluster.commands.options)
and the API's range checks (cluster.serve.api.shared) are made from them.

    temp: float = param(0.0, Range(0, 100, meaning="0 is greedy"), "Sampling temperature.",
                        api="temperature", dialects=ALL)

A command-line value and a request's value are checked against the same Range, so the
command line and the API agree on every range (the API's own conventions, -1 for "off" or
"a random seed", are in the Range's ``meaning``, and the CLI takes them too).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

OPENAI, RESPONSES, ANTHROPIC = "openai", "responses", "anthropic"  # the API dialects
ALL = (OPENAI, RESPONSES, ANTHROPIC)


@dataclass(frozen=True)
class Range:
    """The values a parameter takes; ``meaning`` says what special values do."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    low_open: bool = False  # low itself is not allowed
    meaning: str = ""

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.low is None and self.high is None:
            return kind
        low = (
            "" if self.low is None else f"{self.low:g}" + (" (exclusive)" if self.low_open else "")
        )
        high = (
            ""
            if self.high is None
            else (f"{self.high:d}" if isinstance(self.high, int) else f"{self.high:g}")
        )
        if not high:
            span = f"from {low} up"
        elif not low:
            span = f"up to {high}"
        else:
            span = f"from {low} to {high}"
        extra = f" ({self.meaning})" if self.meaning else ""
        return f"{kind} {span}{extra}"

    def admits(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high


@dataclass(frozen=True)
class Param:
    """What a spec field is to the command line and the API."""

    help: str
    range: Range | None = None
    flag: str | None = None  # the option's name; default --field-name ("" : no option)
    choices: tuple | None = None
    metavar: str | None = None
    api: str | None = None  # its name in a request body (None: not taken from the API)
    dialects: tuple[str, ...] = ()  # the API dialects that take it
    show_default: bool = True
    envvar: str | None = None
    toggle: str | None = None  # a boolean's "--x/--no-x" form
    multiple: bool = False
    commas: bool = False  # a repeated option whose values may also be comma-separated


def param(default: Any = dataclasses.MISSING, range: Range | None = None, help: str = "", *,
          default_factory: Any = dataclasses.MISSING, **kw: Any) -> Any:  # fmt: skip
    """A dataclass field declared once: its default, and what it is to the CLI and the API."""
    meta = {"param": Param(help=help, range=range, **kw)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def params(cls: type) -> dict[str, tuple[dataclasses.Field, Param]]:
    """The fields of ``cls`` declared with ``param``, by name, in order."""
    return {
        f.name: (f, f.metadata["param"]) for f in dataclasses.fields(cls) if "param" in f.metadata
    }


def api_fields(cls: type, dialect: str) -> dict[str, str]:
    """A dialect's request field -> the field of ``cls`` it sets."""
    return {p.api: name for name, (_, p) in params(cls).items() if p.api and dialect in p.dialects}


def ranges(cls: type) -> dict[str, Range]:
    """Each API parameter's Range, by field name: the one table of what a request may ask."""
    return {name: p.range for name, (_, p) in params(cls).items() if p.api and p.range}
