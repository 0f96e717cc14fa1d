"""`serve --prefill-groups 1` (issue 53): a hostfile's pipeline-2 group prefills long prompts
and hands their KV to a tensor-2 group, which decodes them (each prefill rank sends its layers,
re-cut to each decode rank's heads). Greedy answers equal the single-process ones; the decode
group's prompt cache (memory and disk) holds the handed-off prefix for the next turn; short
prompts prefill where they decode; a killed prefill rank costs no answer (the decode group
prefills the prompt itself)."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request

import pytest
import yaml

from tests.support.processes import _children, _cmdline, descendant_ranks
from tests.support.reference import reference
from tests.support.serving import Served, get, wait_for

LONG = "Summarize this: " + " ".join(f"item {i} is a list of things" for i in range(40))
SHORT = "Name a color."
TOKENS = 12


@pytest.fixture(scope="module")
def split(models, tmp_path_factory):
    base = tmp_path_factory.mktemp("handoff")
    hostfile = base / "hosts.yaml"
    hostfile.write_text(yaml.safe_dump({
        "hosts": [{"ssh": "127.0.0.1", "slots": 2}, {"ssh": "localhost", "slots": 2}],
        "groups": [{"hosts": ["127.0.0.1"]}, {"hosts": ["localhost"], "mode": "tensor"}],
    }))  # fmt: skip
    disk = ["--prompt-cache-disk-gb", "1", "--prompt-cache-dir", str(base / "disk")]
    served = Served(models["qwen2"], "--hostfile", str(hostfile), "--prefill-groups", "1",
                    "--disaggregate-min-tokens", "64", "--heartbeat-timeout", "5",
                    *disk)  # fmt: skip
    try:
        wait_for(lambda: get(served, "/health")[1]["groups_ready"] == 2)
        served.disk = base / "disk"
        yield served
    finally:
        if served.proc.poll() is None:
            assert served.stop() == 0, "".join(served.log)


def chat(served, messages: list[dict], model: str = "qwen2") -> dict:
    """The raw answer (its timings say whether a prefill group prefilled it)."""
    body = {"model": model, "messages": messages, "max_tokens": TOKENS, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{served.port}/v1/chat/completions",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    return json.loads(urllib.request.urlopen(req, timeout=180).read())


def plans_with_blocks(folder) -> int:
    """How many plans (one per rank of a layout) hold blocks in the disk tier's store."""
    from node.cache.disk import BLOCK_NAME, STORE

    plans = {
        p.parent.parent for p in (folder / STORE).glob("*/*/*") if BLOCK_NAME.fullmatch(p.name)
    }
    return len(plans)


