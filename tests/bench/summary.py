"""The sitting behind docs/benchmarks.md's opening table: what a second rank gives against one
rank and against mlx-lm, per question, every figure a median [min-max] of runs alternated in
one sitting (the method's rule for ratios).

    python -m tests.bench.summary --rounds 3 > summary.md

Questions: one stream (a 128-token prompt, 64 tokens decoded), many streams (32 prompts of 64
tokens decoded together, 64 tokens each), a long prompt (4,096 tokens: prefill tok/s), an idle
server (CPU seconds per rank over --idle seconds after an answer). Each round runs every
configuration once, in an order rotated from round to round: `mlx-cluster bench --repeat 1`
at 1 rank, pipeline 2 and tensor 2, each with mlx-lm's own run of the same mode and rank
count in the same job (`--baselines mlx-lm`); for idle, `serve` in each mode and
`mlx_lm.server`'s ranks started directly. Every rank has one BLAS thread, so one rank has one
of this machine's 2 cores and two ranks have both, as a second Mac brings its own compute.
The model: llama-shaped, hidden 576, 8 layers, 8 query and 4 KV heads (they divide over 2
ranks, as real models' 64 and 8 do), float32, made here. Prints markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.bench.idle import idle_cpu
from tests.support.processes import ranks_below
from tests.support.serving import BIN, free_port, fresh_serve, post, stop, wait_up

QUESTIONS = {  # name: (prompt tokens, generated tokens, streams, the figure read)
    "one stream": (128, 64, 1, "generation_tps"),
    "32 streams": (64, 64, 32, "generation_tps"),
    "long prompt": (4096, 2, 1, "prefill_tps"),
}
CONFIGS = {
    "1 rank": ("1", "pipeline"),
    "pipeline 2": ("2", "pipeline"),
    "tensor 2": ("2", "tensor"),
}


def make_model(base: Path) -> Path:
    from tests.support.tiny import make_model as tiny

    return tiny(base / "llama-576-h8", "llama", seed=3, eos_token_id=100_000, hidden_size=576,
                intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=65536)  # fmt: skip


def bench_once(model: Path, question: str, config: str, out: Path) -> dict[str, float | str]:
    """One `bench` job: our row and mlx-lm's of this configuration -> {impl: figure or why}."""
    prompt, gen, streams, figure = QUESTIONS[question]
    ranks, mode = CONFIGS[config]
    argv = [str(BIN / "mlx-cluster"), "bench", "--model", str(model), "--ranks", ranks,
            "--modes", mode, "--prompt-tokens", str(prompt), "--gen-tokens", str(gen),
            "--concurrency", str(streams), "--repeat", "1",
            "--warmup", "0" if question == "long prompt" else "1",
            "--baselines", "mlx-lm", "--json", str(out)]  # fmt: skip
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {p.stderr[-800:]}")
    rows = {}
    for r in json.loads(out.read_text())["results"]:
        if r["ranks"] != int(ranks) or r["draft"]:
            continue
        value = r[figure]["median"] if r["status"] == "ok" else r["status"]
        rows[r["impl"]] = value
    return rows


def idle_once(model: Path, server: str, seconds: float, tmp: Path) -> list[float]:
    """CPU seconds of each of 2 ranks over ``seconds`` after one answer."""
    if server in ("pipeline", "tensor"):
        with fresh_serve(model, server, 2) as _port:
            pids = ranks_below(os.getpid(), 2)
            return idle_cpu(pids, seconds)
    from tests.bench.serve_load import start_direct

    port = free_port()
    argv = [str(BIN / "mlx_lm.server"), "--model", str(model), "--port", str(port)]
    procs = start_direct(argv, 2, tmp)
    try:
        wait_up(port, procs[0])
        post(port, "/v1/completions", {"model": "default_model", "prompt": "Warm up.",
                                       "max_tokens": 2})  # fmt: skip
        return idle_cpu([p.pid for p in procs], seconds)
    finally:
        stop(procs)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def ratio(ours: list[float], base: list[float]) -> str:
    """median / median, and 'level' where the two ranges overlap (the method's rule)."""
    r = statistics.median(ours) / statistics.median(base)
    overlap = min(ours) <= max(base) and min(base) <= max(ours)
    return f"{r:.2f}x" + (" (level)" if overlap else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", default=",".join([*QUESTIONS, "idle"]))
    parser.add_argument("--idle", type=float, default=10.0, help="idle window (s)")
    parser.add_argument("--model", type=Path, help="default: made in a temporary folder")
    args = parser.parse_args()
    asked = args.questions.split(",")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = args.model or make_model(tmp)
        figures: dict[tuple[str, str, str], list] = {}
        for r in range(args.rounds):
            for question in [q for q in QUESTIONS if q in asked]:
                order = list(CONFIGS)[r % 3 :] + list(CONFIGS)[: r % 3]
                for config in order:
                    rows = bench_once(model, question, config, tmp / "bench.json")
                    for impl, value in rows.items():
                        figures.setdefault((question, config, impl), []).append(value)
                    print(f"round {r + 1} {question} {config}: {rows}", file=sys.stderr)
            if "idle" in asked:
                servers = ["pipeline", "tensor", "mlx_lm.server"]
                for server in servers[r % 3 :] + servers[: r % 3]:
                    cpu = idle_once(model, server, args.idle, tmp)
                    figures.setdefault(("idle", server, ""), []).append(max(cpu))
                    print(f"round {r + 1} idle {server}: {cpu}", file=sys.stderr)
    print(f"{args.rounds} rounds, alternated; medians [min-max]\n")
    print("| question | figure | 1 rank | pipeline 2 | tensor 2 | mlx-lm 1 rank | "
          "mlx-lm tensor 2 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for question in [q for q in QUESTIONS if q in asked]:
        one = figures[(question, "1 rank", "mlx-cluster")]
        cells = [spread(one)]
        for config in ("pipeline 2", "tensor 2"):
            ours = figures[(question, config, "mlx-cluster")]
            cells.append(f"{spread(ours)}, {ratio(ours, one)} 1 rank")
        for config in ("1 rank", "tensor 2"):
            theirs = figures.get((question, config, "mlx-lm"), ["-"])
            if all(isinstance(v, float) for v in theirs):
                ours = figures[(question, config, "mlx-cluster")]
                cells.append(f"{spread(theirs)} (ours {ratio(ours, theirs)})")
            else:
                cells.append(str(theirs[0]))
        unit = "prefill tok/s" if QUESTIONS[question][3] == "prefill_tps" else "decode tok/s"
        print(f"| {question} | {unit} | " + " | ".join(cells) + " |")
    if "idle" in asked:
        cells = [spread(figures[("idle", s, "")]) for s in ("pipeline", "tensor", "mlx_lm.server")]
        print(f"\nidle: CPU s of the busier rank over {args.idle:.0f} s after an answer: "
              f"serve pipeline 2 {cells[0]}, serve tensor 2 {cells[1]}, "
              f"mlx_lm.server tensor 2 {cells[2]}")  # fmt: skip


if __name__ == "__main__":
    main()
