"""Exactness at long context: a prompt of N tokens through `mlx-cluster launch --logits`,
sharded, against single-process mlx-lm on the same model (the greedy continuation and the
next-token logits, both from one prefill on each side), with each rank's peak memory.

    python -m tests.support.long_context --tokens 32768 --cells p2,t2,p3,t3

Attention over a long prompt is what costs here: MLX's CPU softmax runs at about 70M exp/s on
this machine, so a 32k prompt costs about 8 s per attention head and layer, on each side. So
each mode gets the smallest model that exercises it: pipeline cells a model with one head per
layer and a layer per stage (gemma3_text: 3, split 2+1 at 2 ranks), tensor cells one layer
(gemma3_text: a sliding and a global one) with as many heads as the tensor rank counts
divide. Both sides use the BLAS a rank picks, on one thread (as tests/support/matrix.py).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from node.decode.prefill import PREFILL_STEP
from tests.support.processes import ROOT
from tests.support.reference import CLI, LOGIT_TOLERANCE, ONE_THREAD, REFERENCE_ENV, _generated
from tests.support.tiny import make_model

PEAKS = re.compile(r"rank (\d+) ([\d.]+) GB")
FAMILIES = ("llama", "qwen3", "gemma3_text")
MODES = {"p": "pipeline", "t": "tensor"}


def shape(family: str, mode: str, ranks: list[int], tokens: int) -> dict:
    """The model for ``mode``'s cells at ``ranks``: see the module's docstring."""
    if mode == "pipeline":  # as many layers as the most stages (gemma3_text: 3, to slide)
        heads, layers = 1, max(*ranks, 3 if family == "gemma3_text" else 2)
    else:
        heads, layers = math.lcm(*ranks), 2 if family == "gemma3_text" else 1
    context = max(tokens + 64, 4096)
    extra = {"num_attention_heads": heads, "num_key_value_heads": heads,
             "num_hidden_layers": layers, "max_position_embeddings": context}  # fmt: skip
    if family in ("qwen3", "gemma3_text"):  # families that give head_dim themselves
        extra.update(head_dim=16, hidden_size=96)
    if family == "gemma3_text":  # layers 0, 2: a 512-token window; layer 1: global
        extra.update(sliding_window=512, sliding_window_pattern=2)
    return extra


def long_text(model: Path, tokens: int) -> str:
    """Distinct words that the model's tokenizer makes exactly ``tokens`` tokens of (or as
    near as re-encoding allows: the row reports the count)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    words = [f"w{i % 997}x{i // 997}" for i in range(tokens)]
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:tokens]
    return tokenizer.decode(ids)


def start_reference(model: Path, prompt_file: Path, max_tokens: int) -> subprocess.Popen:
    """Single-process mlx-lm in its own process (REFERENCE_ENV: the BLAS is chosen at start)."""
    argv = [sys.executable, "-m", "tests.support.long_context", "--reference", str(model),
            str(prompt_file), str(max_tokens)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, env=REFERENCE_ENV, text=True, cwd=ROOT)


def start_cell(model: Path, prompt: str, mode: str, ranks: int, max_tokens: int):
    # mlx-lm's prefill step on both sides: the same chunks, so the same rounding (pipeline
    # mode's default step is smaller for some lengths: node.decode.prefill.prefill_step)
    argv = [CLI, "launch", "-n", str(ranks), "--mode", mode, "--model", str(model), "--logits",
            "--max-tokens", str(max_tokens), "--prefill-step", str(PREFILL_STEP)]  # fmt: skip
    # the prompt on stdin: a 32k-token prompt is longer than one argument may be (128 KiB)
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ONE_THREAD)  # fmt: skip
    p.stdin.write(prompt)
    p.stdin.close()
    return p


def finish_cell(p: subprocess.Popen, mode: str, ranks: int, started: float, want: dict) -> dict:
    out, err = p.stdout.read(), p.stderr.read()
    p.wait()
    row = {"mode": mode, "ranks": ranks, "seconds": round(time.perf_counter() - started, 1)}
    if p.returncode != 0:
        return {**row, "status": f"failed (exit {p.returncode}): {err.strip()[-300:]}"}
    got = json.loads(out)
    delta = max(abs(a - b) for a, b in zip(got["logits"], want["logits"], strict=True))
    same = got["text"] == want["text"]
    status = "match" if same else ("close" if delta <= LOGIT_TOLERANCE else "differs")
    peaks = {int(r): float(gb) for r, gb in PEAKS.findall(err.split("peak memory:")[-1])}
    return {**row, "status": status, "max_delta": delta, "prompt_tokens": got["prompt_tokens"],
            "peak_gb": [peaks[r] for r in sorted(peaks)]}  # fmt: skip


def run_family(family: str, tokens: int, cells: list[str], base: Path, max_tokens: int = 4):
    """One row per cell ("p2": pipeline at 2 ranks, ...). The references of both models run
    at once, then the cells at once (each its own `launch`): the CPU is the limit either way."""
    ranks = {m: [int(c[1:]) for c in cells if MODES[c[0]] == m] for m in MODES.values()}
    modes = [m for m in ranks if ranks[m]]
    models = {m: make_model(base / f"{family}-{m}", family, seed=1,
                            **shape(family, m, ranks[m], tokens)) for m in modes}  # fmt: skip
    prompt = long_text(models[modes[0]], tokens)  # one tokenizer (tiny.py's) for both
    held = base / f"{family}.txt"
    held.write_text(prompt)
    refs = {m: start_reference(model, held, max_tokens) for m, model in models.items()}
    want = {}
    for m, q in refs.items():
        out = q.stdout.read()
        if q.wait() != 0:
            raise RuntimeError(f"single-process reference for {family} {m} failed")
        want[m] = json.loads(out)
    t = time.perf_counter()
    running = [(MODES[c[0]], int(c[1:])) for c in cells]
    procs = [start_cell(models[m], prompt, m, n, max_tokens) for m, n in running]
    rows = [finish_cell(p, m, n, t, want[m]) for p, (m, n) in zip(procs, running, strict=True)]
    return [{"family": family, **r} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--cells", default="p2,t2,p3,t3", help="p: pipeline, t: tensor; ranks")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--one-by-one", action="store_true", help="cells one after another")
    parser.add_argument("--reference", nargs=3, help=argparse.SUPPRESS)  # MODEL FILE N
    args = parser.parse_args()
    if args.reference:
        model, held, n = args.reference
        text, logits = _generated(model, Path(held).read_text(), n)
        json.dump({"text": text, "logits": logits}, sys.stdout)
        return
    base = Path(tempfile.mkdtemp(prefix="mlx-cluster-long-"))
    print("| family | prompt tokens | cell | status | max abs delta logit | peak GB per rank | s |")
    print("|---|---|---|---|---|---|---|")
    cells = args.cells.split(",")
    for family in args.families.split(","):
        groups = [[c] for c in cells] if args.one_by_one else [cells]
        for group in groups:
            rows = run_family(family, args.tokens, group, base / "-".join(group), args.max_tokens)
            for r in rows:
                delta = f"{r['max_delta']:.1g}" if "max_delta" in r else "-"
                peaks = ", ".join(f"{x:.2f}" for x in r.get("peak_gb", []))
                print(f"| {family} | {r.get('prompt_tokens', '-')} | {r['mode']} {r['ranks']} | "
                      f"{r['status']} | {delta} | {peaks} | {r['seconds']} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
