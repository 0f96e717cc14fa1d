"""A CUDA rank prefilling for a CPU rank that decodes (issue 53), on one GPU host: a 32k-token
prompt's time to first token when the CPU rank serves alone, against a serve whose prefill
group is a rank on the GPU and whose decode group is a rank on the host's CPU (the hostfile's
``device: cpu``), the KV handed over loopback TCP. A GPU rank alone is shown for scale. The
settings alternate (A B C A B C ...), each starting serve afresh, in the same run; each sends
a warm-up prompt, then the long prompt once, streaming 16 greedy tokens.

    python -m tests.bench.handoff_gpu --prompt-tokens 32768 --repeat 2

Needs a host where MLX has a CUDA GPU (tests/bench/gpu_carry.sh carries MLX there) and,
for a fair CPU side, OpenBLAS (cluster.core.blas); the CPU rank gets every core.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from tests.support.long_context import long_text
from tests.support.serving import BIN, free_port, llama_576, stop, wait_up

GPU = {"ssh": "127.0.0.1", "gpus": [0]}
CPU = {"ssh": "localhost", "device": "cpu"}
SETTINGS = {
    "CPU rank alone": {"hosts": [CPU]},
    "GPU rank prefills, CPU rank decodes": {
        "hosts": [GPU, CPU],
        "groups": [{"hosts": ["127.0.0.1"], "role": "prefill"}, {"hosts": ["localhost"]}],
    },
    "GPU rank alone": {"hosts": [GPU]},
}
TOKENS = 16
CHOICES = {"cpu": "CPU rank alone", "split": "GPU rank prefills, CPU rank decodes",
           "gpu": "GPU rank alone"}  # fmt: skip


def small_llama(base: Path) -> Path:
    """llama_576's kind, smaller: hidden 256, 2 layers, 4 query / 2 KV heads, 64k context."""
    from tests.support.tiny import make_model

    return make_model(base / "llama-256", "llama", seed=3, eos_token_id=100_000,
                      hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=65536)  # fmt: skip


def cli() -> str:
    return shutil.which("mlx-cluster") or str(BIN / "mlx-cluster")


def measure(model: str, hostfile: dict, prompt: str, warm: str, folder: Path, log) -> dict:
    path = folder / f"hosts-{len(hostfile['hosts'])}-{hostfile['hosts'][0]['ssh']}.yaml"
    path.write_text(yaml.safe_dump(hostfile))
    port = free_port()
    argv = [cli(), "serve", "--hostfile", str(path), "--model", model, "--port", str(port),
            "--no-measure-links", "--heartbeat-timeout", "120"]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log,
                            start_new_session=True)  # fmt: skip
    name = Path(model).name
    try:
        wait_up(port, proc, timeout=600)
        while True:  # every group serving (a fleet answers once one does)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        break
            except OSError:  # 503 while a group starts
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}")
            time.sleep(0.2)
        answer(port, name, warm, 4)
        began = time.perf_counter()
        first, text, usage = answer(port, name, prompt, TOKENS)
        end = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/cluster", timeout=10) as r:
            cluster = json.loads(r.read())
        return {"first_token_s": first - began, "rest_tps": (TOKENS - 1) / (end - first),
                "text": text, "prompt_tokens": usage.get("prompt_tokens"),
                "handoffs": handed(cluster)}  # fmt: skip
    finally:
        stop([proc])


def handed(overview) -> dict | None:
    """The first ``handoffs`` figure with a count in /v1/cluster's answer (the fleet's or a
    group's)."""
    if isinstance(overview, dict):
        h = overview.get("handoffs")
        if isinstance(h, dict) and h.get("count"):
            return h
        overview = list(overview.values())
    if isinstance(overview, list):
        return next((h for h in map(handed, overview) if h), None)
    return None


def answer(port: int, name: str, prompt: str, tokens: int) -> tuple[float, str, dict]:
    """Stream one greedy completion: when its first text came, its text, its usage."""
    body = {"model": name, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    first, text, usage = 0.0, "", {}
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text += choice["text"]
    return first, text, usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: llama-shaped, built here)")
    parser.add_argument(
        "--small",
        action="store_true",
        help="the built model with hidden 256 and 2 layers (MLX's CPU attention "
        "takes about 19 minutes for 32k tokens with the default's 576 x 8)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--log", help="serve's stderr, appended to LOG")
    parser.add_argument("--settings", default="cpu,split,gpu", help="of cpu, split, gpu")
    parser.add_argument(
        "--warm-tokens",
        type=int,
        default=0,
        help="a warm-up prompt this long first (its kernels compiled; default: a few words)",
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    model = args.model or str(small_llama(folder) if args.small else llama_576(folder))
    prompt = long_text(Path(model), args.prompt_tokens)
    warm = "Warm up. " + (long_text(Path(model), args.warm_tokens) if args.warm_tokens else "")
    chosen = {CHOICES[c]: SETTINGS[CHOICES[c]] for c in args.settings.split(",")}
    log = open(args.log, "a") if args.log else subprocess.DEVNULL
    results: dict[str, list[dict]] = {k: [] for k in chosen}
    for _ in range(args.repeat):
        for name, hostfile in chosen.items():
            r = measure(model, hostfile, prompt, warm, folder, log)
            results[name].append(r)
            print(f"{name}: {json.dumps(r)}", file=sys.stderr, flush=True)
    base = results.get("CPU rank alone")
    alone = statistics.median(r["first_token_s"] for r in base) if base else float("nan")
    print(f"| setting | time to first token (s) | against the CPU rank alone | next {TOKENS - 1} "
          f"tokens (tok/s) | handoffs (count, MB, median s) | text as the CPU rank's alone |  "
          f"({args.prompt_tokens}-token prompt, median of {args.repeat} [min-max])")  # fmt: skip
    print("|---|---|---|---|---|---|")
    reference = base[0]["text"] if base else None
    for name, rs in results.items():
        ttft = [r["first_token_s"] for r in rs]
        tps = [r["rest_tps"] for r in rs]
        h = rs[-1]["handoffs"] or {}
        shown = (f"{h['count']}, {h['bytes'] / 1e6:.1f}, {h['p50_s']:.2f}"
                 if h.get("count") else "-")  # fmt: skip
        same = f"{sum(r['text'] == reference for r in rs)} of {len(rs)}" if base else "-"
        ratio = f"{alone / statistics.median(ttft):.1f}x" if base else "-"
        print(f"| {name} | {statistics.median(ttft):.2f} [{min(ttft):.2f}-{max(ttft):.2f}] | "
              f"{ratio} | {statistics.median(tps):.1f} | {shown} | {same} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
