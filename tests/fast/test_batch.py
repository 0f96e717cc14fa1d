"""serve's ranks without a group: rank 0's inbox, the lockstep batch (node.jobs.batch: its
prompt cache, its prefill steps and pace) and the decode loop's prefill, in one process."""

from __future__ import annotations

import json

import pytest

from cluster.core.protocol import END_OF_INPUT
from cluster.core.spec import Order, Sampling, SharedRequest, to_dict
from tests.support.serving import request


def test_rank0_serves_the_requests_before_end_of_input_in_the_same_read():
    """The drain mark and the last requests often arrive in one read of the channel."""
    import os

    from node.jobs.serve import Inbox

    read_fd, write_fd = os.pipe()
    req = request(False, temperature=0)  # greedy: the same text however it is decoded
    line = json.dumps({"op": "request", "request": to_dict(req.to_rank0())}).encode()
    os.write(write_fd, line + b"\n" + END_OF_INPUT)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as channel:
        inbox = Inbox(channel, print)
        first = inbox.flights.get(timeout=5)
        assert first is not None and first.request.id == req.id
        assert inbox.flights.get(timeout=5) is None and inbox.draining.is_set()
        assert inbox.prepared_all.is_set()  # only now may rank 0 quit


def test_kept_caches_stay_within_their_bytes(tmp_path):
    """node.batch.Lockstep on one rank: a finished answer's cache is kept, and the least
    recently used go once the kept bytes pass the budget (ranks agree through an all_sum,
    here a group of one)."""
    from mlx_lm import load

    from node.decode.sampling import seeded
    from node.jobs.batch import Lockstep
    from tests.support.tiny import make_model

    model, tokenizer = load(str(make_model(tmp_path / "m", "llama", seed=1)))

    def answer_three(cache_bytes: float) -> Lockstep:
        batch = Lockstep(model, tokenizer, 4, 4, 10, cache_bytes)
        for prompt in ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]):
            request = SharedRequest(seeded(Sampling(max_tokens=3, seed=1)), prompt)
            batch.apply(Order(insert=[request]))
            while batch.live:
                batch.round(None)
        batch.close()
        return batch

    roomy = answer_three(float("inf"))
    assert len(roomy.prompt_cache) == 3
    one = roomy.prompt_cache.nbytes / 3  # each answer's cache (the KV steps make them alike)
    tight = answer_three(one * 1.5)
    assert len(tight.prompt_cache) == 1 and tight.prompt_cache.nbytes <= one * 1.5


def test_prefill_pace_follows_the_measured_rate():
    from node.jobs.batch import PREFILL_MIN, PrefillPace

    pace = PrefillPace(2048, 0.5)
    assert pace.step(decoding=False) == 2048  # nobody waits: the biggest steps
    assert pace.step(decoding=True) == PREFILL_MIN  # not measured yet: a small first step
    pace.measured(1000, 1.0)
    assert pace.step(decoding=True) == 500
    pace.measured(200, 1.0)  # a longer prompt prefills slower: the step follows
    assert pace.step(decoding=True) == 300
    for _ in range(5):
        pace.measured(1, 1.0)
    assert pace.step(decoding=True) == PREFILL_MIN  # never below
    pace.measured(10**6, 1.0)
    assert pace.step(decoding=True) == 2048  # never above --prefill-step
    assert PrefillPace(2048, 0.0).step(decoding=True) == 2048  # --max-stall 0: off


def test_a_long_prompt_is_prefilled_in_steps_between_the_running_answers_tokens(tmp_path):
    """node.batch.Lockstep on one rank: while a long prompt joins, every round is one step:
    the running answer gets a token, the prompt at most one prefill step of tokens (rank 0's
    pace, shared in the order), so a cancel or a new request can come between any two."""
    from mlx_lm import load

    from node.decode.sampling import seeded
    from node.jobs.batch import PREFILL_MIN, Lockstep
    from tests.support.tiny import make_model

    model, tokenizer = load(str(make_model(tmp_path / "m", "llama", seed=1, eos_token_id=9999)))
    batch = Lockstep(model, tokenizer, 4, 4, 0, prefill_step=2048, max_stall=0.5)
    got: list = []
    batch.apply(Order(insert=[SharedRequest(seeded(Sampling(max_tokens=400)), [5, 6, 7])]))
    while len(got) < 2:
        batch.round(got.append)
    step = batch.next_prefill_step(joining=[1000])  # streams decode: the pace's step
    assert step == batch.pace.step(decoding=True) and PREFILL_MIN <= step <= 2048
    long = SharedRequest(seeded(Sampling(max_tokens=2)), [5 + i % 200 for i in range(1000)])
    ((uid, _, _),) = batch.apply(Order(insert=[long], prefill_step=PREFILL_MIN))
    done = 0
    while batch.prefilling:
        got.clear()
        batch.round(got.append)
        assert [r.uid for r in got] == [0], got  # one step: the running answer's token
        if uid in batch.prefilling:
            now = batch.prefilling[uid][0]
            assert 0 < now - done <= batch.prefill_step_size, (done, now)
            done = now
        if (step := batch.next_prefill_step()) is not None:  # the pace, once measured
            batch.apply(Order(prefill_step=step))
    assert batch.pace.rate is not None
    while uid in batch.live:
        got.clear()
        batch.round(got.append)
    batch.apply(Order(remove=[0]))
    assert not batch.live
    batch.close()


