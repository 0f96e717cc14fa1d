"""`serve`'s /metrics in Prometheus' text format (prometheus_client, one registry per server).

Counters and histograms are updated as requests end; the per-rank gauges (peak memory,
heartbeat age) are read from the running job's state at each scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, ranks: Callable[[], list], groups: Callable[[], list] | None = None):
        """``ranks``: the running job's RankStates (empty while none runs). A fleet
        (cluster.serve.fleet) gives ``groups`` instead: each group's index, RankStates and
        Load; the per-rank gauges then carry a ``group`` label."""
        self.ranks = ranks
        self.groups = groups
        self.waiting_by_group: dict[int, int] = {}
        rank_labels = ["group", "rank", "host"] if groups else ["rank", "host"]
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "mlx_cluster_requests", "API requests by how they ended (HTTP status, or "
            "stream_error: a stream cut by a failure of the ranks)", ["status"], registry=r
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "mlx_cluster_prompt_tokens", "Prompt tokens of answered requests", registry=r
        )
        self.completion_tokens = Counter(
            "mlx_cluster_completion_tokens", "Generated tokens of answered requests", registry=r
        )
        self.ttft = Histogram(
            "mlx_cluster_time_to_first_token_seconds",
            "From the request's arrival to its first text",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.token_latency = Histogram(
            "mlx_cluster_time_per_output_token_seconds",
            "Time between two pieces of text of one answer",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.cache_tokens = Counter(
            "mlx_cluster_prompt_cache_tokens", "Prompt tokens taken from the prompt cache, by "
            "tier (memory: the ranks' kept caches; disk: each host's disk tier)", ["tier"],
            registry=r,
        )  # fmt: skip
        self.cache_lookups = Counter(
            "mlx_cluster_prompt_cache_lookups", "Answered requests by where their prompt's "
            "start came from (memory, disk, or miss: all prefilled)", ["result"], registry=r,
        )  # fmt: skip
        self.restarts = Counter(
            "mlx_cluster_restarts", "Restarts of the ranks after a failure", registry=r
        )
        self.queued = Gauge(
            "mlx_cluster_requests_waiting", "Requests waiting for the ranks", registry=r
        )
        self.peak_memory = Gauge(
            "mlx_cluster_rank_peak_memory_bytes", "Each rank's peak memory (MLX)",
            rank_labels, registry=r,
        )  # fmt: skip
        self.heartbeat_age = Gauge(
            "mlx_cluster_rank_heartbeat_age_seconds", "Since each rank was last heard from",
            rank_labels, registry=r,
        )  # fmt: skip
        self.disk_bytes = Gauge(
            "mlx_cluster_rank_disk_cache_bytes", "Bytes each rank's disk prompt cache has read "
            "and written since the ranks started", [*rank_labels, "direction"], registry=r,
        )  # fmt: skip
        self.handoff_held = Gauge(
            "mlx_cluster_rank_handoff_held_bytes", "Bytes of handed-off KV cache each decode "
            "rank's door holds (at most a quarter of what the rank had left once loaded)",
            rank_labels, registry=r,
        )  # fmt: skip
        if groups:
            self.group_ready = Gauge(
                "mlx_cluster_group_ready", "1 while the group's ranks serve", ["group"],
                registry=r,
            )  # fmt: skip
            self.group_tokens = Gauge(
                "mlx_cluster_group_queued_prompt_tokens", "Prompt tokens the group has still "
                "to prefill (estimated until rank 0 counts them)", ["group"], registry=r,
            )  # fmt: skip
            self.group_streams = Gauge(
                "mlx_cluster_group_streams", "Answers the group is streaming", ["group"],
                registry=r,
            )  # fmt: skip
            self.routed = Counter(
                "mlx_cluster_routed", "Requests sent to each group, by why (prefix: it held "
                "the longest cached prefix; session: the session's group; load: least work; "
                "round_robin; rerouted: its group failed)", ["group", "reason"], registry=r,
            )  # fmt: skip
            self.handoffs = Counter(
                "mlx_cluster_handoffs", "Prompts a prefill group prefilled and handed to a "
                "decode group (--prefill-groups)", ["group"], registry=r,
            )  # fmt: skip
            self.handoff_bytes = Counter(
                "mlx_cluster_handoff_bytes", "Bytes of KV cache the prefill groups sent",
                registry=r,
            )  # fmt: skip
        self.content_type = CONTENT_TYPE_LATEST

    def waiting(self, group: int, n: int) -> None:
        """Requests waiting for a group's ranks (the gauge: all groups')."""
        self.waiting_by_group[group] = n
        self.queued.set(sum(self.waiting_by_group.values()))

    def finished(self, status: int | str) -> None:
        self.requests.labels(status=str(status)).inc()

    def answered(self, usage: dict, timings: dict | None = None) -> None:
        self.finished(200)
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        self.completion_tokens.inc(usage.get("completion_tokens", 0))
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        disk = (timings or {}).get("cache_disk_n", 0)
        self.cache_tokens.labels(tier="memory").inc(cached - disk)
        self.cache_tokens.labels(tier="disk").inc(disk)
        result = "disk" if disk else "memory" if cached else "miss"
        self.cache_lookups.labels(result=result).inc()

    def exposition(self) -> bytes:
        self.peak_memory.clear()
        self.heartbeat_age.clear()
        self.disk_bytes.clear()
        self.handoff_held.clear()
        now = time.monotonic()
        ranks: list[tuple[dict, Any]] = [({}, s) for s in self.ranks()]
        if self.groups:
            ranks = []
            for g, states, ready, load in self.groups():
                ranks += [({"group": str(g)}, s) for s in states]
                self.group_ready.labels(group=str(g)).set(1 if ready else 0)
                self.group_tokens.labels(group=str(g)).set(load.prompt_tokens)
                self.group_streams.labels(group=str(g)).set(load.streams)
        for group, s in ranks:
            labels = {**group, "rank": str(s.rank), "host": s.host}
            if s.peak_memory_gb is not None:
                self.peak_memory.labels(**labels).set(s.peak_memory_gb * 1e9)
            if s.disk_bytes is not None:
                for direction, n in zip(("read", "written"), s.disk_bytes, strict=True):
                    self.disk_bytes.labels(**labels, direction=direction).set(n)
            if s.handoff_bytes is not None:
                self.handoff_held.labels(**labels).set(s.handoff_bytes)
            if s.exit_code is None and s.last_seen:
                self.heartbeat_age.labels(**labels).set(round(now - s.last_seen, 3))
        return generate_latest(self.registry)
