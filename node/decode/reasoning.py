"""Reasoning in the stream: the model's own think markers become ``<think>`` / ``</think>``.

Families mark their reasoning differently (``<think>``, ``<longcat_think>``,
``<|channel>thought`` ... ``<channel|>``, ``<|open|>think<|sep|>`` ...); mlx-lm's tokenizer
wrapper knows which one a tokenizer uses (``think_start`` / ``think_end``). Clients of the
stream see one form. When the chat template itself opens the block (the prompt ends inside it),
the stream starts with ``<think>`` so the block the client sees is balanced.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def held_back(pending: str, patterns: list[str]) -> int:
    """How many characters at the end of ``pending`` could still begin one of ``patterns``."""
    longest = max((len(p) for p in patterns), default=1) - 1
    for k in range(min(len(pending), longest), 0, -1):
        tail = pending[-k:]
        if any(p.startswith(tail) for p in patterns):
            return k
    return 0


class Rewrite:
    """Streaming replacement of whole strings that may arrive split across segments."""

    def __init__(self, mapping: dict[str, str]):
        self.mapping = {k: v for k, v in mapping.items() if k and k != v}
        self.pending = ""

    def feed(self, text: str) -> str:
        self.pending += text
        if not self.mapping:
            shown, self.pending = self.pending, ""
            return shown
        out = []
        while True:
            hits = [(i, k) for k in self.mapping if (i := self.pending.find(k)) >= 0]
            if not hits:
                break
            i, key = min(hits)
            out.append(self.pending[:i] + self.mapping[key])
            self.pending = self.pending[i + len(key) :]
        cut = len(self.pending) - held_back(self.pending, list(self.mapping))
        out.append(self.pending[:cut])
        self.pending = self.pending[cut:]
        return "".join(out)

    def flush(self) -> str:
        shown, self.pending = self.pending, ""
        return shown


def normalizer(tokenizer) -> Rewrite:
    """A Rewrite from this tokenizer's think markers to ``<think>`` / ``</think>``."""
    start = getattr(tokenizer, "think_start", None)
    end = getattr(tokenizer, "think_end", None)
    if not start or not end:
        return Rewrite({})
    return Rewrite({start: THINK_OPEN, end: THINK_CLOSE})


def opens_in_thought(tokenizer, prompt: list[int]) -> bool:
    """Whether the prompt (the chat template's work) leaves the model inside a think block."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    start = tokenizer.rfind_think_start(prompt)
    end = tokenizer.rfind_think_end(prompt)
    return start >= 0 and start > end
