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

from cluster.core.links import problems_by_link

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
        "links": links_of(service.links),
        "failures": [dataclasses.asdict(f) for f in service.failures],
        "window_s": WINDOW_S,
        "rates": rates(answers, now),
        "ttft_s": percentiles([a.ttft_s for a in answers if a.ttft_s is not None]),
        "handoffs": handoffs(answers),
        "answered": len(answers),
        "time": now,
    }


def links_of(measured) -> dict[str, Any] | None:
    """Each link the ranks use (doctor --links' figures), with the problems doctor would name;
    ``slow`` marks the links a problem names. None until the ranks have measured them."""
    if measured is None:
        return None
    r = measured.report
    problems = problems_by_link(r, measured.hosts)
    named = {pair for pair, _ in problems}
    return {
        "measured_at": measured.at,
        "links": [
            {
                "a": x["a"],
                "b": x["b"],
                "hosts": [measured.hosts[x["a"]], measured.hosts[x["b"]]],
                "rtt_us": x["rtt_4b_us"],
                "rtt_8kb_us": x["rtt_8kb_us"],
                "worst_rtt_us": max(x["rtt_4b_max_us"], x["rtt_8kb_max_us"]),
                "gbps": x["gbps"],
                "exact": not x["bad_words"],
                "slow": (x["a"], x["b"]) in named,
            }
            for x in r.links
        ],
        "allsum_4b_us": r.allsum_4b_us,
        "allsum_8kb_us": r.allsum_8kb_us,
        "allsum_exact": not r.allsum_bad_words,
        "problems": [text for _, text in problems],
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


def handoffs(answers: list) -> dict[str, float | int | None]:
    """The window's answers whose prompt a prefill group prefilled (issue 53): how many, the
    bytes of KV cache sent, and the median time from a handoff's first frame to its adoption."""
    handed = [a for a in answers if a.handoff_s is not None]
    seconds = [a.handoff_s for a in handed]
    return {"count": len(handed), "bytes": sum(a.handoff_bytes for a in handed),
            "p50_s": statistics.median(seconds) if seconds else None}  # fmt: skip


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None}
    if len(values) == 1:
        return {"p50": values[0], "p95": values[0]}
    q = statistics.quantiles(values, n=20, method="inclusive")
    return {"p50": statistics.median(values), "p95": q[18]}
