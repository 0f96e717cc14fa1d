"""Speculative decoding on sharded models: the same greedy text as single-process mlx-lm without
a draft, in both modes at 2 and 3 ranks, whoever proposes; the same seed gives the same
sampled text; the sampled distribution is the model's own (a statistical test, no ranks)."""

from __future__ import annotations

import json

import pytest

from tests.support.processes import run_cli
from tests.support.reference import reference

PROMPT = "Tell me about lists"


MAX_TOKENS = 40


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """The served model, and drafts with its tokenizer: itself (every proposal accepted) and
    a random one-layer model (almost every proposal rejected)."""
    from tests.support.tiny import make_model

    base = tmp_path_factory.mktemp("drafts")
    model = make_model(base / "m", "qwen2", seed=2, chat_template=True)
    small = make_model(base / "small", "qwen2", seed=5, chat_template=True, num_hidden_layers=1)
    return {"model": model, "itself": model, "small": small}


def launch_json(model, *args) -> dict:
    p = run_cli("launch", "--model", model, "--max-tokens", MAX_TOKENS, "--json", *args, PROMPT)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize(
    "ranks, mode, proposer",
    [
        # each proposer in each mode once (the small draft at 3 ranks in both modes)
        (2, "pipeline", "itself"),
        (2, "pipeline", "lookup"),
        (2, "tensor", "itself"),
        (2, "tensor", "lookup"),
        (3, "pipeline", "small"),
        (3, "tensor", "small"),
        (2, "pipeline", "itself@rank0"),  # --draft-on rank0: rank 0's proposals shared
        (3, "tensor", "small@rank0"),
    ],
)
def test_greedy_text_is_the_models_own(drafts, ranks, mode, proposer):
    model = drafts["model"]
    name, _, where = proposer.partition("@")
    how = ["--prompt-lookup", 2] if name == "lookup" else ["--draft-model", drafts[name]]
    how += ["--draft-on", where] if where else []
    out = launch_json(model, "-n", ranks, "--mode", mode, "--num-draft-tokens", 3, *how)
    assert out["text"] == reference(model, PROMPT, MAX_TOKENS)
    timings = out["timings"]
    assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    if name == "itself":  # every proposal is right: 3 accepted per pass of 4 tokens
        assert timings["draft_n_accepted"] == timings["draft_n"] == MAX_TOKENS // 4 * 3


def test_the_same_seed_gives_the_same_sampled_text(drafts):
    args = ["-n", 2, "--draft-model", drafts["small"], "--temp", 1.0]
    first = launch_json(drafts["model"], *args, "--seed", 7)
    assert (
        first["text"] and launch_json(drafts["model"], *args, "--seed", 7)["text"] == first["text"]
    )
    # and it is sampled: another seed, another text, and not the greedy one
    assert launch_json(drafts["model"], *args, "--seed", 8)["text"] != first["text"]
    assert first["text"] != reference(drafts["model"], PROMPT, MAX_TOKENS)
    p = run_cli("launch", "--draft-model", drafts["small"], "--prompt-lookup", 2, "x")
    assert p.returncode == 2 and "choose one proposer" in p.stderr


def chi_square_ok(counts: dict[int, int], probs: list[float], n: int) -> tuple[float, float]:
    """(Pearson's chi-square of ``counts`` against ``probs``, its 0.1% critical value); tokens
    expected fewer than 5 times are pooled into one bin."""
    from statistics import NormalDist

    bins, rest_seen, rest_p = [], n, 1.0
    for token, p in enumerate(probs):
        if p * n >= 5:
            bins.append((counts.get(token, 0), p * n))
            rest_seen -= counts.get(token, 0)
            rest_p -= p
    if rest_p * n >= 5:
        bins.append((rest_seen, rest_p * n))
    stat = sum((seen - expected) ** 2 / expected for seen, expected in bins)
    df = len(bins) - 1
    z = NormalDist().inv_cdf(0.999)  # Wilson-Hilferty's approximation of the quantile
    critical = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    return stat, critical


