"""A fleet against one group: agent-shaped sessions on `serve -n 1` and on `serve -n 2
--replicas 2` (routed by prefix, and round-robin), alternated in one sitting.

    python -m tests.bench.fleet_load --sessions 16 --turns 3 --repeat 3

Each session is an agent's conversation: a system prompt every session shares (about
``--system-tokens`` tokens), then its own turns, each sending the whole history so far (its
earlier questions and the answers it got) plus a new question; the sessions start together and
each sends its next turn as soon as its answer is complete (streamed, greedy, ``--max-tokens``
each, the model's EOS out of reach). Reported per server, as the median [min-max] of the
alternated runs: aggregate generated tokens/s (all answers' tokens over the run's wall time),
the share of later turns' prompt tokens the server read from its prompt cache (usage's
cached_tokens), time to first token p50 and p99. Every server's ranks get one OpenBLAS thread
(OPENBLAS_NUM_THREADS=1): on this 2-core machine one rank alone uses one core, two groups two.
The model is serve_load's weights-dominated tiny qwen2 unless --model names one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from tests.support.serving import BIN, free_port, start, stop, wait_up


def servers(hostfile: str | None, mode: str) -> dict[str, list[str]]:
    """The baseline first: one rank alone (or the hostfile's hosts as one group), then the
    same ranks (two ranks here, or the hostfile's) as two replicas, routed two ways."""
    if hostfile is None:
        one, two = ["-n", "1"], ["-n", "2"]
    else:
        one = two = ["--hostfile", hostfile, "--mode", mode]
    return {
        "one rank" if hostfile is None else f"one {mode} group of all hosts": one,
        "2 replicas, prefix": [*two, "--replicas", "2", "--routing", "prefix"],
        "2 replicas, round-robin": [*two, "--replicas", "2", "--routing", "round-robin"],
    }


WORDS = "the agent reads the repository and plans each change before it edits a file".split()


def system_prompt(model: str, tokens: int) -> str:
    """Text of about ``tokens`` tokens of the model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    text, i = "", 0
    while len(tokenizer.encode(text)) < tokens:
        text += " ".join(WORDS[(i + k) % len(WORDS)] for k in range(50)) + f" (rule {i}).\n"
        i += 1
    return text


def session(client, model: str, system: str, n: int, turns: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": system}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Session {n}, step {t}: what next?"})
        began = time.perf_counter()
        first, text, usage = None, [], None
        for chunk in client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ):  # fmt: skip
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and first is not None
        details = usage.prompt_tokens_details
        out.append({
            "turn": t,
            "ttft": first - began,
            "prompt": usage.prompt_tokens,
            "cached": details.cached_tokens if details else 0,
            "tokens": usage.completion_tokens,
        })  # fmt: skip
        messages.append({"role": "assistant", "content": "".join(text)})
    return out


def run(name: str, flags: list[str], args, system: str) -> dict:
    port = free_port()
    argv = [str(BIN / "mlx-cluster"), "serve", "--model", args.model, "--port", str(port),
            "--no-measure-links", *flags, *args.serve_flags.split()]  # fmt: skip
    procs = [start(argv, {**os.environ, "OPENBLAS_NUM_THREADS": "1"})]
    try:
        wait_up(port, procs[0])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=900)
        model = Path(args.model).name
        wait_groups(port, 2 if "--replicas" in flags else 1)
        client.chat.completions.create(  # warm-up, with nothing the sessions send
            model=model, messages=[{"role": "user", "content": "warm up"}], max_tokens=4
        )
        ranks = rank_pids(procs[0].pid)
        cpu = [cpu_s(procs[0].pid), sum(cpu_s(p) for p in ranks), client_cpu_s()]
        began = time.perf_counter()
        with ThreadPoolExecutor(args.sessions) as pool:
            turns = [
                t for s in pool.map(
                    lambda n: session(client, model, system, n, args.turns, args.max_tokens),
                    range(args.sessions),
                )
                for t in s
            ]  # fmt: skip
        wall = time.perf_counter() - began
        after = [cpu_s(procs[0].pid), sum(cpu_s(p) for p in ranks), client_cpu_s()]
        cpu = [b - a for a, b in zip(cpu, after, strict=True)]
    finally:
        stop(procs)
    later = [t for t in turns if t["turn"] > 0]
    ttfts = sorted(t["ttft"] for t in turns)
    row = {
        "tok_s": sum(t["tokens"] for t in turns) / wall,
        "cached": sum(t["cached"] for t in later) / max(1, sum(t["prompt"] for t in later)),
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
        "wall_s": wall,
        "cpu": cpu,  # seconds: the launcher (HTTP, routing), the ranks, this client
    }
    print(f"  {name}: {row['tok_s']:.1f} tok/s, later turns {row['cached']:.0%} cached, "
          f"TTFT p50 {row['ttft_p50']:.2f} s p99 {row['ttft_p99']:.2f} s, {wall:.1f} s; CPU s: "
          f"launcher {cpu[0]:.1f}, ranks {cpu[1]:.1f}, client {cpu[2]:.1f}",
          file=sys.stderr)  # fmt: skip
    return row


def cpu_s(pid: int) -> float:
    """A process's own CPU seconds (user + system), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rank_pids(root: int) -> list[int]:
    from tests.support.processes import _children, _cmdline, descendant_ranks

    return descendant_ranks(root, _children(), _cmdline)


def client_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def wait_groups(port: int, groups: int) -> None:
    import json
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())
        except urllib.error.HTTPError as e:  # 503 while not every group serves
            health = json.loads(e.read())
        if health.get("groups_ready", 1 if health["status"] == "ok" else 0) >= groups:
            return
        time.sleep(0.2)
    raise RuntimeError("the groups did not get ready")


def spread(values: list[float], fmt: str) -> str:
    return (f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-"
            f"{max(values):{fmt}}]")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny qwen2 built here)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hostfile", help="a rig's hosts (default: ranks on this machine)")
    parser.add_argument("--mode", default="tensor", help="with --hostfile: every group's mode")
    parser.add_argument("--serve-flags", default="", help="more flags for every serve")
    parser.add_argument("--hidden-size", type=int, default=512, help="of the model built here")
    parser.add_argument("--layers", type=int, default=8, help="of the model built here")
    args = parser.parse_args()
    tmp = None
    if args.model is None:
        from tests.support.tiny import make_model

        tmp = Path(tempfile.mkdtemp())
        args.model = str(make_model(
            tmp / "qwen2-fleet", "qwen2", seed=3, chat_template=True, eos_token_id=100_000,
            hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
            num_hidden_layers=args.layers,
            num_attention_heads=8, num_key_value_heads=8,
        ))  # fmt: skip
    try:
        system = system_prompt(args.model, args.system_tokens)
        runs = servers(args.hostfile, args.mode)
        results: dict[str, list[dict]] = {name: [] for name in runs}
        for r in range(args.repeat):  # alternated: each server once per round
            print(f"round {r + 1} of {args.repeat}", file=sys.stderr)
            for name, flags in runs.items():
                results[name].append(run(name, flags, args, system))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(x["tok_s"] for x in next(iter(results.values())))
    print(f"| server ({args.sessions} sessions x {args.turns} turns, ~{args.system_tokens}-token "
          f"shared system prompt, {args.max_tokens} tokens each; median [min-max] of "
          f"{args.repeat} alternated runs) | tok/s | vs the first | later turns' prompt "
          "cached | TTFT p50 (s) | TTFT p99 (s) | CPU s: launcher / ranks / client "
          "| wall s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, rows in results.items():
        tok = [x["tok_s"] for x in rows]
        print(
            f"| {name} | {spread(tok, '.1f')} | "
            f"{spread([t / base for t in tok], '.2f')} | "
            f"{spread([x['cached'] for x in rows], '.2f')} | "
            f"{spread([x['ttft_p50'] for x in rows], '.2f')} | "
            f"{spread([x['ttft_p99'] for x in rows], '.2f')} | "
            f"{spread([x['cpu'][0] for x in rows], '.1f')} / "
            f"{spread([x['cpu'][1] for x in rows], '.1f')} / "
            f"{spread([x['cpu'][2] for x in rows], '.1f')} | "
            f"{spread([x['wall_s'] for x in rows], '.1f')} |"
        )


if __name__ == "__main__":
    main()
