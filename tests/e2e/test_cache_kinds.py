"""This year's cache kinds through serve's prompt cache, as a user runs an agent on them: a
conversation's second turn reads its first prompt from memory, and after a restart from each
rank's disk, with single-process mlx-lm's text. Qwen3.5's linear attention (ArraysCache) in
pipeline mode, gpt-oss's sliding windows (RotatingKVCache) in tensor mode: neither can be cut
back, so both start from snapshots (node.cache.snapshots); the same for every family of
docs/models.md in one process: tests/fast/test_snapshots.py."""

from __future__ import annotations

import pytest

from node.cache.disk import BLOCK_TOKENS
from tests.e2e.test_serve import conversation_reference
from tests.support.long_context import long_text
from tests.support.processes import rank_pids
from tests.support.serving import Served
from tests.support.tiny import as_vision_conversion, make_model


@pytest.fixture(autouse=True)
def no_stray_ranks():
    yield
    assert rank_pids() == []


@pytest.mark.parametrize("family,mode", [("qwen3_5", "pipeline"), ("gpt_oss", "tensor"),
                                         ("deepseek_v41", "pipeline")])  # fmt: skip
def test_a_second_turn_reads_its_first_prompt_from_memory_then_from_disk(tmp_path, family, mode):
    """(qwen3_5 as a vision-language conversion, as mlx-community ships it: served as text.
    deepseek_v41's LayerCache cannot batch: its requests are decoded alone, one stream's
    cache kept between them, in memory only: the disk tier is off, and says so.)"""
    model = make_model(tmp_path / family, family, seed=1, chat_template=True)
    if family == "qwen3_5":
        model = as_vision_conversion(model, tmp_path / f"{family}-vision")
    flags = ["-n", "2", "--mode", mode, "--prompt-cache-disk-gb", "1",
             "--prompt-cache-dir", str(tmp_path / "disk")]  # fmt: skip
    first = [{"role": "user", "content": long_text(model, 1100)}]

    references: dict[int, str] = {}  # single-process mlx-lm's, by turn

    def ask(server: Served, messages: list) -> tuple[str, int, int]:
        r = server.client.chat.completions.create(model=model.name, messages=messages,
                                                  max_tokens=8, temperature=0)  # fmt: skip
        text = r.choices[0].message.content
        if len(messages) not in references:
            references[len(messages)] = conversation_reference(model, messages, 8)
        assert text == references[len(messages)]
        return text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    served = Served(model, *flags)
    try:
        answer, prompt, cached = ask(served, first)
        assert cached == 0
        second = [*first, {"role": "assistant", "content": answer},
                  {"role": "user", "content": "And tuples?"}]  # fmt: skip
        _, _, cached = ask(served, second)
        print(f"\n{family} {mode}: second turn read {cached} of the first's {prompt} tokens")
        assert cached >= 0.9 * prompt and cached >= prompt - 1
    finally:
        assert served.stop() == 0  # the drain: the snapshots' blocks are on disk
    if family == "deepseek_v41":
        assert any("disk" in line and "off" in line for line in served.log), "".join(served.log)
        return
    again = Served(model, *flags)
    try:
        _, _, cached = ask(again, second)
        print(f"after a restart: {cached} from disk")
        assert cached == (prompt - 1) // BLOCK_TOKENS * BLOCK_TOKENS  # the last block boundary
        assert cached >= 0.9 * prompt
    finally:
        assert again.stop() == 0
