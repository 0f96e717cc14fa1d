"""``doctor --links`` on the ranks: every link the backend uses, measured through the backend.

Per link (ring: each rank and the next, the only pairs MLX's ring can send between; JACCL: every
pair) the two ranks ping-pong 4 bytes and 8 KB (round-trip latency, median and worst of
LINK_REPS), send 64 MB one way (bandwidth), and the receiver compares a known bit pattern
word for word (a link that corrupts data). Then the whole group: all_sum latency at 4 bytes
and 8 KB, and an exactness check of all_sum itself (integers whose sum is known exactly).
Every rank's rows are summed onto rank 0 with one all_sum, and rank 0 emits the report.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import cast

import mlx.core as mx

from cluster.core.backends import BACKENDS
from cluster.core.protocol import LinkReport
from node.rank.numbers import host_float, host_int

LINK_REPS = 30
SMALL, MEDIUM, LARGE = 4, 8192, 64 * 2**20  # bytes
AT_START = 8 * 2**20  # serve's measurement as its ranks start: one-way bytes (cheap, on by default)
FIELDS = ("rtt_4b_us", "rtt_4b_max_us", "rtt_8kb_us", "rtt_8kb_max_us", "gbps", "bad_words")


def pattern(nbytes: int, seed: int) -> mx.array:
    """Known random words, every bit pattern possible (uint32: no float NaN rules)."""
    shape = (max(1, nbytes // 4),)
    words = mx.random.randint(-(2**31), 2**31 - 1, shape, dtype=mx.int32, key=mx.random.key(seed))
    return words.view(mx.uint32)


def _round_trips(x: mx.array, peer: int, first: bool, group, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        if first:
            mx.eval(mx.distributed.send(x, peer, group=group))
            mx.eval(mx.distributed.recv_like(x, peer, group=group))
        else:
            y = mx.distributed.recv_like(x, peer, group=group)
            mx.eval(mx.distributed.send(y, peer, group=group))
        times.append(time.perf_counter() - tic)
    return times


def _one_way(peer: int, first: bool, group, seed: int, large: int) -> tuple[float, int]:
    """64 MB from ``first`` to its peer, which checks every word and answers with the count
    of wrong ones; (seconds until the answer, bad words), on the sender."""
    x = pattern(large, seed)
    mx.eval(x)
    ack = mx.zeros((1,), dtype=mx.uint32)
    if first:
        tic = time.perf_counter()
        mx.eval(mx.distributed.send(x, peer, group=group))
        bad = mx.distributed.recv_like(ack, peer, group=group)
        mx.eval(bad)
        return time.perf_counter() - tic, host_int(bad)
    got = mx.distributed.recv_like(x, peer, group=group)
    bad = mx.sum(got != x).astype(mx.uint32).reshape(1)
    mx.eval(mx.distributed.send(bad, peer, group=group))
    return 0.0, 0


def measure_link(a: int, b: int, group, large: int = LARGE) -> list[float] | None:
    """The FIELDS of link a-b on rank a; None elsewhere (rank b answers)."""
    rank = group.rank()
    if rank not in (a, b):
        return None
    first, peer = rank == a, b if rank == a else a
    row = []
    for size in (SMALL, MEDIUM):
        x = pattern(size, seed=a * 1000 + b)
        mx.eval(x)
        _round_trips(x, peer, first, group, 3)  # warm-up
        t = _round_trips(x, peer, first, group, LINK_REPS)
        row += [statistics.median(t) * 1e6, max(t) * 1e6]
    seconds, bad = _one_way(peer, first, group, a * 1000 + b + 1, large)
    row += [large * 8 / seconds / 1e9 if first else 0.0, float(bad)]
    return row if first else None


def allsum_checks(group) -> dict[str, float]:
    """all_sum's own latency (median of LINK_REPS) at 4 bytes and 8 KB, and its exactness:
    rank r adds (r + 1) * pattern; the sum must be n(n+1)/2 * pattern, bit for bit."""
    n, rank = group.size(), group.rank()
    out: dict[str, float] = {}
    for size, name in ((SMALL, "allsum_4b_us"), (MEDIUM, "allsum_8kb_us")):
        x = mx.ones((max(1, size // 4),), dtype=mx.float32)
        mx.eval(mx.distributed.all_sum(x, group=group))
        times = []
        for _ in range(LINK_REPS):
            tic = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            times.append(time.perf_counter() - tic)
        out[name] = statistics.median(times) * 1e6
    base = (pattern(MEDIUM * 16, seed=7).astype(mx.int32) % 1000).astype(mx.int32)
    total = mx.distributed.all_sum(base * (rank + 1), group=group)
    want = base * (n * (n + 1) // 2)
    out["allsum_bad_words"] = host_float(mx.sum(total != want))
    return out


def run_links(group, backend: str, emit: Callable, large: int = LARGE) -> None:
    """Measure every link of the backend, then all_sum; rank 0 emits the LinkReport. ``large``:
    the bytes sent one way per link (doctor: 64 MB; serve at start: AT_START)."""
    n, rank = group.size(), group.rank()
    pairs = BACKENDS[backend].link_pairs(n)
    rows = mx.zeros((len(pairs), len(FIELDS)), dtype=mx.float32)
    for k, (a, b) in enumerate(pairs):
        mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=group))  # one link at a time
        row = measure_link(a, b, group, large)
        if row is not None:
            rows[k] = mx.array(row, dtype=mx.float32)
    # each row is filled on one rank; no pairs (nccl): no empty collective either
    totals = mx.distributed.all_sum(rows, group=group) if pairs else rows
    mx.eval(totals)  # on every rank: a collective left lazy on one rank hangs the others
    checks = allsum_checks(group)
    if rank == 0:
        links = [
            {"a": a, "b": b, **dict(zip(FIELDS, map(float, r), strict=True))}
            for (a, b), r in zip(pairs, cast(list[list[float]], totals.tolist()), strict=True)
        ]
        emit(LinkReport(links=links, **checks, pattern_bytes=large))
