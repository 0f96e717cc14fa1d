"""Reasoning markers normalised to <think>...</think> (scripted streams), and the chat
template's switches end to end."""

import pytest

from node.decode.reasoning import Rewrite, held_back, normalizer, opens_in_thought
from tests.support.processes import invoke
from tests.support.tiny import make_model


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


THINK_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>\n{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    return make_model(
        tmp_path_factory.mktemp("think") / "m",
        "qwen2",
        seed=4,
        chat_template=THINK_TEMPLATE,
        extra_special=["<think>", "</think>"],
    )


def test_bad_tools_file(thinker, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text('{"name": "x"}')
    p = invoke("launch", "--model", thinker, "--tools", tools, "hi")
    assert p.returncode == 2
    assert "want a JSON list of tool objects" in p.stderr
