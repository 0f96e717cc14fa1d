"""Reasoning markers normalised to <think>...</think> (scripted streams), and the chat
template's switches end to end."""

import json

import pytest

from tests.support.processes import run_cli
from tests.support.tiny import make_model

THINK_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>\n{% endif %}"
    "{% endif %}"
)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    return make_model(
        tmp_path_factory.mktemp("think") / "m",
        "qwen2",
        seed=4,
        chat_template=THINK_TEMPLATE,
        extra_special=["<think>", "</think>"],
    )


def single_process(model_dir, **template_args) -> str:
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about lists"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, tools=TOOLS, **template_args
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return generate(model, tokenizer, ids, max_tokens=20, sampler=make_sampler(0.0))


@pytest.mark.parametrize("thinking", [True, False])
def test_template_switches_reach_the_template(thinker, tmp_path, thinking):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    p = run_cli(
        "launch", "--model", thinker, "--max-tokens", 20, "--system", "Be brief.",
        "--tools", tools, "--thinking" if thinking else "--no-thinking", "Tell me about lists",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    expected = single_process(thinker, enable_thinking=thinking)
    if thinking:  # the template opened the block: the stream starts with it
        assert p.stdout == "<think>" + expected
    else:
        assert p.stdout == expected
