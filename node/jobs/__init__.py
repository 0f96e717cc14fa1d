"""What a rank does for a command: launch's one answer (oneshot), chat, serve (with its batch),
bench (the prompt cache they share lives in node.cache)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.core.spec import JobSpec


@dataclass
class Job:
    """What a rank's job works with, the same fields on every rank (``write`` is rank 0's)."""

    spec: JobSpec
    group: Any  # mx.distributed.Group
    loaded: Any  # node.model.load.Loaded
    emit: Callable  # an event to the launcher (cluster.core.protocol)
    log: Callable[[str], None]  # a log line (the launcher shows it with --verbose)
    write: Callable[[str], None] | None  # rank 0: the answer's text to stdout; else None
    disk: Any = None  # node.cache.disk.DiskCache: the prompt cache's disk tier, or None

    @property
    def rank0(self) -> bool:
        return self.group.rank() == 0
