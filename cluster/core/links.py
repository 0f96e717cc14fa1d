"""What makes a link worth naming: the judgement on ``doctor --links``' figures (node/rank/links.py
measures them), shared by doctor's table and serve's page."""

from __future__ import annotations

from cluster.core.protocol import LinkReport

SLOW_FACTOR = 3.0  # round trip this many times the best link's (and 100 us more), or bandwidth
LOSSY_FACTOR, LOSSY_MIN_US = 20.0, 50_000.0  # a worst round trip this far over the median:
# TCP's retransmission timeouts (at least 200 ms on Linux) show a link that drops packets

Problem = tuple[tuple[int, int] | None, str]  # the link (a, b), None for all_sum; what to say


def round_trip(link: dict) -> float:
    """A link's round trip in us: the lower of its 4-byte and 8 KB medians. 8 KB never
    crosses a link faster than 4 bytes, so a 4-byte median above the 8 KB one was a burst of
    something else on a rank's host (another process's turn on its core), not the link."""
    return min(link["rtt_4b_us"], link["rtt_8kb_us"])


def link_problems(report: LinkReport, labels: list[str]) -> list[str]:
    """A corrupting, lossy or slow link named by its two ranks and hosts, with what to do."""
    return [text for _, text in problems_by_link(report, labels)]


def problems_by_link(report: LinkReport, labels: list[str]) -> list[Problem]:
    """link_problems, each with the link it names."""
    problems: list[Problem] = []
    links = report.links
    best_rtt = min((round_trip(x) for x in links), default=0.0)
    best_gbps = max((x["gbps"] for x in links), default=0.0)
    for x in links:
        pair = (x["a"], x["b"])
        name = f"link rank {x['a']} ({labels[x['a']]}) - rank {x['b']} ({labels[x['b']]})"
        if x["bad_words"]:
            problems.append(
                (
                    pair,
                    f"{name}: {x['bad_words']:.0f} words of a "
                    f"{report.pattern_bytes / 2**20:.0f} MB pattern arrived changed: the "
                    "link corrupts data; reseat or replace the cable, and update macOS (JACCL had "
                    "such bugs, ml-explore/mlx#3152)",
                )
            )
        worst = max(x["rtt_4b_max_us"], x["rtt_8kb_max_us"])
        if worst > LOSSY_FACTOR * x["rtt_8kb_us"] and worst > LOSSY_MIN_US:
            problems.append(
                (
                    pair,
                    f"{name}: a round trip took {worst / 1000:.0f} ms against a median of "
                    f"{x['rtt_8kb_us'] / 1000:.2f} ms: the link drops packets (retransmissions); "
                    "check the cable, or move the job off a Wi-Fi or shared link",
                )
            )
        rtt = round_trip(x)
        if len(links) > 1 and rtt > SLOW_FACTOR * best_rtt and rtt - best_rtt > 100:
            problems.append(
                (
                    pair,
                    f"{name}: round trip {rtt:.0f} us, {rtt / best_rtt:.1f}x "
                    "the best link's: every collective waits for it; check that its ips are the "
                    "Thunderbolt addresses, not the LAN",
                )
            )
        elif len(links) > 1 and x["gbps"] * SLOW_FACTOR < best_gbps:
            problems.append(
                (
                    pair,
                    f"{name}: {x['gbps']:.2f} Gbit/s, under a third of the best link's "
                    f"{best_gbps:.2f}: prefill and loading wait for it; check the cable and port",
                )
            )
    if report.allsum_bad_words:
        problems.append(
            (
                None,
                f"all_sum over every rank returned {report.allsum_bad_words:.0f} wrong words: the "
                "backend corrupts sums; update MLX and macOS on every host",
            )
        )
    return problems
