"""Pipeline prefill against one rank: how much the stages overlap, per prefill step and N.

In pipeline mode a stage sends a prefill step's activations on and starts the next step while
the stage after it works on the one sent (node/model/stage.py ties the send to the cache). With k
steps over N stages the ideal is (k + N - 1) / (k N) of one rank's time: more, smaller steps
overlap better, and each step costs a little (a round trip on a link; a GPU wants big steps).

    python -m tests.bench.prefill_overlap --prompt-tokens 9123 --ranks 2,3 --steps 256,512,1024,2048

Each cell is one `mlx-cluster launch --json` (the prompt on stdin, 4 tokens greedy); its time is
rank 0's prompt_ms (first token after the prompt). With ``--serve``, each cell is a fresh
`mlx-cluster serve` answering the prompt alone (after a short warm-up request), timed by the
client: serve's batched prefill is another code path. Every rank gets one BLAS thread
(OPENBLAS_NUM_THREADS=1), as a host of its own would have its own cores; the baseline, one
rank on one thread, runs in the same run. This machine has 2 cores: at 3 ranks two stages
share a core, so 3-rank cells are bounded by 0.5, not 1/3.

With ``--hostfile`` (e.g. tests/support/netrig.py's rig: hosts of their own with a shaped link), the
sharded cells run on its first N hosts, in each of ``--modes``; in tensor mode each prefill
step's all_sums move step x hidden values per layer, so the step trades messages for size.

    python -m tests.support.netrig up 2 --rtt 300us --rate 10gbit > /tmp/rig.yaml
    python -m tests.bench.prefill_overlap --hostfile /tmp/rig.yaml --ranks 2 --modes pipeline,tensor
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from tests.support.long_context import long_text
from tests.support.reference import CLI, ONE_THREAD
from tests.support.serving import fresh_serve, llama_576, post


def launched(model: Path, prompt: str, ranks: int, step: int | None, mode: str = "pipeline",
             hostfile: Path | None = None, max_tokens: int = 4) -> dict:  # fmt: skip
    """One launch: rank 0's prompt time (s) and the text."""
    where = ["-n", str(ranks)] if hostfile is None or ranks == 1 else ["--hostfile", str(hostfile)]
    argv = [CLI, "launch", *where, "--mode", mode, "--model", str(model),
            "--max-tokens", str(max_tokens), "--json"]  # fmt: skip
    if step is not None:
        argv += ["--prefill-step", str(step)]
    p = subprocess.run(argv, input=prompt, capture_output=True, text=True, env=ONE_THREAD)
    if p.returncode != 0:
        raise RuntimeError(f"{argv}: exit {p.returncode}: {p.stderr[-500:]}")
    answer = json.loads(p.stdout)
    t = answer["timings"]
    return {"seconds": t["prompt_ms"] / 1000, "tokens": t["prompt_n"], "text": answer["text"]}


def served(model: Path, prompt: str, ranks: int, step: int | None, mode: str = "pipeline",
           hostfile: Path | None = None, max_tokens: int = 4) -> dict:  # fmt: skip
    """One fresh serve: the seconds to answer ``prompt`` alone, and the text."""
    flags = [] if step is None else ["--prefill-step", str(step)]
    with fresh_serve(model, mode, ranks, *flags) as port:
        body = {"model": model.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        start = time.perf_counter()
        answer = json.loads(post(port, "/v1/completions", body).read())
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": answer["usage"]["prompt_tokens"],
            "text": answer["choices"][0]["text"]}  # fmt: skip


def ideal(tokens: int, step: int, ranks: int) -> float:
    k = -(-tokens // step)
    return (k + ranks - 1) / (k * ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: tests/bench/stall.py's llama)")
    parser.add_argument("--prompt-tokens", type=int, default=9123)
    parser.add_argument("--ranks", default="2,3")
    parser.add_argument("--steps", default="256,512,1024,2048")
    parser.add_argument("--default", action="store_true", help="also the default step")
    parser.add_argument("--serve", action="store_true", help="through serve, not launch")
    parser.add_argument("--modes", default="pipeline")
    parser.add_argument("--hostfile", type=Path, help="sharded cells on these hosts (launch)")
    args = parser.parse_args()
    model = Path(args.model) if args.model else llama_576(Path(tempfile.mkdtemp()))
    prompt = long_text(model, args.prompt_tokens)
    prefill = served if args.serve else launched
    base = prefill(model, prompt, 1, None)
    print(f"one rank, one thread, default step: {base['seconds']:.1f} s for "
          f"{base['tokens']} tokens", flush=True)  # fmt: skip
    print("| mode | ranks | prefill step | prompt s | x one rank | ideal | same text |")
    print("|---|---|---|---|---|---|---|")
    steps: list[int | None] = [int(s) for s in args.steps.split(",") if s]
    for mode in args.modes.split(","):
        for n in (int(r) for r in args.ranks.split(",")):
            for step in [*steps, *([None] if args.default else [])]:
                if args.hostfile:
                    hosts = yaml.safe_load(args.hostfile.read_text())
                    hosts["hosts"] = hosts["hosts"][:n]
                    held = Path(tempfile.mkdtemp()) / "hosts.yaml"
                    held.write_text(yaml.safe_dump(hosts))
                    r = prefill(model, prompt, n, step, mode, held)
                else:
                    r = prefill(model, prompt, n, step, mode)
                shown = "default" if step is None else str(step)
                overlap = step is not None and mode == "pipeline"
                best = f"{ideal(r['tokens'], step, n):.2f}" if overlap else "-"
                ratio = r["seconds"] / base["seconds"]
                print(f"| {mode} | {n} | {shown} | {r['seconds']:.1f} | {ratio:.2f} | {best} | "
                      f"{r['text'] == base['text']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
