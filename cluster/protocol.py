"""What a rank tells the launcher besides its text: one JSON event per stderr line.

Rank 0's stdout carries only the generated text; progress and stats travel as events on stderr so
the launcher can follow the phases (loading, ready, done) without parsing log prose.
"""

from __future__ import annotations

import json
from typing import Any

EVENT_PREFIX = "\x1emlx-cluster "
CANCEL = b"\x03"  # launcher -> rank 0's stdin: Ctrl-C in chat, end the current answer
# launcher -> rank 0's stdin: no more input, finish and quit. Chat: our stdin reached EOF (the
# pipe stays open, so a later Ctrl-C's CANCEL still arrives); serve: SIGINT/SIGTERM, drain.
END_OF_INPUT = b"\x04"


def encode_event(kind: str, **fields: Any) -> str:
    return EVENT_PREFIX + json.dumps({"event": kind, **fields}) + "\n"


def decode_event(line: str) -> dict[str, Any] | None:
    """The event of a stderr line, or None for an ordinary log line."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        event = json.loads(line[len(EVENT_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "event" in event else None
