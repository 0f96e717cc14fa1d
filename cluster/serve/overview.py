"""/v1/cluster: what serve's page and `mlx-cluster status` show, from serve's own state.

One JSON object, built on serve's loop thread (``Service.overview``), so it never touches the
ranks: the hosts of the hostfile with the ranks on each (phase, heartbeat, peak memory, layers),
those left out, the failures, the requests running and waiting, and figures over the last
minutes from the answers that ended (prefill and decode tokens/s per 10 s, time to first token
p50 and p95).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

WINDOW_S = 300  # the figures' last minutes
BUCKET_S = 10


def overview(service, now: float) -> dict[str, Any]:
    health = service.describe()
    current = {h.index for h in service.hostfile.hosts}
    states = list(service.state.ranks) if service.state else []
    mono = time.monotonic()
    hosts = []
    for h in service.all_hosts:
        ranks = [s for s in states if s.host == h.target] if h.index in current else []
        hosts.append({
            "name": h.target,
            "address": (h.ips or [h.hostname])[0],
            "memory_gb": h.memory_gb,
            "left_out": h.index not in current,
            "ranks": [rank_of(s, mono) for s in ranks],
        })  # fmt: skip
    answers = [a for a in service.answers if now - a.at <= WINDOW_S]
    return {
        **{
            k: health[k]
            for k in (
                "status",
                "model",
                "mode",
                "ranks",
                "ranks_up",
                "waiting",
                "in_flight",
                "restarts",
                "prefilling",
                "dropped_after_failures",
            )
        },  # fmt: skip
        "hosts": hosts,
        "failures": [dataclasses.asdict(f) for f in service.failures],
        "window_s": WINDOW_S,
        "rates": rates(answers, now),
        "ttft_s": percentiles([a.ttft_s for a in answers if a.ttft_s is not None]),
        "answered": len(answers),
        "time": now,
    }


def rank_of(s, mono: float) -> dict[str, Any]:
    return {
        "rank": s.rank,
        "phase": s.phase if s.exit_code is None else f"exited {s.exit_code}",
        "heartbeat_age_s": round(mono - s.last_seen, 3) if s.last_seen else None,
        "peak_memory_gb": s.peak_memory_gb,
        "layers": s.layers,
        "load_s": s.load_s,
    }


def rates(answers: list, now: float) -> list[dict[str, float]]:
    """Prompt and generated tokens per second in each BUCKET_S of the window, oldest first
    (an answer counts in the bucket it ended in)."""
    n = WINDOW_S // BUCKET_S
    prefill, decode = [0.0] * n, [0.0] * n
    for a in answers:
        i = n - 1 - int((now - a.at) // BUCKET_S)
        if 0 <= i < n:
            prefill[i] += a.prompt_tokens
            decode[i] += a.completion_tokens
    return [
        {"ago_s": (n - i) * BUCKET_S, "prefill_tps": prefill[i] / BUCKET_S,
         "decode_tps": decode[i] / BUCKET_S}
        for i in range(n)
    ]  # fmt: skip


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None}
    if len(values) == 1:
        return {"p50": values[0], "p95": values[0]}
    q = statistics.quantiles(values, n=20, method="inclusive")
    return {"p50": statistics.median(values), "p95": q[18]}
