"""The GPU section of docs/benchmarks.md, measured in one go on a host with an NVIDIA GPU
and MLX's CUDA build (mlx-cluster[cuda]). Every figure comes from this run:

    python -m tests.bench.gpu --out gpu-report --part all     # or: setup, startup, bench

- the card, its driver, MLX and whether it runs on CUDA; `doctor -n 1` and `doctor -n 2`
  as a user sees them (text);
- a random Llama-3-8B-shaped bf16 model (hidden 4096, 32 layers, 32 query and 8 KV heads,
  MLP 14336, a 2,048-token vocabulary: 7.0 B parameters, 14 GB), made once under --models;
- start-up, whole process, alternated with `mlx_lm.generate` (`--pairs` pairs, the first of
  each kind being the first start on the host): ours broken down into ranks ready, loading,
  first token after start; and the parts in one process (import, CUDA's first op, load, first
  step with its kernel compilation, second step);
- `bench --ranks 1 --baselines mlx-lm` (decode and prefill, --repeat 5: median [min-max]),
  with `--kv-bits 8` and `4`, time to first token at 8,192 and 32,768 prompt tokens, and two
  ranks sharing the one GPU (pipeline, tensor over ring).

Each part writes its output under --out (markdown and the commands' own text).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.support.processes import CLI

EIGHT_B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "vocab_size": 2048,
    "rope_theta": 500000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}


def sh(argv: list, out: Path | None = None, timeout: float = 900,
       env: dict | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """Run a command; its stdout and stderr go to ``out`` too; the wall time in .wall."""
    tic = time.perf_counter()
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                       env=env)  # fmt: skip
    p.wall = time.perf_counter() - tic  # type: ignore[attr-defined]
    if out is not None:
        with out.open("a") as f:
            f.write(f"$ {' '.join(map(str, argv))}  # exit {p.returncode}, {p.wall:.1f} s\n")
            f.write(p.stdout + p.stderr + "\n")
    return p


def card(out: Path) -> dict:
    q = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
            "--format=csv,noheader"]).stdout.strip()  # fmt: skip
    import mlx.core as mx

    info = {"nvidia-smi": q, "mlx": mx.__version__, "cuda": mx.cuda.is_available(),
            "python": sys.version.split()[0]}  # fmt: skip
    (out / "card.json").write_text(json.dumps(info, indent=1))
    return info


def make_8b(path: Path, tokenizer_from: Path | None = None) -> Path:
    """A random Llama-3-8B-shaped model in bf16 (weights ~N(0, 0.02)), with a small trained
    tokenizer, or the one in ``tokenizer_from`` (its vocabulary sets the model's: 151,936
    for constrained decoding's cost, tests/bench/constrained_bench.py); made on the GPU, a
    layer at a time."""
    if (path / "config.json").exists():
        return path
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from transformers import AutoTokenizer

    from tests.support.tiny import save_sharded, train_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, path / name)
        tok = AutoTokenizer.from_pretrained(path)
        vocab = len(tok)
    else:
        tok = train_tokenizer(path, EIGHT_B["vocab_size"])
        vocab = EIGHT_B["vocab_size"]
    config = {**EIGHT_B, "vocab_size": vocab, "eos_token_id": tok.eos_token_id,
              "torch_dtype": "bfloat16"}  # fmt: skip
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = {}
    mx.random.seed(0)
    for name, p in tree_flatten(model.parameters()):
        if p.ndim >= 2:
            w = (mx.random.normal(p.shape) * 0.02).astype(mx.bfloat16)
        else:
            w = p.astype(mx.bfloat16)
        mx.eval(w)
        weights[name] = w
    save_sharded(weights, path)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


LOAD_STEPS = r"""
import time, json, sys
t0 = time.perf_counter()
import mlx.core as mx
t1 = time.perf_counter()
mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))
t2 = time.perf_counter()
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache
t3 = time.perf_counter()
model, tok = mlx_lm.load(sys.argv[1])
mx.eval(model.parameters())
t4 = time.perf_counter()
cache = make_prompt_cache(model)
mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
t5 = time.perf_counter()
mx.eval(model(mx.array([[5]]), cache=cache))
t6 = time.perf_counter()
print(json.dumps({"import mlx": t1 - t0, "CUDA's first op": t2 - t1, "import mlx_lm": t3 - t2,
                  "load": t4 - t3, "first step (4 tokens)": t5 - t4, "second step": t6 - t5}))
