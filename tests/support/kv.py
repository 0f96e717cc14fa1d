"""A small llama and its caches for the disk tier's tests (node.cache.disk): a model,
a prompt of three blocks and ten tokens, its prefilled cache, the next step's logits."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from node.cache.disk import BLOCK_TOKENS, plan_key
from tests.support.tiny import make_model

PLAN = plan_key(test="plan")  # a plan folder's name, as open_disk_cache makes it
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128}  # fmt: skip
TOKENS = [3 + (i * 7) % 400 for i in range(3 * BLOCK_TOKENS + 10)]


def small_llama(base: Path):
    """(its folder, the loaded model)."""
    path = make_model(base / "m", "llama", seed=1, **SMALL)
    m, _ = load(str(path))
    return path, m


def prefilled(m, tokens):
    cache = make_prompt_cache(m)
    logits = m(mx.array(tokens)[None], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return cache, logits[0, -1]


def next_logits(m, cache, tokens):
    return m(mx.array(tokens)[None], cache=cache)[0, -1]
