"""Aggregate generation tokens/s under concurrent clients: `mlx-cluster serve` against
mlx_lm.server's distributed path on the same model and mode, measured in the same run.

mlx_lm.server runs twice: its ranks started directly with the environment mlx.launch gives
them, and under `mlx.launch` itself, whose output relay loop busy-waits on a core (see
docs/benchmarks.md), which on a 2-core machine slows its ranks several times over.

    python -m tests.bench.serve_load --mode pipeline --clients 1,2,4,8 --max-tokens 64

Each level sends N simultaneous non-streaming /v1/completions requests (greedy, a model whose
EOS id set out of reach; the tokenizer's own EOS may still end an answer early, so the
tokens counted are the ones the servers report) and reports the generated
tokens of all answers over the wall time from the first request to the last answer. Both servers
get one warm-up request first. By default every request has a prompt of its own: mlx_lm.server
keeps a prompt cache and answers a prompt it has seen without a prefill, which `--prompts same`
shows (on this CPU a prefill costs as much per token as a decode step). The model is a
weights-dominated tiny qwen2 (qwen2 is a family mlx-lm can both pipeline and tensor-shard)
unless --model names one. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support.serving import BIN, free_port, start, stop, wait_up

PROMPT = "Tell me about lists and tuples in Python"


def complete(port: int, model: str, max_tokens: int, prompt: str = PROMPT) -> int:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    answer = json.loads(urllib.request.urlopen(req, timeout=600).read())
    return answer["usage"]["completion_tokens"]


def prompts(clients: int, first: int, distinct: bool) -> list[str]:
    """The level's prompts: the same one, or each opening with its own number, so that no
    server's prompt cache holds any of them (mlx_lm.server keeps one; ours does not)."""
    if not distinct:
        return [PROMPT] * clients
    return [f"Question {first + i}. {PROMPT}" for i in range(clients)]


def level(port: int, model: str, texts: list[str], max_tokens: int) -> dict:
    clients = len(texts)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = list(pool.map(lambda t: complete(port, model, max_tokens, t), texts))
    wall = time.perf_counter() - start
    return {"clients": clients, "tokens": sum(tokens), "wall_s": wall, "tok_s": sum(tokens) / wall}


def start_direct(argv: list[str], ranks: int, tmp: Path) -> list[subprocess.Popen]:
    """``argv`` on each rank of a ring on this machine, with the environment mlx.launch gives
    its ranks (MLX_RANK, MLX_HOSTFILE) but without mlx.launch, whose output relay busy-waits."""
    from cluster.core.hostfile import local_hostfile
    from cluster.job.backends import rank_envs
    from cluster.job.process import write_files

    return [
        start(argv, {**os.environ, **e.env, **write_files(e.files, tmp / f"rank{e.rank}")})
        for e in rank_envs(local_hostfile(ranks))
    ]


def measure(name: str, procs: list, port: int, model: str, args) -> list[dict]:
    print(name, file=sys.stderr)
    try:
        wait_up(port, procs[0])
        complete(port, model, 4, "Warm up.")
        rows, first = [], 0
        for n in args.clients:
            row = level(port, model, prompts(n, first, args.prompts == "distinct"), args.max_tokens)
            first += n
            print(
                f"  {n} client(s): {row['tokens']} tokens, {row['tok_s']:.1f} tok/s",
                file=sys.stderr,
            )
            rows.append(row)
        return rows
    finally:
        stop(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny qwen2 built here)")
    parser.add_argument("--mode", choices=["pipeline", "tensor"], default="pipeline")
    parser.add_argument("-n", "--ranks", type=int, default=2)
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--prompts",
        choices=["distinct", "same"],
        default="distinct",
        help="every request its own prompt (default), or all the same one, which "
        "mlx_lm.server's prompt cache answers without a prefill",
    )
    args = parser.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    tmp = None
    if args.model is None:
        from tests.support.tiny import make_model

        tmp = Path(tempfile.mkdtemp())
        args.model = str(
            make_model(
                tmp / "qwen2-load",
                "qwen2",
                seed=3,
                eos_token_id=100_000,
                hidden_size=512,
                intermediate_size=1536,
                num_hidden_layers=8,
                num_attention_heads=8,
                num_key_value_heads=8,
            )
        )
    name = Path(args.model).name
    direct_dir = Path(tempfile.mkdtemp())  # the direct ranks' MLX_HOSTFILE
    try:
        ports = [free_port() for _ in range(3)]
        ours = [str(BIN / "mlx-cluster"), "serve", "-n", str(args.ranks), "--mode", args.mode]
        ours += ["--model", args.model, "--port", str(ports[0])]

        def server(port):
            argv = [str(BIN / "mlx_lm.server"), "--model", args.model, "--port", str(port)]
            return argv + (["--pipeline"] if args.mode == "pipeline" else [])

        launch = [str(BIN / "mlx.launch"), "-n", str(args.ranks), "--backend", "ring", "--"]
        runs = [  # started one after the other, each alone on the machine
            ("mlx-cluster serve", lambda: [start(ours)], ports[0], name),
            (
                "mlx_lm.server (ranks started directly)",
                lambda: start_direct(server(ports[1]), args.ranks, direct_dir),
                ports[1],
                "default_model",
            ),
            (
                "mlx.launch ... mlx_lm.server",
                lambda: [start(launch + server(ports[2]))],
                ports[2],
                "default_model",
            ),
        ]
        results = [measure(label, begin(), port, model, args) for label, begin, port, model in runs]
    finally:
        shutil.rmtree(direct_dir, ignore_errors=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(
        "| clients | mlx-cluster serve tok/s | mlx_lm.server tok/s (direct) | ratio | "
        f"mlx.launch mlx_lm.server tok/s | ratio |  ({args.mode}, {args.ranks} ranks, "
        f"{args.max_tokens} tokens each, {args.prompts} prompts)"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for x, y, z in zip(*results, strict=True):
        print(
            f"| {x['clients']} | {x['tok_s']:.1f} | {y['tok_s']:.1f} | "
            f"{x['tok_s'] / y['tok_s']:.2f} | {z['tok_s']:.1f} | {x['tok_s'] / z['tok_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