"""


def timed_start(kind: str, model: Path, log: Path, env: dict) -> dict:
    """One whole-process start of ``kind`` (ours, mlx-lm, steps) to its first token."""
    if kind == "ours":
        p = sh([CLI, "launch", "-n", "1", "--model", model, "--max-tokens", "1", "--verbose",
                "Hi"], log, env=env)  # fmt: skip
        found = {k: float(m[1]) if (m := re.search(pattern, p.stderr)) else None
                 for k, pattern in (("ready", r"all ranks ready after ([\d.]+) s"),
                                    ("load", r"loaded in ([\d.]+) s"),
                                    ("first", r"first token ([\d.]+) s after start"))}  # fmt: skip
        return {"wall": p.wall, "ok": p.returncode == 0, **found}
    if kind == "mlx-lm":
        p = sh([sys.executable, "-m", "mlx_lm", "generate", "--model", model, "--max-tokens",
                "1", "--prompt", "Hi"], log, env=env)  # fmt: skip
        return {"wall": p.wall, "ok": p.returncode == 0}
    p = sh([sys.executable, "-c", LOAD_STEPS, model], log, env=env)
    return json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {}


def startup(model: Path, out: Path, pairs: int) -> str:
    """Each kind's first start on an empty kernel cache (MLX compiles its CUDA kernels at
    their first use and keeps them in MLX_PTX_CACHE_DIR, by default /tmp/mlx/VERSION/ptx),
    then its second start on the cache the first filled; kinds alternated, pairs repeated."""
    import tempfile

    log = out / "startup.txt"
    runs: dict[str, list[tuple[dict, dict]]] = {"ours": [], "mlx-lm": [], "steps": []}
    order = list(runs)
    for i in range(pairs):
        for kind in order if i % 2 == 0 else order[::-1]:
            env = {**os.environ, "MLX_PTX_CACHE_DIR": tempfile.mkdtemp(prefix="ptx-")}
            first = timed_start(kind, model, log, env)
            runs[kind].append((first, timed_start(kind, model, log, env)))
    lines = ["| start | mlx-cluster launch -n 1 | ranks ready | of which loading | "
             "first token after start | mlx_lm.generate | ratio |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (a1, a2), (b1, b2) in zip(runs["ours"], runs["mlx-lm"], strict=True):
        for which, a, b in (("first (empty kernel cache)", a1, b1), ("second", a2, b2)):
            failed = ("" if a["ok"] else " (failed)", "" if b["ok"] else " (failed)")
            lines.append(f"| {which} | {a['wall']:.1f} s{failed[0]} | {a['ready']} s | "
                         f"{a['load']} s | {a['first']} s | {b['wall']:.1f} s{failed[1]} | "
                         f"{a['wall'] / b['wall']:.2f}x |")  # fmt: skip
    steps = [s for pair in runs["steps"] for s in pair]
    names = list(next((s for s in steps if s), {}))
    lines += ["", "| start (one process) | " + " | ".join(names) + " |",
              "|---" * (len(names) + 1) + "|"]  # fmt: skip
    for i, s in enumerate(steps):
        which = "first (empty kernel cache)" if i % 2 == 0 else "second"
        lines.append(f"| {which} | " + " | ".join(f"{s.get(n, 0):.2f} s" for n in names) + " |")
    text = "\n".join(lines)
    (out / "startup.md").write_text(text + "\n")
    return text


def benches(model: Path, out: Path, which: list[int] | None = None) -> None:
    log = out / "bench.txt"
    base = [CLI, "bench", "--model", model, "--ranks", "1"]
    runs = [
        ("decode and prefill, 512 prompt tokens, 128 generated, 5 runs",
         [*base, "--baselines", "mlx-lm", "--prompt-tokens", "512", "--gen-tokens", "128",
          "--repeat", "5"]),
        ("--kv-bits 8", [*base, "--baselines", "none", "--kv-bits", "8", "--prompt-tokens",
                         "512", "--gen-tokens", "128", "--repeat", "5"]),
        ("--kv-bits 4", [*base, "--baselines", "none", "--kv-bits", "4", "--prompt-tokens",
                         "512", "--gen-tokens", "128", "--repeat", "5"]),
        ("time to first token at 8k and 32k prompt tokens",
         [*base, "--baselines", "mlx-lm", "--prompt-tokens", "8192,32768", "--gen-tokens", "8",
          "--repeat", "2"]),
        ("two ranks sharing the one GPU",
         [CLI, "bench", "--model", model, "--ranks", "1,2", "--modes", "pipeline,tensor",
          "--baselines", "none", "--prompt-tokens", "128", "--gen-tokens", "32",
          "--repeat", "2"]),
    ]  # fmt: skip
    for i, (title, argv) in enumerate(runs, 1):
        if which and i not in which:
            continue
        p = sh(argv, log, timeout=1200)
        with (out / "bench.md").open("a") as f:
            f.write(f"### {title}\n\n`{' '.join(map(str, argv[1:]))}` (exit {p.returncode}, "
                    f"{p.wall:.0f} s)\n\n{p.stdout}\n")  # fmt: skip
            if p.returncode != 0:
                f.write("```\n" + "\n".join(p.stderr.splitlines()[-15:]) + "\n```\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-report"))
    parser.add_argument("--models", type=Path, default=Path("/tmp/gpu-models"))
    parser.add_argument("--part", choices=["setup", "startup", "bench", "all"], default="all")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--benches", default="", help="which benches, e.g. 1,2 (default: all)")
    parser.add_argument("--model", type=Path, help="measure this model instead (made by no one)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or args.models / "llama3-8b-body"
    if args.part in ("setup", "all"):
        print(json.dumps(card(args.out)), flush=True)
        for n in ("1", "2"):
            sh([CLI, "doctor", "-n", n], args.out / "doctor.txt")
        tic = time.perf_counter()
        if args.model is None:
            make_8b(model)
        print(f"model made in {time.perf_counter() - tic:.0f} s", flush=True)
    if args.part in ("startup", "all"):
        print(startup(model, args.out, args.pairs), flush=True)
    if args.part in ("bench", "all"):
        benches(model, args.out, [int(x) for x in args.benches.split(",") if x])
        print((args.out / "bench.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
