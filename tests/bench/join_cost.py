"""What a long cached prompt costs the streams it joins (issue 53's worst gap): mlx-lm's
BatchKVCache.extend pads every stream's cache to the longest, so 8 streams of 300 tokens
joined by one of 9,107 become 9 x 9,107; then one attention step of the 9-stream batch,
against the same step before. llama-576's KV (8 layers, 3 KV heads of 64, float32). The
join is timed with the next token's write into the cache (mlx-lm's extend leaves no room
for it), then the long one's leaving (filter), for mlx-lm's extend and filter and ours
(node.jobs.batch.extend_in_one_copy, filter_in_one_copy), alternated.

    OPENBLAS_NUM_THREADS=1 python -m tests.bench.join_cost
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from node.jobs.batch import MLX_LM_EXTEND, MLX_LM_FILTER, extend_in_one_copy, filter_in_one_copy

L, H, D = 8, 3, 64


def batch(n, length):
    caches = []
    for _ in range(n):
        c = KVCache()
        k = mx.random.normal((1, H, length, D))
        v = mx.random.normal((1, H, length, D))
        c.update_and_fetch(k, v)
        caches.append(c)
    return BatchKVCache.merge(caches)


def attend(layers, q):
    outs = []
    for c in layers:
        k, v = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]
        outs.append(mx.fast.scaled_dot_product_attention(q[: k.shape[0]], k, v, scale=0.125))
    mx.eval(outs)


def main() -> None:
    variants = {"mlx-lm": (MLX_LM_EXTEND, MLX_LM_FILTER),
                "ours": (extend_in_one_copy, filter_in_one_copy)}  # fmt: skip
    for trial in range(3):
        for name, (extend, leave) in variants.items():
            layers = [batch(8, 300) for _ in range(L)]
            longs = [batch(1, 9107) for _ in range(L)]
            mx.eval([c.keys for c in layers + longs])
            q = mx.random.normal((9, H * 3, 1, D))
            t = time.perf_counter()
            attend(layers, q[:8])
            before = time.perf_counter() - t
            token = mx.random.normal((9, H, 1, D))
            mx.eval(token)
            t = time.perf_counter()
            for a, b in zip(layers, longs, strict=True):
                extend(a, b)
                a.update_and_fetch(token, token)  # the next token's write
            mx.eval([c.keys for c in layers] + [c.values for c in layers])
            join = time.perf_counter() - t
            t = time.perf_counter()
            attend(layers, q)
            after = time.perf_counter() - t
            nbytes = sum(c.keys.nbytes + c.values.nbytes for c in layers)
            t = time.perf_counter()
            for c in layers:
                leave(c, list(range(8)))  # the long prompt's answer ends
            mx.eval([c.keys for c in layers] + [c.values for c in layers])
            left = time.perf_counter() - t
            print(
                f"trial {trial} {name}: attention step, 8 streams at 300: {before * 1000:.1f} "
                f"ms; extend to 9 x 9107 and write a token: {join * 1000:.0f} ms "
                f"({nbytes / 1e6:.0f} MB); attention step after: {after * 1000:.1f} ms; the "
                f"long one leaves: {left * 1000:.0f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
