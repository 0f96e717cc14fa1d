"""Snapshots for caches that cannot be cut back (node.cache.snapshots), through serve's
lockstep batch on one rank: every cache kind mlx-lm 0.32 makes, against the same batch
without a prompt cache (greedy: the same tokens however the prompt was reached)."""

from __future__ import annotations

import pytest

from cluster.core.spec import Order, Sampling, SharedRequest
from node.cache.snapshots import segments, snapshot_points


def test_snapshot_points_double_from_the_first_block_and_end_before_the_last_token():
    assert snapshot_points(100, 0) == [99]
    assert snapshot_points(3000, 0) == [256, 512, 1024, 2048, 2999]
    assert snapshot_points(3000, 600) == [1024, 2048, 2999]  # what is cached is not kept again
    assert snapshot_points(3000, 2999) == []
    assert snapshot_points(257, 0) == [256]  # 256 is the end less its last token
    tokens = list(range(700))
    parts = segments(tokens, 10, snapshots=True)
    assert [len(p) for p in parts] == [246, 256, 187, 1]  # cuts at 256, 512, 699
    assert sum(parts, []) == tokens[10:]
    assert segments(tokens, 10, snapshots=False) == [tokens[10:]]


# family -> the cache kinds it makes (what the test is for)
KINDS = {
    "qwen3_5": "ArraysCache + KVCache (linear attention)",
    "gpt_oss": "RotatingKVCache + KVCache (sliding windows)",
    "gemma4_text": "RotatingKVCache + KVCache, KV-sharing layers without a cache",
    "mimo_v2_flash": "RotatingKVCache with sinks",
    "longcat_flash": "CacheList of KVCaches (trimmable: no snapshots)",
    "llama": "KVCache (trimmable: no snapshots)",
}


def answer(batch, prompt: list[int], tokens: int = 6) -> tuple[list[int], int]:
    """Greedy tokens of ``prompt`` through the batch, and how many prompt tokens its cache gave."""
    request = SharedRequest(Sampling(max_tokens=tokens), prompt)
    ((uid, cached, why),) = batch.apply(Order(insert=[request]))
    assert why is None
    out: list[int] = []
    while batch.live:
        batch.round(lambda r: out.append(r.token))
    return out, cached


