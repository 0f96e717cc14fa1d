"""Sampling, penalties, stop strings and the answer's stats, on every rank alike."""

import json

import mlx.core as mx
import pytest
from conftest import invoke, reference, run_cli

from cluster.core.spec import Sampling, SharedRequest
from node.generate import StopText
from node.sampling import presence_penalty, repetition_penalty, sampler, seeded

PROMPT = "Tell me about lists"
SAMPLED = ("--temp", 0.8, "--top-p", 0.9, "--top-k", 50, "--seed", 7)


def sampled_reference(model_dir, max_tokens: int) -> str:
    """Single-process mlx-lm with the same sampler and seed."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_dir))
    mx.random.seed(7)
    return generate(
        model,
        tokenizer,
        tokenizer.encode(PROMPT),
        max_tokens=max_tokens,
        sampler=make_sampler(temp=0.8, top_p=0.9, top_k=50),
    )


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_seeded_sampling_repeats(models, mode):
    runs = [
        run_cli("launch", "--mode", mode, "--model", models["llama"], "--max-tokens", 30,
                *SAMPLED, PROMPT)
        for _ in range(2)
    ]  # fmt: skip
    for p in runs:
        assert p.returncode == 0, p.stderr
    assert runs[0].stdout == runs[1].stdout
    assert runs[0].stdout != reference(models["llama"], PROMPT, 30)  # it did sample
    if mode == "pipeline":  # the same logits as one process, so the same draws
        assert runs[0].stdout == sampled_reference(models["llama"], 30)


@pytest.mark.e2e
def test_other_seed_other_text(models):
    texts = {
        run_cli("launch", "--model", models["llama"], "--max-tokens", 30, "--temp", 0.8,
                "--seed", seed, PROMPT).stdout
        for seed in (1, 2)
    }  # fmt: skip
    assert len(texts) == 2


@pytest.mark.e2e
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_stop_string_ends_every_rank(models, ranks):
    full = reference(models["llama"], PROMPT, 200)
    stop = full[40:44]
    expected = full[: full.index(stop)]
    p = run_cli(
        "launch", "-n", ranks, "--model", models["llama"], "--max-tokens", 200, "--stop", stop,
        "--stop", "never appears", "--json", PROMPT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    answer = json.loads(p.stdout)
    assert answer["text"] == expected
    assert answer["finish_reason"] == "stop"
    # the ranks stopped near the stop string, not at --max-tokens
    assert answer["usage"]["completion_tokens"] < 60
    assert "(stop)" in p.stderr


@pytest.mark.e2e
def test_json_answer(models):
    p = run_cli("launch", "--model", models["llama"], "--max-tokens", 16, "--json", PROMPT)
    assert p.returncode == 0, p.stderr
    answer = json.loads(p.stdout)  # stdout holds the JSON and nothing else
    assert answer["text"] == reference(models["llama"], PROMPT, 16)
    assert answer["finish_reason"] == "length"
    usage, timings = answer["usage"], answer["timings"]
    assert usage["completion_tokens"] == timings["predicted_n"] == 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + 16
    assert timings["prompt_n"] == usage["prompt_tokens"]
    for key in ("prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second"):
        assert timings[key] > 0
    assert timings["cache_n"] == 0
    assert len(answer["peak_memory_gb"]) == 2 and all(m > 0 for m in answer["peak_memory_gb"])


def test_bad_sampling_values_are_usage_errors_with_the_api_s_ranges(models):
    """The command line takes what a request may ask, and nothing else (one Range per
    parameter, cluster.core.params): -1 means off for --top-k and a random seed for --seed."""
    bad = [
        ("--top-p", -0.1),
        ("--top-k", -2),
        ("--min-p", 2),
        ("--temp", 101),
        ("--repetition-penalty", 0),
        ("--presence-penalty", 2.5),
        ("--seed", -2),
    ]
    for args in bad:
        p = invoke("launch", "--model", models["llama"], *args, PROMPT)
        assert p.returncode == 2
        assert f"Invalid value for '{args[0]}'" in p.stderr
    from cluster.commands.run import job_spec, launch

    values = launch.make_context("launch", ["--top-k", "-1", "--seed", "-1", "hi"]).params
    spec = job_spec("generate", {k: v for k, v in values.items() if k not in
                                 ("hostfile", "num_ranks", "backend", "accept_new_host_keys",
                                  "logits", "as_json", "starting_port", "connections_per_ip",
                                  "heartbeat_timeout", "start_timeout", "stall_timeout",
                                  "verbose")})  # fmt: skip
    assert spec.request.sampling.top_k == 0 and spec.request.sampling.seed is None


# Penalties and stop strings as units.

VOCAB = 8


def test_min_tokens_to_keep_leaves_min_p_that_many_tokens():
    """--min-p 1 keeps only the likeliest token, unless --min-tokens-to-keep says more."""
    logprobs = mx.log(mx.array([[0.5, 0.3, 0.2, 0, 0, 0, 0, 0]]))

    def drawn(**options) -> set[int]:
        sample = sampler(SharedRequest(seeded(Sampling(temp=1.0, min_p=1.0, seed=0, **options))))
        mx.random.seed(0)
        return {sample(logprobs).item() for _ in range(200)}

    assert drawn() == {0}
    assert drawn(min_tokens_to_keep=2) == {0, 1}
    assert drawn(min_tokens_to_keep=3) == {0, 1, 2}


def test_presence_penalty_skips_the_prompt():
    logits = mx.zeros((1, VOCAB))
    tokens = mx.array([1, 2, 3, 5, 5])  # prompt 1 2 3, generated 5 5
    out = presence_penalty(1.5, prompt_len=3)(tokens, logits)
    assert out.tolist() == [[0, 0, 0, 0, 0, -1.5, 0, 0]]  # once, however often it came


def test_presence_penalty_ignores_ids_outside_the_logits():
    logits = mx.zeros((1, VOCAB))
    tokens = mx.array([1, 9, 300, -1, 4])  # ids an added-token tokenizer can give
    out = presence_penalty(2.0, prompt_len=1)(tokens, logits)
    assert out.tolist() == [[0, 0, 0, 0, -2.0, 0, 0, 0]]


def test_presence_penalty_with_nothing_generated():
    logits = mx.ones((1, VOCAB))
    out = presence_penalty(2.0, prompt_len=3)(mx.array([1, 2, 3]), logits)
    assert out.tolist() == logits.tolist()


def test_repetition_penalty_is_sign_aware_and_skips_the_prompt():
    logits = mx.array([[2.0, -2.0, 2.0, 4.0, 0, 0, 0, 0]])
    tokens = mx.array([3, 0, 1, 12])  # prompt 3; generated 0, 1 and an id out of range
    out = repetition_penalty(2.0, prompt_len=1)(tokens, logits)
    assert out.tolist() == [[1.0, -4.0, 2.0, 4.0, 0, 0, 0, 0]]


def test_stop_text_holds_back_a_possible_start():
    text = StopText(["</end>", "STOP"])
    assert text.feed("hello <") == ("hello ", False)  # "<" could begin "</end>"
    assert text.feed("/en") == ("", False)
    assert text.feed("d> rest") == ("", True)  # nothing of the stop string is shown
    text = StopText(["</end>", "STOP"])
    assert text.feed("a <b") == ("a <b", False)
    assert text.feed("c ST") == ("c ", False)
    assert text.flush() == "ST"  # the answer ended: what was held back is text


def test_stop_text_without_stops_passes_through():
    text = StopText([])
    assert text.feed("abc") == ("abc", False)
    assert text.flush() == ""
