"""Speculative decoding on sharded models: the same greedy text as single-process mlx-lm without
a draft, in both modes at 2 and 3 ranks, whoever proposes; the same seed gives the same
sampled text; the sampled distribution is the model's own (a statistical test, no ranks)."""

from __future__ import annotations


def test_indexed_prompt_look_up_proposes_what_a_scan_would():
    """PromptLookup's n-gram index against the plain scan it replaces, through appends and
    trims (rejections) on a small vocabulary, so that matches and stale entries are common."""
    import random

    import mlx.core as mx

    from node.model.draft import PromptLookup

    def scan(tokens: list[int], ngram: int) -> int:
        for n in range(min(ngram, len(tokens) - 1), 0, -1):
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tokens[-n:]:
                    return tokens[start + n]
        return tokens[-1]

    rng = random.Random(0)
    for _ in range(100):
        lookup = PromptLookup(3, 16)
        cache = lookup.make_cache()
        lookup(mx.array([[rng.randrange(8) for _ in range(rng.randrange(2, 30))]]), cache)
        for _ in range(40):
            if rng.random() < 0.3:
                cache[0].trim(rng.randrange(4))
            new = [rng.randrange(8) for _ in range(2 if len(cache[0].tokens) < 2 else 1)]
            proposed = lookup(mx.array([new]), cache)[0, 0].argmax().item()
            assert proposed == scan(cache[0].tokens, 3)