@pytest.mark.parametrize("family", list(KINDS))
def test_a_later_prompt_starts_from_the_longest_snapshot_inside_what_it_shares(
    tmp_path, monkeypatch, family
):
    """(Blocks of 16 tokens here, for speed: the windows of these models are 8.)"""
    from mlx_lm import load

    import node.cache.snapshots

    monkeypatch.setattr(node.cache.snapshots, "FIRST_SNAPSHOT", 16)

    from node.jobs.batch import Lockstep
    from tests.support.tiny import make_model

    model, tokenizer = load(str(make_model(tmp_path / family, family, seed=1)))
    batch = Lockstep(model, tokenizer, 4, 4, 20)
    fresh = Lockstep(model, tokenizer, 4, 4, 0)  # no prompt cache: the reference
    snapshots = family not in ("llama", "longcat_flash")
    assert batch.snapshots is snapshots
    base = [(7 * i) % 500 + 1 for i in range(70)]
    first, cached = answer(batch, base)
    assert cached == 0 and first == answer(fresh, base)[0]

    again, cached = answer(batch, base)  # the same prompt: all but its last token
    assert (again, cached) == (first, len(base) - 1)
    turn = base + first + [3, 4, 5]  # the next turn: prompt, answer, more
    got, cached = answer(batch, turn)
    assert got == answer(fresh, turn)[0]
    assert cached == len(base) + len(first)  # the answer's own cache (every token fed)
    branch = base[:60] + [9, 9, 9]  # shares 60 tokens: the 32-token snapshot serves
    got, cached = answer(batch, branch)
    assert got == answer(fresh, branch)[0]
    assert cached == (32 if snapshots else 60)
    batch.close()
    fresh.close()


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss", "deepseek_v41"])
def test_chat_resumes_a_turn_whose_answer_renders_otherwise_from_the_prompts_snapshot(
    tmp_path, family
):
    """chat's turn cache (node.cache.turns.TurnCache): the next turn repeats the prompt but not
    the answer's tokens (a template renders them its own way): a cache that cannot be cut
    back starts from its snapshot at the end of the prompt, with the text of a fresh start.
    (deepseek_v41's LayerCache cannot batch: serve decodes its requests alone, with this
    cache between them.)"""
    from functools import partial

    from mlx_lm import load

    from node.cache.turns import TurnCache
    from node.decode.loop import generate
    from node.jobs.chat import prefilled
    from tests.support.tiny import make_model

    model, tokenizer = load(str(make_model(tmp_path / family, family, seed=1)))

    def turn(cache: TurnCache | None, tokens: list[int]) -> tuple[list[int], int]:
        request = SharedRequest(Sampling(max_tokens=5), tokens)
        if cache is None:
            return generate(model, tokenizer, request, None).tokens, 0
        prompt_cache, feed = cache.prepare(tokens)
        answer = generate(model, tokenizer, request, None, prompt_cache=prompt_cache,
                          feed=feed, on_prefill=partial(prefilled, cache, None))  # fmt: skip
        cache.done(tokens, answer.tokens)
        return answer.tokens, len(tokens) - len(feed)

    cache = TurnCache(model, float("inf"))
    assert cache.snapshots
    first = [(5 * i) % 400 + 1 for i in range(40)]
    answer, cached = turn(cache, first)
    assert cached == 0 and answer == turn(None, first)[0]
    second = first + [7, 7] + [3, 4, 5]  # the answer rendered as other tokens, then a turn
    got, cached = turn(cache, second)
    assert cached == len(first) - 1 and got == turn(None, second)[0]
    third = second + got + [6]  # this time the answer as generated: the whole cache serves
    got, cached = turn(cache, third)
    assert cached == len(second) + len(got)  # every token of it (mlx-lm fed the last one)
    assert got == turn(None, third)[0]


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_a_restart_restores_a_snapshot_from_the_disk_tier(tmp_path, family):
    """The disk tier keeps a cache that cannot be cut back as blocks of its KV layers plus
    the other layers' whole state at block boundaries its prompt's snapshots reached: a
    batch started afresh (a restart) on the same folder reads all but the last block."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from node.cache.disk import BLOCK_TOKENS, DiskCache, local_layers, state_layers
    from node.jobs.batch import Lockstep
    from tests.support.kv import PLAN
    from tests.support.tiny import make_model

    model, tokenizer = load(str(make_model(tmp_path / family, family, seed=1)))
    fresh = make_prompt_cache(model)
    assert state_layers(fresh)  # this family's windows or linear attention

    def disk() -> DiskCache:
        return DiskCache(
            tmp_path / "kv", PLAN, 1e9, local_layers(fresh), states=state_layers(fresh)
        )

    base = [(11 * i) % 500 + 1 for i in range(600)]
    first = Lockstep(model, tokenizer, 4, 4, 20, disk=disk())
    answer(first, base)
    first.disk.flush()
    first.close()
    again = Lockstep(model, tokenizer, 4, 4, 20, disk=disk())  # memory empty: the disk serves
    turn = base + [3, 4, 5]
    got, cached = answer(again, turn)
    assert cached == 2 * BLOCK_TOKENS  # the last block boundary before the prompt's end
    assert again.from_disk  # read from the disk, not from memory
    reference = Lockstep(model, tokenizer, 4, 4, 0)
    assert got == answer(reference, turn)[0]
    again.close()
    reference.close()


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss", "gemma4_text"])
def test_speculative_decoding_rolls_back_caches_that_cannot_be_cut(tmp_path, family):
    """node.cache.rewind: a verify pass's rejected tokens put the state back (linear
    attention, windows that filled) and its kept ones go again at the front of the next pass:
    greedy text equal to plain decoding, with prompt look-up and with a draft model of the
    same family (its own caches rewound too), some drafts rejected, some accepted."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load

    from node.decode.loop import generate
    from node.model.draft import PromptLookup, Speculation
    from tests.support.tiny import make_model

    path = make_model(tmp_path / family, family, seed=1)
    model, tokenizer = load(str(path))
    draft, _ = load(str(path))  # the model, a little off: it agrees often, not always
    mx.random.seed(3)
    draft.update(
        tree_map(lambda p: p * (1 + 0.005 * mx.random.normal(p.shape)), draft.parameters())
    )
    prompt = [(3 * i) % 50 + 1 for i in range(40)] * 2  # repeats: look-up finds drafts
    request = SharedRequest(Sampling(max_tokens=24), prompt)
    plain = generate(model, tokenizer, request, None)
    proposers = {"look-up": PromptLookup(3, tokenizer.vocab_size), "draft": draft}
    for name, proposer in proposers.items():
        got = generate(model, tokenizer, request, None, speculation=Speculation(proposer, 3))
        assert got.tokens == plain.tokens, name
        drafted, accepted = (
            got.stats["timings"]["draft_n"],
            got.stats["timings"]["draft_n_accepted"],
        )
        assert drafted > accepted, (name, drafted, accepted)  # rejections were rolled back
        if name == "draft":  # and passes kept in part: their kept tokens fed again
            assert accepted > 0, (name, drafted, accepted)
        print(f"{family} {name}: {accepted} of {drafted} drafted tokens accepted")
