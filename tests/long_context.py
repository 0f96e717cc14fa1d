"""Exactness at long context: a prompt of N tokens through `mlx-cluster launch --logits`,
sharded, against single-process mlx-lm on the same model (next-token logits and the greedy
continuation), with each rank's peak memory.

    python tests/long_context.py --families llama,qwen3,gemma2 --tokens 32768 --cells p2,t2,p3,t3

The models are tests/tiny.py's families with 4 query heads (2 KV heads), 3 layers and a
65,536-token context: attention over a long prompt costs in proportion to heads x layers x
tokens^2, and on this machine's CPU a 32k prompt through the 12-head, 6-layer tiny llama
takes two minutes. Both sides use the BLAS a rank picks, on one thread (as tests/matrix.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import subprocess  # noqa: E402

from matrix import CLI, LOGIT_TOLERANCE, ONE_THREAD, REFERENCE_ENV, _prompt_ids  # noqa: E402
from tiny import make_model  # noqa: E402

SHAPE = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
         "max_position_embeddings": 65536}  # fmt: skip
PEAKS = re.compile(r"rank (\d+) ([\d.]+) GB")


def long_text(model: Path, tokens: int) -> str:
    """Distinct words that the model's tokenizer makes about ``tokens`` tokens of."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    words = [f"w{i % 997}x{i // 997}" for i in range(tokens)]
    per_word = len(tokenizer.encode(" ".join(words[:1000]))) / 1000
    return " ".join(words[: int(tokens / per_word)])


def reference(model_dir: str, prompt: str, max_tokens: int) -> dict:
    """Single-process mlx-lm: the greedy text (mlx_lm.generate) and the next-token logits,
    the prompt run in mlx-lm's 2048-token prefill steps (whole, its attention scores alone
    would take 4 x 32k x 32k floats)."""
    import mlx.core as mx
    from mlx_lm import generate, load
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(model_dir)
    ids = _prompt_ids(tokenizer, prompt)
    text = generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(0.0))
    cache = make_prompt_cache(model)
    for start in range(0, len(ids), 2048):
        logits = model(mx.array(ids[start : start + 2048])[None], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    return {"text": text, "logits": logits[0, -1].astype(mx.float32).tolist()}


def build(family: str, base: Path) -> Path:
    extra = dict(SHAPE)
    if family in ("qwen3", "gemma2", "mistral"):  # families that give head_dim themselves
        extra["head_dim"] = 16
        extra["hidden_size"] = 64
    return make_model(base / family, family, seed=1, **extra)


def cell(model: Path, prompt: str, mode: str, ranks: int, tokens: int, want: dict) -> dict:
    t = time.perf_counter()
    argv = [CLI, "launch", "-n", str(ranks), "--mode", mode, "--model", str(model), "--logits",
            "--max-tokens", str(tokens)]  # fmt: skip
    # the prompt on stdin: a 32k-token prompt is longer than one argument may be (128 KiB)
    p = subprocess.run(argv, input=prompt, capture_output=True, text=True, env=ONE_THREAD)
    row = {"mode": mode, "ranks": ranks, "seconds": round(time.perf_counter() - t, 1)}
    if p.returncode != 0:
        return {**row, "status": f"failed (exit {p.returncode}): {p.stderr.strip()[-300:]}"}
    got = json.loads(p.stdout)
    delta = max(abs(a - b) for a, b in zip(got["logits"], want["logits"], strict=True))
    same = got["text"] == want["text"]
    status = "match" if same else ("close" if delta <= LOGIT_TOLERANCE else "differs")
    peaks = {int(r): float(gb) for r, gb in PEAKS.findall(p.stderr.split("peak memory:")[-1])}
    return {**row, "status": status, "max_delta": delta, "prompt_tokens": got["prompt_tokens"],
            "peak_gb": [peaks[r] for r in sorted(peaks)]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="llama,qwen3,gemma2")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--cells", default="p2,t2,p3,t3", help="p: pipeline, t: tensor; ranks")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--reference", nargs=3, help=argparse.SUPPRESS)  # MODEL FILE N
    args = parser.parse_args()
    if args.reference:
        model, held, n = args.reference
        json.dump(reference(model, Path(held).read_text(), int(n)), sys.stdout)
        return
    base = Path(tempfile.mkdtemp(prefix="mlx-cluster-long-"))
    print("| family | prompt tokens | cell | status | max abs delta logit | peak GB per rank | s |")
    print("|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        model = build(family, base)
        prompt = long_text(model, args.tokens)
        held = base / f"{family}.txt"
        held.write_text(prompt)
        q = subprocess.run([sys.executable, __file__, "--reference", str(model), str(held),
                            str(args.max_tokens)], capture_output=True, text=True,
                           env=REFERENCE_ENV, check=True)  # fmt: skip
        want = json.loads(q.stdout)
        for c in args.cells.split(","):
            mode = {"p": "pipeline", "t": "tensor"}[c[0]]
            r = cell(model, prompt, mode, int(c[1:]), args.max_tokens, want)
            delta = f"{r['max_delta']:.1g}" if "max_delta" in r else "-"
            peaks = ", ".join(f"{x:.2f}" for x in r.get("peak_gb", []))
            print(f"| {family} | {r.get('prompt_tokens', '-')} | {mode} {r['ranks']} | "
                  f"{r['status']} | {delta} | {peaks} | {r['seconds']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