def test_sampled_tokens_follow_the_models_distribution(tmp_path):
    """At temperature 1 with a proposer that is mostly wrong (prompt look-up on a prompt that
    repeats), the first and the second token follow the model's own probabilities: a
    chi-square test at the 0.1% level on 3000 samples each."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    from node.model.draft import PromptLookup
    from tests.support.tiny import make_model

    path = make_model(tmp_path / "m", "llama", seed=3, init_scale=2.0, num_hidden_layers=2)
    model, _ = load(str(path))
    prompt = [5, 9, 5, 9, 5]
    sampler = make_sampler(temp=1.0)
    n = 3000

    first_p = mx.softmax(model(mx.array(prompt)[None])[0, -1])
    vocab = first_p.shape[0]
    after = mx.concatenate(  # every possible first token after the prompt, as one batch
        [mx.broadcast_to(mx.array(prompt), (vocab, len(prompt))), mx.arange(vocab)[:, None]],
        axis=1,
    )
    second_p = first_p @ mx.softmax(model(after)[:, -1], axis=-1)  # the second's marginal

    firsts: dict[int, int] = {}
    seconds: dict[int, int] = {}
    for i in range(n):
        mx.random.seed(i)
        steps = speculative_generate_step(
            mx.array(prompt), model, PromptLookup(2, 512), max_tokens=2, num_draft_tokens=2,
            sampler=sampler,
        )  # fmt: skip
        first, second = (int(t) for t, *_ in steps)
        firsts[first] = firsts.get(first, 0) + 1
        seconds[second] = seconds.get(second, 0) + 1
    for counts, p in ((firsts, first_p), (seconds, second_p)):
        stat, critical = chi_square_ok(counts, p.tolist(), n)
        assert stat < critical, (stat, critical)
    assert len(firsts) > 50  # a distribution, not one token


def test_chat_keeps_the_drafts_cache_in_step_from_turn_to_turn(drafts):
    turns = "Tell me about lists\nAnd tuples?\nTell me about lists\n"
    args = ["chat", "-n", 2, "--model", drafts["model"], "--max-tokens", 20]
    plain = run_cli(*args, input=turns)
    drafted = run_cli(*args, "--draft-model", drafts["itself"], input=turns)
    assert plain.returncode == drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout
    # every proposal of the model's own copy is right, on every turn: its cache follows
    assert drafted.stderr.count("15 of 15 drafted accepted (100%)") == 3, drafted.stderr


def test_serve_speculates_on_a_request_decoded_alone(drafts):
    pytest.importorskip("openai")
    from tests.support.serving import Served

    served = Served(drafts["model"], "--draft-model", drafts["itself"])
    try:
        messages = [{"role": "user", "content": PROMPT}]
        alone = served.client.chat.completions.create(
            model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0, seed=1
        )
        batched = served.client.chat.completions.create(
            model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        expected = reference(drafts["model"], PROMPT, MAX_TOKENS)
        assert alone.choices[0].message.content == batched.choices[0].message.content == expected
        assert alone.model_extra["timings"]["draft_n_accepted"] == MAX_TOKENS // 4 * 3
        assert "draft_n" not in batched.model_extra["timings"]  # batches decode as before
    finally:
        assert served.stop() == 0


def test_bench_rows_with_and_without_the_draft_side_by_side(drafts, tmp_path):
    out = tmp_path / "bench.json"
    p = run_cli(
        "bench", "--model", drafts["model"], "--draft-model", drafts["itself"], "--ranks", 2,
        "--modes", "tensor", "--baselines", "none", "--prompt-tokens", 32, "--gen-tokens", 16,
        "--repeat", 1, "--warmup", 0, "--json", out,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["draft"]) for r in rows] == [("tensor", False), ("tensor", True)]
    plain, drafted = rows
    assert drafted["tokens_sha"] == plain["tokens_sha"]  # the same tokens, greedy
    assert drafted["draft_accepted"] == 1.0 and drafted["vs_no_draft"]["generation_tps"] > 0
    assert "| tensor +draft | 2 |" in p.stdout and "gen vs no draft" in p.stdout


def test_the_embedded_models_draft_works_out_of_the_box():
    """``--draft-model default``: the small draft trained with the embedded model (same
    tokenizer, same corpus) gives the same text, and some of its proposals are accepted."""
    plain = run_cli("launch", "--max-tokens", 48, "--json", PROMPT)
    drafted = run_cli("launch", "--max-tokens", 48, "--json", "--draft-model", "default", PROMPT)
    assert plain.returncode == drafted.returncode == 0, drafted.stderr
    plain, drafted = json.loads(plain.stdout), json.loads(drafted.stdout)
    assert drafted["text"] == plain["text"]
    timings = drafted["timings"]
    assert 0 < timings["draft_n_accepted"] <= timings["draft_n"], timings


def test_a_missing_or_foreign_draft_is_named(drafts, tmp_path):
    from tests.support.tiny import make_model

    p = run_cli("launch", "--model", drafts["model"], "--draft-model", tmp_path / "nowhere", "x")
    assert p.returncode == 2 and "no checkpoint there on this host" in p.stderr
    foreign = make_model(tmp_path / "foreign", "llama", seed=1, vocab_size=384)
    p = run_cli("launch", "--model", drafts["model"], "--draft-model", foreign, "x")
    assert p.returncode == 2 and "its tokenizer is not the model's" in p.stderr


@pytest.mark.parametrize("family, mode", [("qwen3_5", "pipeline"), ("gpt_oss", "tensor")])
def test_caches_that_cannot_be_cut_are_rolled_back(family, mode, tmp_path):
    """Linear attention (qwen3_5) and sliding windows (gpt_oss) cannot be trimmed: a rejected
    draft puts their state back (node.cache.rewind). The draft is the model a little off, a
    family of the same kind (its own caches rewound too): some proposals kept, some not, and
    the text single-process mlx-lm's without a draft."""
    from tests.support.tiny import make_model

    model = make_model(tmp_path / "m", family, seed=1)
    near = make_model(tmp_path / "near", family, seed=1, init_scale=8.08)
    out = launch_json(model, "-n", 2, "--mode", mode, "--draft-model", near)
    assert out["text"] == reference(model, PROMPT, MAX_TOKENS)
    timings = out["timings"]
    assert 0 < timings["draft_n_accepted"] < timings["draft_n"], timings
