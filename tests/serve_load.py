"""Aggregate generation tokens/s under concurrent clients: `mlx-cluster serve` against
`mlx.launch ... mlx_lm.server` on the same model and mode, measured in the same run.

    python tests/serve_load.py --mode pipeline --clients 1,2,4,8 --max-tokens 64

Each level sends N simultaneous non-streaming /v1/completions requests (greedy, a model whose
EOS id set out of reach; the tokenizer's own EOS may still end an answer early, so the
tokens counted are the ones the servers report) and reports the generated
tokens of all answers over the wall time from the first request to the last answer. Both servers
get one warm-up request first. The model is a weights-dominated tiny qwen2 (qwen2 is a family
mlx-lm can both pipeline and tensor-shard) unless --model names one. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BIN = Path(sys.executable).parent
PROMPT = "Tell me about lists and tuples in Python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("server not up in time")


def complete(port: int, model: str, max_tokens: int) -> int:
    body = json.dumps(
        {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    answer = json.loads(urllib.request.urlopen(req, timeout=600).read())
    return answer["usage"]["completion_tokens"]


def level(port: int, model: str, clients: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = list(pool.map(lambda _: complete(port, model, max_tokens), range(clients)))
    wall = time.perf_counter() - start
    return {"clients": clients, "tokens": sum(tokens), "wall_s": wall, "tok_s": sum(tokens) / wall}


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the whole process group, SIGKILL what is left after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def measure(name: str, argv: list[str], port: int, model: str, args) -> list[dict]:
    print(f"{name}: {' '.join(argv)}", file=sys.stderr)
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_up(port, proc)
        complete(port, model, 4)  # warm-up
        rows = []
        for n in args.clients:
            row = level(port, model, n, args.max_tokens)
            print(
                f"  {n} client(s): {row['tokens']} tokens, {row['tok_s']:.1f} tok/s",
                file=sys.stderr,
            )
            rows.append(row)
        return rows
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny qwen2 built here)")
    parser.add_argument("--mode", choices=["pipeline", "tensor"], default="pipeline")
    parser.add_argument("-n", "--ranks", type=int, default=2)
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    tmp = None
    if args.model is None:
        sys.path.insert(0, str(Path(__file__).parent))
        from tiny import make_model

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
    try:
        ours_port, theirs_port = free_port(), free_port()
        ours = [str(BIN / "mlx-cluster"), "serve", "-n", str(args.ranks), "--mode", args.mode]
        ours += ["--model", args.model, "--port", str(ours_port)]
        theirs = [str(BIN / "mlx.launch"), "-n", str(args.ranks), "--backend", "ring", "--"]
        theirs += [str(BIN / "mlx_lm.server"), "--model", args.model, "--port", str(theirs_port)]
        theirs += ["--pipeline"] if args.mode == "pipeline" else []
        a = measure("mlx-cluster serve", ours, ours_port, name, args)
        b = measure("mlx_lm.server", theirs, theirs_port, "default_model", args)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"| clients | mlx-cluster serve tok/s | mlx_lm.server tok/s | ratio |  ({args.mode}, "
        f"{args.ranks} ranks, {args.max_tokens} tokens each)"
    )
    print("|---:|---:|---:|---:|")
    for x, y in zip(a, b, strict=True):
        print(
            f"| {x['clients']} | {x['tok_s']:.1f} | {y['tok_s']:.1f} | "
            f"{x['tok_s'] / y['tok_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
