"""``status``: a running serve's overview in the terminal, from its /v1/cluster (what the
page at ``/`` shows), for people on SSH."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import click

DEFAULT_URL = "http://127.0.0.1:8080"


def fetch(url: str, key: str | None, timeout: float = 10.0) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/v1/cluster")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def micros(x: float) -> str:
    return f"{x:.0f} us" if x < 1000 else f"{x / 1000:.1f} ms"


def links_lines(links: dict | None) -> list[str]:
    """The links the ranks measured as they started, the slow ones marked, and what is wrong."""
    if not links:
        return []
    lines = ["", f"{'link':<9}  {'hosts':<32} {'round trip':>10} {'bandwidth':>13}  exact"]
    for x in links["links"]:
        hosts = f"{x['hosts'][0]} - {x['hosts'][1]}"
        name = f"link {x['a']}-{x['b']}"
        lines.append(f"{name:<9}  {hosts:<32} {micros(x['rtt_us']):>10} "
                     f"{x['gbps']:>8.2f} Gbit/s  {'yes' if x['exact'] else 'NO'}"
                     f"{'  SLOW' if x['slow'] else ''}")  # fmt: skip
    lines.append(f"all_sum: {micros(links['allsum_4b_us'])} at 4 B, "
                 f"{micros(links['allsum_8kb_us'])} at 8 KB")  # fmt: skip
    return lines + links["problems"]


def render(c: dict) -> str:
    """The overview as lines of text (the page's figures, in the same order)."""
    lines = [
        f"{c['model']}: {c['status']}, {c['mode']} mode, {c['ranks_up']} of {c['ranks']} ranks "
        f"up, {c['restarts']} restart(s)",
        f"requests: {c['in_flight']} running, {c['waiting']} waiting; first token "
        f"p50 {seconds(c['ttft_s']['p50'])}, p95 {seconds(c['ttft_s']['p95'])} "
        f"({c['answered']} answers in the last {c['window_s'] // 60} min)",
    ]
    recent = c["rates"][-6:]  # the last minute
    if recent:
        prefill = sum(b["prefill_tps"] for b in recent) / len(recent)
        decode = sum(b["decode_tps"] for b in recent) / len(recent)
        lines.append(f"last minute: prefill {prefill:.1f} tok/s, decode {decode:.1f} tok/s")
    groups = {g["group"]: g for g in c.get("groups", [])}  # a fleet (serve --replicas)
    for g in groups.values():
        lines.append(f"group {g['group']}: {g['status']}, {g['mode']} mode, {g['ranks_up']} of "
                     f"{g['ranks']} ranks up, {g['restarts']} restart(s); {g['streams']} "
                     f"streaming, {g['queued_prompt_tokens']} prompt tokens to prefill, "
                     f"{g['cached_prefixes']} cached prefixes, "
                     f"{g['answered']} answered")  # fmt: skip
    lines.append("")
    group = "group  " if groups else ""
    lines.append(f"{group}{'rank':>4}  {'host':<20} {'phase':<12} {'heartbeat':>9} {'peak':>9}  "
                 "holds")  # fmt: skip
    for host in c["hosts"]:
        mode, ranks = c["mode"], c["ranks"]
        group = ""
        if "group" in host and host["group"] in groups:
            mode, ranks = groups[host["group"]]["mode"], groups[host["group"]]["ranks"]
            group = f"{host['group']:>5}  "
        if host["left_out"]:
            lines.append(f"{group}{'-':>4}  {host['name']:<20} left out")
        for r in host["ranks"]:
            holds = "a share of every layer" if mode == "tensor" else (
                f"layers {r['layers'][0]}-{r['layers'][1] - 1}" if r["layers"]
                else "-" if ranks > 1 else "all layers"  # not loaded yet
            )  # fmt: skip
            peak = "-" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.2f} GB"
            lines.append(f"{group}{r['rank']:>4}  {host['name']:<20} {r['phase']:<12} "
                         f"{seconds(r['heartbeat_age_s']):>9} {peak:>9}  {holds}")  # fmt: skip
    lines += links_lines(c.get("links"))
    for p in c["prefilling"]:
        lines.append(f"prefilling {p['id'][:8]}: {p['done']} of {p['total']} tokens")
    for f in c["failures"]:
        after = f["back_after_s"]
        back = "not back yet" if after is None else f"back after {after:.1f} s"
        lines.append(f"failure: {f['message']} ({back})")
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--url", default=DEFAULT_URL, show_default=True, help="The serve to ask.")
@click.option("--api-key", envvar="MLX_CLUSTER_API_KEY", default=None,
              help="Its key, if it needs one (better: set MLX_CLUSTER_API_KEY).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print /v1/cluster's JSON as it is.")
def status(url: str, api_key: str | None, as_json: bool):
    """Show a running `mlx-cluster serve`: its hosts and ranks (phase, heartbeat, peak
    memory, layers), requests, rates, time to first token and restarts. The same figures as
    the page at the server's `/`. Exits 1 when the server does not answer."""
    try:
        overview = fetch(url, api_key)
    except urllib.error.HTTPError as e:
        why = f"HTTP {e.code}"
        if e.code == 401:
            why = "401: a wrong or missing API key (set MLX_CLUSTER_API_KEY)"
        click.echo(f"mlx-cluster: {url} answered {why}", err=True)
        sys.exit(1)
    except (OSError, ValueError) as e:
        click.echo(f"mlx-cluster: no serve answers at {url} ({e})", err=True)
        sys.exit(1)
    click.echo(json.dumps(overview, indent=2) if as_json else render(overview), nl=as_json)
