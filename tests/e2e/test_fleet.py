"""`serve` as a fleet: a hostfile's two groups of two modes (tensor 2 and one pipeline rank)
behind one endpoint. Concurrent answers equal the single-process ones whichever group gave
them; a conversation's later turns go to the group that cached its start; a killed rank's
group restarts while the other answers every request."""

from __future__ import annotations

import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from tests.support.processes import _children, _cmdline, descendant_ranks
from tests.support.reference import reference
from tests.support.serving import PROMPT, Load, Served, get, wait_for

openai = pytest.importorskip("openai")

QUESTIONS = [PROMPT, "Name a color.", "Count to five.", "What is a list?"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.support.tiny import make_model

    return make_model(tmp_path_factory.mktemp("fleet") / "m", "qwen2", seed=2, chat_template=True)


@pytest.fixture(scope="module")
def fleet(model, tmp_path_factory):
    hostfile = tmp_path_factory.mktemp("fleet-hosts") / "hosts.yaml"
    hostfile.write_text(
        yaml.safe_dump(
            {
                "hosts": [{"ssh": "localhost", "slots": 2}, {"ssh": "127.0.0.1"}],
                "groups": [
                    {"hosts": ["localhost"], "mode": "tensor"},
                    {"hosts": ["127.0.0.1"], "mode": "pipeline"},
                ],
            }
        )  # fmt: skip
    )
    served = Served(model, "--hostfile", str(hostfile), "--heartbeat-timeout", "5")
    try:
        wait_for(lambda: get(served, "/health")[1]["groups_ready"] == 2)
        yield served
    finally:
        if served.proc.poll() is None:  # the last test stops it (its restarted ranks are its)
            assert served.stop() == 0, "".join(served.log)


def chat(client, messages, max_tokens=12, **kw):
    return client.chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def answered(served) -> list[int]:
    return [g["answered"] for g in get(served, "/health")[1]["groups"]]


def test_two_groups_answer_at_once_as_one_process_would(fleet, model):
    health = get(fleet, "/health")[1]
    assert [g["mode"] for g in health["groups"]] == ["tensor", "pipeline"], health
    assert [g["ranks"] for g in health["groups"]] == [2, 1], health
    expected = {q: reference(model, q, 12) for q in QUESTIONS}
    before = answered(fleet)
    asks = [(q, i % 2 == 0) for i, q in enumerate(QUESTIONS * 3)]  # half of them streamed

    def text(ask) -> str:
        question, stream = ask
        messages = [{"role": "user", "content": question}]
        if not stream:
            return chat(fleet.client, messages).choices[0].message.content
        chunks = chat(fleet.client, messages, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(text, asks))
    for (q, _), answer in zip(asks, got, strict=True):
        assert answer == expected[q], q
    after = answered(fleet)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)  # both served
    status, metrics, _ = get(fleet, "/metrics")
    assert re.search(r'mlx_cluster_group_ready\{group="1"\} 1.0', metrics), metrics
    assert re.search(r'mlx_cluster_rank_heartbeat_age_seconds\{group="0",host="localhost",'
                     r'rank="1"\}', metrics)  # fmt: skip
    page = json.loads(get(fleet, "/v1/cluster")[1])
    assert [g["group"] for g in page["groups"]] == [0, 1] and len(page["hosts"]) == 2, page


def test_later_turns_go_to_the_group_that_cached_the_start(fleet):
    """Each conversation's turns 2 and 3 land on the group that answered its turn 1 (their
    prompt starts with turn 1's), without a session key; a session key alone keeps a
    conversation whose prompts share nothing on its group."""
    system = {"role": "system", "content": "You answer briefly. " * 30}
    for n in range(3):
        messages = [system, {"role": "user", "content": f"Conversation {n}: say hello."}]
        groups = []
        for turn in range(3):
            before = answered(fleet)
            answer = chat(fleet.client, messages)
            after = answered(fleet)
            groups.append([a - b for a, b in zip(after, before, strict=True)].index(1))
            if turn:
                assert answer.usage.prompt_tokens_details.cached_tokens > 0, answer.usage
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": f"And turn {turn + 1}?"}]  # fmt: skip
        assert groups == [groups[0]] * 3, groups
    for n in range(2):
        groups = []
        for turn in range(3):
            before = answered(fleet)
            chat(fleet.client, [{"role": "user", "content": f"unrelated {n} {turn}"}],
                 user=f"session-{n}")  # fmt: skip
            after = answered(fleet)
            groups.append([a - b for a, b in zip(after, before, strict=True)].index(1))
        assert groups == [groups[0]] * 3, groups
    metrics = get(fleet, "/metrics")[1]
    assert re.search(r'mlx_cluster_routed_total\{group="\d",reason="prefix"\}', metrics)
    assert re.search(r'mlx_cluster_routed_total\{group="\d",reason="session"\}', metrics)


def group_ranks(served) -> dict[str, list[int]]:
    """The job folder of each group's current ranks -> their pids."""
    found: dict[str, list[int]] = {}
    for pid in descendant_ranks(served.proc.pid, _children(), _cmdline):
        m = re.search(r"(\S+)/rank\d+/", _cmdline(pid))
        if m:
            found.setdefault(m[1], []).append(pid)
    return found


def test_a_killed_rank_restarts_its_group_while_the_other_answers(fleet):
    expected = reference(fleet_model(fleet), PROMPT, 16)
    load = Load(fleet, 4, expected, 16)
    try:
        wait_for(lambda: load.ok() >= 8)
        tensor = next(pids for pids in group_ranks(fleet).values() if len(pids) == 2)
        os.kill(max(tensor), signal.SIGKILL)  # the tensor group's second rank (a guess, either)
        health = wait_for(
            lambda: (h := get(fleet, "/health")[1])["groups"][0]["restarts"] == 1 and h
        )
        before = load.ok()
        wait_for(lambda: load.ok() >= before + 8)  # answered meanwhile, by group 1
        wait_for(lambda: get(fleet, "/health")[1]["groups_ready"] == 2)
        # the restart left no rank of the first job behind
        assert len([p for pids in group_ranks(fleet).values() for p in pids]) == 3
        before = load.ok()
        wait_for(lambda: load.ok() >= before + 8)
        outcomes = load.finish()
    finally:
        load.stop.set()
        code = fleet.stop()  # here: the restarted group's ranks are this test's to stop
    print(f"outcomes: {dict(outcomes)}")
    assert code == 0
    assert health["groups"][1]["restarts"] == 0, health
    assert set(outcomes) <= {"ok", "ok stream", "cut"}, outcomes  # no plain request failed
    log = "".join(fleet.log)
    assert "group 0: restarting the ranks" in log, log
    assert "group 1: restarting" not in log


def fleet_model(served) -> str:
    return served.proc.args[served.proc.args.index("--model") + 1]