def test_a_cancel_during_the_prefill_stops_it_within_one_chunk(tmp_path):
    """node.decode.loop on one rank, cancellable (chat): rank 0 cancelled after the first chunk;
    the prefill stops there, the answer is empty and "cancelled", and the cache holds exactly
    the chunk prefilled (chat keeps it for the next turn)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from node.decode.loop import generate
    from node.decode.sampling import seeded
    from tests.support.tiny import make_model

    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    model, tokenizer = load(str(make_model(tmp_path / "m", "llama", seed=1, **small)))
    request = SharedRequest(seeded(Sampling(max_tokens=4)), [5 + i % 200 for i in range(5000)])
    seen: list[tuple[int, int]] = []
    cache = make_prompt_cache(model)
    answer = generate(model, tokenizer, request, lambda _: None, prompt_cache=cache,
                      cancelled=lambda: bool(seen) and seen[-1][0] > 0, cancellable=True,
                      on_prefill=lambda d, t: seen.append((d, t)))  # fmt: skip
    assert answer.stats["finish_reason"] == "cancelled" and answer.tokens == [], answer.stats
    assert seen == [(0, 5000), (2048, 5000)], seen  # mlx-lm's chunks of 2048
    assert cache[0].offset == 2048


def test_kv_bits_reach_mlx_lm_with_and_without_a_draft(monkeypatch, tmp_path):
    """--kv-bits goes to mlx-lm's stream_generate on every path, the speculative one too."""
    from mlx_lm import load

    import node.decode.loop as g
    from node.decode.prefill import use_step_args
    from node.decode.sampling import seeded
    from node.model.draft import PromptLookup, Speculation
    from tests.support.tiny import make_model

    model, _ = load(str(make_model(tmp_path / "m", "llama", seed=1)))
    seen: list[dict] = []
    monkeypatch.setattr(g, "stream_generate", lambda *a, **kw: seen.append(kw) or iter(()))
    use_step_args({"kv_bits": 4, "kv_group_size": 64, "quantized_kv_start": 0})
    proposer = PromptLookup(2, 512)
    try:
        request = SharedRequest(seeded(Sampling(max_tokens=2)), [1, 2])
        list(g.token_stream(model, None, request))
        list(g.token_stream(model, None, request, speculation=Speculation(proposer, 3)))
    finally:
        use_step_args({})
    assert all(kw["kv_bits"] == 4 and kw["quantized_kv_start"] == 0 for kw in seen), seen
    assert seen[1]["draft_model"] is proposer and seen[1]["num_draft_tokens"] == 3


def test_pipeline_prefill_steps_make_enough_for_every_stage():
    """node.decode.prefill.prefill_step: in pipeline mode the step halves from 2048 until the
    prompt makes 8 steps per stage (down to 256): the stages then overlap
    (tests/bench/prefill_overlap.py)."""
    from node.decode.prefill import prefill_step

    assert prefill_step(9123, 1) == 2048  # one rank or tensor mode: mlx-lm's step
    assert prefill_step(9123, 2) == 512  # 18 steps: 0.53 of one rank's time, ideally
    assert prefill_step(9123, 3) == 256
    assert prefill_step(32768, 2) == 2048  # already 16 steps
    assert prefill_step(40, 4) == 256  # a short prompt: one step anyway


