"""Sampling, penalties, stop strings and the answer's stats, on every rank alike."""

import mlx.core as mx

from cluster.core.spec import Sampling, SharedRequest
from node.decode.sampling import (
    presence_penalty,
    processors,
    repetition_penalty,
    sampler,
    seeded,
)
from node.decode.text import StopText
from tests.support.processes import invoke

PROMPT = "Tell me about lists"


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


def test_the_penalties_look_back_over_the_context_size_asked():
    """--repetition-context-size (repetition_context_size in a request): how many of the
    latest generated tokens each penalty sees; a token generated earlier is forgiven."""
    tokens = mx.array([7, 1, 2, 3, 4])  # prompt 7; generated 1 2 3 4
    logits = mx.zeros((1, VOCAB))
    request = SharedRequest(Sampling(presence_penalty=1.0, repetition_context_size=2), [7])
    (process,) = processors(request, prompt_len=1)
    assert process(tokens, logits).tolist() == [[0, 0, 0, -1, -1, 0, 0, 0]]
    wide = SharedRequest(Sampling(presence_penalty=1.0), [7])  # the default, 20
    assert processors(wide, 1)[0](tokens, logits).tolist() == [[0, -1, -1, -1, -1, 0, 0, 0]]
    p = invoke("launch", "--repetition-context-size", "0", PROMPT)
    assert p.returncode == 2 and "Invalid value for '--repetition-context-size'" in p.stderr


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
