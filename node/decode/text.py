"""Rank 0's text of an answer as the client sees it: stop strings held back until they are
clearly not one, reasoning markers normalised, a think block the template opened shown."""

from __future__ import annotations

from cluster.core.spec import SharedRequest
from node.decode.reasoning import THINK_OPEN, Rewrite, held_back, normalizer, opens_in_thought


class StopText:
    """Rank 0's view of the text against the stop strings: text that could still be the start
    of a stop string is held back until it is clearly not."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.hit: str | None = None  # the stop string that was reached

    def feed(self, text: str) -> tuple[str, bool]:
        """(text to show now, whether a stop string was reached)."""
        self.pending += text
        hits = [(i, x) for x in self.stops if (i := self.pending.find(x)) >= 0]
        if hits:
            at, self.hit = min(hits)
            shown, self.pending = self.pending[:at], ""
            return shown, True
        cut = len(self.pending) - held_back(self.pending, self.stops)
        shown, self.pending = self.pending[:cut], self.pending[cut:]
        return shown, False

    def flush(self) -> str:
        shown, self.pending = self.pending, ""
        return shown


class AnswerText:
    """Rank 0's text of one answer as the client sees it: reasoning markers normalised, stop
    strings looked for after that, a ``<think>`` the template opened shown first. One per
    answer, for the sequential stream and the batch alike."""

    def __init__(self, stops: list[str], rewrite: Rewrite | None = None, opening: str = ""):
        self.stop = StopText(stops)
        self.rewrite = rewrite or Rewrite({})
        self.parts: list[str] = []
        self.opening = opening

    def start(self) -> str:
        """What to show before the first token."""
        self.parts.append(self.opening)
        return self.opening

    def feed(self, segment: str) -> tuple[str, bool]:
        """(text to show now, whether a stop string was reached)."""
        shown, hit = self.stop.feed(self.rewrite.feed(segment))
        self.parts.append(shown)
        return shown, hit

    def finish(self) -> str:
        """What is left to show once the model has stopped on its own."""
        rest, hit = self.stop.feed(self.rewrite.flush())
        rest += "" if hit else self.stop.flush()
        self.parts.append(rest)
        return rest

    @property
    def text(self) -> str:
        return "".join(self.parts)


def answer_text(tokenizer, request: SharedRequest) -> AnswerText:
    """The text view of a text model's answer to ``request``: its stop strings, the
    tokenizer's think markers, and the ``<think>`` its template opened, if it did."""
    opening = THINK_OPEN if opens_in_thought(tokenizer, request.tokens) else ""
    return AnswerText(request.sampling.stop, normalizer(tokenizer), opening)