def test_serve_overlaps_pipeline_stages_only_while_nothing_decodes(tmp_path):
    """node.batch.Lockstep with 2 stages: a long prompt alone goes in the pipeline's step,
    several per round (a round makes about 2048 x stages tokens); beside a running answer,
    one paced step per round."""
    from mlx_lm import load

    from node.decode.sampling import seeded
    from node.jobs.batch import ROUND_STEPS, Lockstep
    from tests.support.tiny import make_model

    small = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
    }  # a 5000-token prompt, fast
    built = make_model(tmp_path / "m", "llama", seed=1, eos_token_id=9999, **small)
    model, tokenizer = load(str(built))
    batch = Lockstep(model, tokenizer, 4, 4, 0, prefill_step=2048, max_stall=0.5, stages=2)
    assert batch.steps_this_round() == ROUND_STEPS
    step = batch.next_prefill_step(joining=[5000])
    assert step == 256
    long = SharedRequest(seeded(Sampling(max_tokens=2)), [5 + i % 200 for i in range(5000)])
    ((uid, _, _),) = batch.apply(Order(insert=[long], prefill_step=step))
    assert batch.steps_this_round() == 2048 * 2 // 256
    batch.round(None)
    assert batch.prefilling[uid][0] == 16 * 256  # 16 steps in one round
    batch.apply(Order(remove=[uid]))
    short = SharedRequest(seeded(Sampling(max_tokens=400)), [5, 6, 7])
    batch.apply(Order(insert=[short]))
    while not batch.decoding():
        batch.round(None)
    step = batch.next_prefill_step(joining=[5000])  # beside a decoding answer: the pace's
    assert step == batch.pace.step(decoding=True)
    batch.apply(Order(insert=[long], prefill_step=step))
    assert batch.steps_this_round() == 1
    batch.close()


def test_a_model_that_cannot_batch_idles_then_answers_alone(tmp_path, monkeypatch):
    """serve's loop on one rank (node.jobs.serve.run_serve) with a model whose caches cannot
    be batched (llama4's ChunkedKVCache has no merge): rank 0's idle pings reach no batch
    (one once did, and the rank died on the first ping), and a request is decoded alone
    with the text a lone decode gives."""
    import os
    import threading
    import time

    import mlx.core as mx

    import node.jobs.batch as nb
    import node.jobs.serve as ns
    import node.rank.watchdog as wd
    from cluster.core.protocol import Piece, Stats
    from cluster.core.spec import JobSpec, ServeSettings
    from node.decode.loop import generate
    from node.jobs import Job
    from node.model.load import load_shard
    from tests.support.tiny import make_model

    model = make_model(tmp_path / "m", "llama", seed=1)
    group = mx.distributed.init()
    loaded = load_shard(str(model), "pipeline", group)
    read_fd, write_fd = os.pipe()
    monkeypatch.setattr(nb, "batchable", lambda m: False)
    monkeypatch.setattr(ns, "PING_S", 0.02)  # idle rounds, fast
    monkeypatch.setattr(ns, "MEMORY_EVERY_S", 0.0)  # a Memory event each round: they count
    monkeypatch.setattr(wd, "launcher_input", lambda: os.fdopen(read_fd, "rb"))
    events: list = []
    failed: list[BaseException] = []
    spec = JobSpec(model=str(model), command="serve", serve=ServeSettings())
    job = Job(spec, group, loaded, events.append, lambda line: None, None)

    def serve() -> None:
        try:
            ns.run_serve(job)
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while sum(type(e).__name__ == "Memory" for e in events) < 5 and thread.is_alive():
        assert time.monotonic() < deadline, "serve made no idle round"
        time.sleep(0.01)
    assert not failed, failed  # five idle rounds, each a ping
    req = request(False, temperature=0)  # greedy: the same text however it is decoded
    line = json.dumps({"op": "request", "request": to_dict(req.to_rank0())}).encode()
    os.write(write_fd, line + b"\n" + END_OF_INPUT)
    os.close(write_fd)
    thread.join(60)
    assert not thread.is_alive() and not failed, failed
    (stats,) = [e for e in events if isinstance(e, Stats)]
    assert stats.request == req.id
    text = "".join(e.text for e in events if isinstance(e, Piece) and e.request == req.id)
    shared = ns.Admission.of(loaded.config, spec.serve).request(
        ns.prompt_of(req.to_rank0(), loaded.tokenizer), req.to_rank0().sampling
    )
    pieces: list[str] = []
    generate(loaded.model, loaded.tokenizer, shared, pieces.append)
    assert text and text == "".join(pieces)


