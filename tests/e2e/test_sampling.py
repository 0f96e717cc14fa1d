"""Sampling, penalties, stop strings and the answer's stats, on every rank alike."""

import json

import mlx.core as mx
import pytest

from tests.support.processes import run_cli
from tests.support.reference import reference

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


def test_other_seed_other_text(models):
    texts = {
        run_cli("launch", "--model", models["llama"], "--max-tokens", 30, "--temp", 0.8,
                "--seed", seed, PROMPT).stdout
        for seed in (1, 2)
    }  # fmt: skip
    assert len(texts) == 2


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
