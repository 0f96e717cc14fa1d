"""The embedded default model answers on topic: a question about a topic of Python's own help
gets that topic's text, greedy, through its chat template (tests/tools/train_default.py trains it).
End to end through `launch`: tests/e2e/test_launch.py, the README's command."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import generate, load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from cluster.core.modelcheck import default_model_path

# question -> words its answer must hold; the last two ask in a way training never used (one of
# the two held-out ways: docs/default-model.md says how often each kind lands on its topic)
ON_TOPIC = {
    "Tell me about lists": ["list display", "square brackets"],
    "What is a dictionary?": ["mapping", "dictionary"],
    "Explain for loops.": ['"for" statement', "iterate"],
    "Tell me about exceptions": ["exception", "error"],
    "What is a lambda?": ["anonymous functions"],
    "How do classes work?": ["class definition"],
    "Give me an overview of dictionaries.": ["mapping", "dictionary"],
    "Give me an overview of generators.": ["yield"],
}


@pytest.fixture(scope="module")
def default_model():
    return load(str(default_model_path()))


def answer(model, tokenizer, messages: list[dict[str, str]], max_tokens: int = 40) -> str:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(0.0))


@pytest.mark.parametrize("question", list(ON_TOPIC))
def test_a_question_gets_its_topics_text(default_model, question):
    text = answer(*default_model, [{"role": "user", "content": question}])
    for word in ON_TOPIC[question]:
        assert word in text, (question, text)


def test_a_second_turn_answers_the_second_question(default_model):
    model, tokenizer = default_model
    first = answer(model, tokenizer, [{"role": "user", "content": "Tell me about lists"}], 200)
    turns = [{"role": "user", "content": "Tell me about lists"},
             {"role": "assistant", "content": first},
             {"role": "user", "content": "What is a lambda?"}]  # fmt: skip
    assert "anonymous functions" in answer(model, tokenizer, turns)


def test_it_has_a_chat_template_and_ends_its_answers(default_model):
    model, tokenizer = default_model
    assert tokenizer.has_chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert text == "Question: hi\nAnswer:"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is None?"}],
                                           add_generation_prompt=True)  # fmt: skip
    steps = generate_step(mx.array(prompt), model, sampler=make_sampler(0.0), max_tokens=200)
    assert tokenizer.eos_token_id in [int(t) for t, _ in steps]  # it stops by itself