def test_micro_batches_hand_out_their_own_uids_and_each_stream_its_lone_answer(
    tmp_path, monkeypatch
):
    """node.batch.Lockstep split into micro-batches (each a BatchGenerator on its own
    stream; forced here on one rank, where a pipeline has no stages): requests go to the
    emptier micro-batch, every response carries the batch's uid, a removed request leaves its
    micro-batch, and every stream's tokens are what it decodes alone."""
    from mlx_lm import load

    import node.jobs.batch as batch_module
    from node.decode.sampling import seeded
    from node.jobs.batch import Lockstep
    from tests.support.tiny import make_model

    model, tokenizer = load(str(make_model(tmp_path / "m", "llama", seed=1, eos_token_id=9999)))
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21]]

    streams: list = []

    def decode(micro: int, remove: int | None = None) -> dict[int, list[int]]:
        batch = Lockstep(model, tokenizer, 8, 8, 0, stages=2, micro_batches=micro)
        assert len(batch.generators) == micro
        streams.append([g.stream for g in batch.generators])
        requests = [SharedRequest(seeded(Sampling(max_tokens=6, seed=1)), p) for p in prompts]
        joined = batch.apply(Order(insert=requests))
        assert [uid for uid, _, _ in joined] == list(range(len(prompts)))
        assert [len(held) for held in batch.held] == ([3, 2] if micro == 2 else [5])
        tokens: dict[int, list[int]] = {}
        if remove is not None:
            while remove not in tokens:  # it decodes, then it is cancelled
                batch.round(lambda r: tokens.setdefault(r.uid, []).append(r.token))
            batch.apply(Order(remove=[remove]))
            assert remove not in batch.live and remove not in batch.where
        while batch.live:
            batch.round(lambda r: tokens.setdefault(r.uid, []).append(r.token))
        assert batch.where == {} and all(not held for held in batch.held)
        batch.close()
        return tokens

    monkeypatch.setattr(batch_module, "staged", lambda model: True)
    alone = decode(1)
    assert len(alone) == len(prompts) and len(alone[1]) == 6
    assert decode(2) == alone
    cut = decode(2, remove=1)
    assert streams[1] == streams[2]  # a batch's streams are made once, not one set per batch
    assert len(cut[1]) < 6 and {u: t for u, t in cut.items() if u != 1} == {
        u: t for u, t in alone.items() if u != 1
    }


def test_micro_batches_apply_to_our_stages_only(tmp_path):
    """--micro-batches needs a pipeline through StageLayer (its collectives go on one stream);
    rank 0 says whether it applies, and why not."""
    from mlx_lm import load

    from node.jobs.batch import micro_batches_for, micro_batches_note
    from node.model.stage import apply_stages, staged
    from tests.support.tiny import make_model

    class Group:  # what apply_stages reads of a group of 2, as rank 0
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 2

    model, _ = load(str(make_model(tmp_path / "m", "llama", seed=1)))
    assert not staged(model) and micro_batches_for(model, 2, 2) == 1
    assert micro_batches_note(model, 2, 2) == (
        "--micro-batches 2 does not apply (this family's pipeline is mlx-lm's own): the batch "
        "decodes as one"
    )
    apply_stages(model, Group())
    assert staged(model) and micro_batches_for(model, 2, 2) == 2
    assert micro_batches_note(model, 2, 2).startswith("the batch decodes in 2 micro-batches")
    assert micro_batches_for(model, 1, 2) == 1 and "one rank has no stages" in (
        micro_batches_note(model, 1, 2) or ""
    )
    assert micro_batches_note(model, 2, 1) is None


@pytest.mark.parametrize("lengths", [((300, 120), (9107,)), ((40,), (5, 70)), ((0,), (33,))])
def test_a_joining_batch_reads_as_mlx_lms_extend_leaves_it(lengths):
    """node.jobs.batch.extend_in_one_copy and filter_in_one_copy against mlx-lm's
    BatchKVCache.extend and filter: the same keys, values, offsets and left padding up to
    the index (what attention reads), with room for the next token, whichever batch is
    longer, and again once the last stream leaves."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from node.jobs.batch import (
        MLX_LM_EXTEND,
        MLX_LM_FILTER,
        extend_in_one_copy,
        filter_in_one_copy,
    )

    def batch(sizes, seed):
        caches = []
        for i, n in enumerate(sizes):
            c = KVCache()
            if n:
                k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed + i))
                c.update_and_fetch(k, k * 2)
            caches.append(c)
        return BatchKVCache.merge(caches)

    ours, theirs = batch(lengths[0], 0), batch(lengths[0], 0)
    extend_in_one_copy(ours, batch(lengths[1], 10))
    MLX_LM_EXTEND(theirs, batch(lengths[1], 10))
    for a, b in zip(ours.keys_and_values(), theirs.keys_and_values(), strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    assert ours._idx == theirs._idx and ours.keys.shape[2] > ours._idx  # room for a token
    # then the last stream leaves (as a handed-off prompt asking one token does at once)
    kept = list(range(len(lengths[0]) + len(lengths[1]) - 1))
    filter_in_one_copy(ours, kept)
    MLX_LM_FILTER(theirs, kept)
    for a, b in zip(ours.keys_and_values(), theirs.keys_and_values(), strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert ours.left_padding.tolist() == theirs.left_padding.tolist() and ours._idx == theirs._idx