def text(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


def test_a_long_prompt_is_prefilled_by_the_prefill_group_and_answers_as_one_process(split, models):
    health = get(split, "/health")[1]
    assert [(g["mode"], g["ranks"]) for g in health["groups"]] == [("pipeline", 2), ("tensor", 2)]
    first = chat(split, [{"role": "user", "content": LONG}])
    assert text(first) == reference(models["qwen2"], LONG, TOKENS)
    t = first["timings"]
    prompt = first["usage"]["prompt_tokens"]
    assert t["handoff_n"] == prompt - 1 and t["handoff_bytes"] > 0 and t["handoff_group"] == 0, t
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1  # the KV came
    metrics = get(split, "/metrics")[1]
    assert re.search(r'mlx_cluster_handoffs_total\{group="0"\} 1.0', metrics), metrics
    # each decode rank's door says what it holds: nothing, once the handoff was adopted
    held = r'mlx_cluster_rank_handoff_held_bytes\{group="1",host="[^"]+",rank="{}"\} 0.0'
    wait_for(lambda: all(re.search(held.replace("{}", str(r)), get(split, "/metrics")[1])
                         for r in (0, 1)))  # fmt: skip
    handed = json.loads(get(split, "/v1/cluster")[1])["handoffs"]  # what the page shows
    assert handed["count"] == 1 and handed["bytes"] == t["handoff_bytes"], handed
    assert handed["p50_s"] == pytest.approx(t["handoff_ms"] / 1000), handed
    # the decode group's disk tier holds the handed-off prompt too (each rank its share)
    wait_for(lambda: plans_with_blocks(split.disk) == 2)  # the prefill group keeps none
    # the next turn: the decode group's prompt cache holds the first turn, nothing handed off
    turn = [{"role": "user", "content": LONG}, {"role": "assistant", "content": text(first)},
            {"role": "user", "content": SHORT}]  # fmt: skip
    second = chat(split, turn)
    assert "handoff_n" not in second["timings"], second["timings"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt - 1, second
    # a short prompt prefills where it decodes
    short = chat(split, [{"role": "user", "content": SHORT}])
    assert text(short) == reference(models["qwen2"], SHORT, TOKENS)
    assert "handoff_n" not in short["timings"], short["timings"]


def test_a_killed_prefill_rank_costs_no_answer(split, models):
    """The prefill group's rank killed: the long prompt is prefilled by the decode group (at
    once, not after the handoff's wait); the group restarts and hands off again."""
    want = reference(models["qwen2"], LONG + " Again.", TOKENS)
    (prefill,) = [p for p in descendant_ranks(split.proc.pid, _children(), _cmdline)
                  if role_of(p) == "prefill" and "/rank1/" in _cmdline(p)]  # fmt: skip
    os.kill(prefill, signal.SIGKILL)
    answer = chat(split, [{"role": "user", "content": LONG + " Again."}])
    assert text(answer) == want
    assert "handoff_n" not in answer["timings"], answer["timings"]
    wait_for(lambda: get(split, "/health")[1]["groups"][0]["restarts"] == 1)
    wait_for(lambda: get(split, "/health")[1]["groups_ready"] == 2)
    again = chat(split, [{"role": "user", "content": "Once more. " + LONG}])
    assert text(again) == reference(models["qwen2"], "Once more. " + LONG, TOKENS)
    assert again["timings"]["handoff_n"] > 0, again["timings"]
    assert split.stop() == 0, "".join(split.log)


def role_of(pid: int) -> str:
    """A rank's group role, from the job file its command line names."""
    path = re.search(r"(\S+/rank\d+/job\.json)", _cmdline(pid))
    assert path, _cmdline(pid)
    return json.loads(open(path[1]).read())["handoff"]["role"]


def test_a_hybrid_models_9k_token_prompt_is_handed_off_and_answers_as_one_process(tmp_path):
    """Qwen3.5's linear attention (issue 63): the layers' states come whole once the prompt
    is prefilled (pipeline 2 to pipeline 2, on this machine without a hostfile), the
    full-attention layers' KV a chunk at a time; the text is single-process mlx-lm's, and
    the next turn starts from the handed-off state."""
    from tests.e2e.test_serve import conversation_reference
    from tests.support.long_context import long_text
    from tests.support.tiny import FAMILIES, make_model

    # attention over 9k tokens is what costs on this CPU (~70M exp/s): 2 heads, 1 layer of 4
    text_config = {**FAMILIES["qwen3_5"]["text_config"], "max_position_embeddings": 16384,
                   "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 4,
                   "full_attention_interval": 4}  # fmt: skip
    model = make_model(tmp_path / "qwen3_5", "qwen3_5", seed=1, chat_template=True,
                       text_config=text_config)  # fmt: skip
    served = Served(model, "-n", "4", "--replicas", "2", "--prefill-groups", "1",
                    "--mode", "pipeline", "--disaggregate-min-tokens", "64")  # fmt: skip
    try:
        wait_for(lambda: get(served, "/health")[1]["groups_ready"] == 2)
        messages = [{"role": "user", "content": long_text(model, 9000)}]
        first = chat(served, messages, model.name)
        assert text(first) == conversation_reference(model, messages, TOKENS)
        t, prompt = first["timings"], first["usage"]["prompt_tokens"]
        assert prompt >= 9000 and t["handoff_n"] == prompt - 1 and t["handoff_bytes"] > 0, t
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
        print(
            f"\nqwen3_5: {prompt} tokens handed off, {t['handoff_bytes']} bytes in "
            f"{t['handoff_ms']} ms"
        )
        second = [*messages, {"role": "assistant", "content": text(first)},
                  {"role": "user", "content": "And tuples?"}]  # fmt: skip
        again = chat(served, second, model.name)
        assert text(again) == conversation_reference(model, second, TOKENS)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt - 1
    finally:
        assert served.stop() == 0, "".join(served.log)
