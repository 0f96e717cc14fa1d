"""What --kv-bits saves and costs: the KV cache's bytes after a long prompt and the next-token
logits against the full-precision cache, through mlx-lm's own generate_step (which every rank
runs: each rank quantizes its own layers' or heads' cache, so a rank holds its share of these
bytes; the sharded text equals single-process's with the same settings, tests/e2e/test_launch.py).

    python -m tests.bench.kv_quant_cost --tokens 8192
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx  # noqa: E402

from tests.support.long_context import long_text
from tests.support.tiny import make_model


def run(model_dir: Path, tokens: int, bits: int | None) -> tuple[int, mx.array, list[int]]:
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from node.decode.loop import record_first

    model, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(long_text(model_dir, tokens))
    cache = make_prompt_cache(model)
    first: list = []
    kv = {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": 0} if bits else {}
    out = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=16, prompt_cache=cache,
                                       logits_processors=[record_first(first)], **kv)]  # fmt: skip
    return sum(c.nbytes for c in cache), first[0], out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    shape = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": args.tokens + 64}  # fmt: skip
    model = make_model(Path(tempfile.mkdtemp()) / "kv", "llama", seed=1, **shape)
    full_bytes, full_logits, full_tokens = run(model, args.tokens, None)
    print("| --kv-bits | KV cache (MB) | x full | max abs delta logit | same 16 tokens |")
    print("|---|---:|---:|---:|---|")
    print(f"| none | {full_bytes / 1e6:.1f} | 1.00 | 0 | yes |")
    for bits in (8, 4):
        nbytes, logits, tokens = run(model, args.tokens, bits)
        delta = mx.abs(logits - full_logits).max().item()
        print(f"| {bits} | {nbytes / 1e6:.1f} | {nbytes / full_bytes:.2f} | {delta:.2g} | "
              f"{'yes' if tokens == full_tokens else 'no'} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
