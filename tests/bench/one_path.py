"""serve without --replicas before and after it went through the fleet path (issue 62): the
same model served by two checkouts, alternated: start-up (to the first answer), the CPU the
launcher and the ranks spend idle, and aggregate tokens/s of concurrent clients.

    python -m tests.bench.one_path --before /tmp/before-tree --rounds 3

``--before`` is a checkout of the commit to compare with (``git worktree add``); this
checkout is "after". Each serve: 2 ranks, pipeline, one BLAS thread per rank, the
llama-shaped model of the long-prompt measurements, 8 clients of 64 greedy tokens each, a
prompt of their own. Prints a markdown table (medians, ranges).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support.processes import cpu_seconds, ranks_below
from tests.support.serving import free_port, llama_576, post, stop

ROOT = Path(__file__).resolve().parents[2]


def serve(tree: Path, model: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-c", "from cluster.commands import main; main()", "serve", "-n",
            "2", "--model", str(model), "--port", str(port)]  # fmt: skip
    return subprocess.Popen(argv, cwd=tree, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip


def answered(port: int, model: str, prompt: str, tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    with post(port, "/v1/completions", body) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def one(tree: Path, model: Path, clients: int, tokens: int, idle: float) -> dict:
    port = free_port()
    began = time.monotonic()
    proc = serve(tree, model, port)
    try:
        while True:
            try:
                answered(port, model.name, "Warm up.", 2)
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve of {tree} exited with {proc.returncode}") from None
                time.sleep(0.2)
        startup = time.monotonic() - began
        pids = [proc.pid, *ranks_below(proc.pid, 2)]
        before = cpu_seconds(pids)
        time.sleep(idle)  # the measurement: nothing is asked meanwhile
        idle_cpu = cpu_seconds(pids) - before
        t = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            n = sum(pool.map(lambda i: answered(port, model.name, f"Story {i}: once", tokens),
                             range(clients)))  # fmt: skip
        return {"startup_s": startup, "idle_cpu_s": idle_cpu,
                "tok_s": n / (time.monotonic() - t)}  # fmt: skip
    finally:
        stop([proc])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--idle", type=float, default=10.0)
    args = ap.parse_args()
    model = llama_576(Path(tempfile.mkdtemp()))
    trees = {"before": args.before.resolve(), "after": ROOT}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for name in list(trees) if r % 2 == 0 else list(reversed(trees)):
            runs[name].append(one(trees[name], model, args.clients, args.tokens, args.idle))
            print(name, json.dumps(runs[name][-1]), file=sys.stderr, flush=True)
    print("| tree | start-up s | idle CPU s / 10 s (launcher + ranks) | tok/s, 8 clients |")
    print("|---|---|---|---|")
    for name, got in runs.items():
        cells = []
        for key in ("startup_s", "idle_cpu_s", "tok_s"):
            values = [g[key] for g in got]
            cells.append(f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
