"""Reasoning markers normalised to <think>...</think> (scripted streams), and the chat
template's switches end to end."""

import json

import pytest
from conftest import invoke, run_cli
from tiny import make_model

from node.reasoning import Rewrite, held_back, normalizer, opens_in_thought


class Scripted:
    """What mlx-lm's tokenizer wrapper tells about a family's think markers."""

    def __init__(self, start, end, ids=None):
        self.think_start, self.think_end = start, end
        self.has_thinking = start is not None
        self.ids = ids or {}

    def rfind_think_start(self, tokens):
        return max((i for i, t in enumerate(tokens) if t == self.ids.get("start")), default=-1)

    def rfind_think_end(self, tokens):
        return max((i for i, t in enumerate(tokens) if t == self.ids.get("end")), default=-1)


def run(rewrite: Rewrite, segments: list[str]) -> list[str]:
    shown = [rewrite.feed(s) for s in segments]
    return [*shown, rewrite.flush()]


def test_channel_markers_become_think_tags_across_segment_boundaries():
    rewrite = normalizer(Scripted("<|channel>thought", "<channel|>"))
    shown = run(rewrite, ["<|chan", "nel>thou", "ght", "Let me see", "<chan", "nel|>", "Paris"])
    assert "".join(shown) == "<think>Let me see</think>Paris"
    assert shown[:3] == ["", "", "<think>"]  # nothing of a half marker leaks out


def test_xtml_markers():
    rewrite = normalizer(Scripted("<|open|>think<|sep|>", "<|close|>think<|sep|>"))
    text = "".join(run(rewrite, ["<|open|>think<|sep|>a<b", "<|close|>think<|sep|>c"]))
    assert text == "<think>a<b</think>c"


def test_plain_think_tags_pass_unchanged_and_so_does_text_without_markers():
    rewrite = normalizer(Scripted("<think>", "</think>"))
    assert "".join(run(rewrite, ["<th", "ink>x</th", "ink>y"])) == "<think>x</think>y"
    none = normalizer(Scripted(None, None))
    assert run(none, ["a <", "b"]) == ["a <", "b", ""]


def test_a_partial_marker_at_the_end_is_text():
    rewrite = normalizer(Scripted("<longcat_think>", "</longcat_think>"))
    assert "".join(run(rewrite, ["1 < 2 and <long"])) == "1 < 2 and <long"


def test_held_back():
    assert held_back("abc <|ch", ["<|channel>"]) == 4
    assert held_back("abc", ["<|channel>"]) == 0
    assert held_back("", ["x"]) == 0


def test_prompt_that_opens_a_thought():
    tok = Scripted("<think>", "</think>", ids={"start": 7, "end": 8})
    assert opens_in_thought(tok, [1, 2, 7])  # the template ended with <think>
    assert not opens_in_thought(tok, [1, 7, 3, 8, 2])  # an earlier, closed block
    assert not opens_in_thought(Scripted(None, None), [1, 7])


# End to end: the chat template's switches, system prompt and tools, and its <think> opening.

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


@pytest.mark.e2e
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


def test_bad_tools_file(thinker, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text('{"name": "x"}')
    p = invoke("launch", "--model", thinker, "--tools", tools, "hi")
    assert p.returncode == 2
    assert "want a JSON list of tool objects" in p.stderr
