"""A fleet's parts without ranks: the groups a hostfile or --replicas makes, the prompt's
prefix chain, the router's choices (prefix, load, session, a group restarting), a failed
group's requests handed to the others, rank 0's report of its cached prefixes, group logs."""

from __future__ import annotations

import dataclasses
import io
import json
from collections import Counter

import pytest

from cluster.core.hostfile import HostfileError, hostfile_data, local_hostfile, parse_hostfile
from cluster.core.prefix import MESSAGE_CHARS, longest_held, prefix_chain
from cluster.core.protocol import Admitted, Cached, Serving, Stats
from cluster.core.spec import JobSpec, KVQuant, LaunchSettings, ServeSettings
from cluster.job.launcher import LaunchError
from cluster.job.state import JobState, RankState
from cluster.serve.api.shared import session_of
from cluster.serve.fleet import STREAM_TOKENS, Fleet, GroupLog, plan_groups
from cluster.serve.metrics import Metrics
from cluster.serve.service import Service
from node.jobs.serve import CachedPrefixes
from tests.support.serving import request, wait_for


def asking(**fields):
    """A request as the API makes it: its session read from its body."""
    req = request(False, **fields)
    req.session = session_of(fields)
    return req


def spec(**serve) -> JobSpec:
    return JobSpec(model="m", command="serve", serve=ServeSettings(**serve))


def test_a_hostfile_names_its_groups_and_their_modes():
    hf = parse_hostfile({
        "hosts": ["a.local", "b.local", {"ssh": "c.local", "slots": 2}],
        "groups": [{"hosts": ["a.local", 1], "mode": "tensor"}, {"hosts": ["c.local"]}],
    })  # fmt: skip
    plans = plan_groups(hf, spec(), LaunchSettings(), 1)
    assert [[h.target for h in p.hostfile.hosts] for p in plans] == [
        ["a.local", "b.local"], ["c.local"]]  # fmt: skip
    assert [p.spec.mode for p in plans] == ["tensor", "pipeline"]
    assert [h.index for h in plans[1].hostfile.hosts] == [2]  # logs still name host 2


@pytest.mark.parametrize(
    "groups, says",
    [
        ([{"hosts": ["a.local"]}], "host 1 (b.local) in no group"),
        ([{"hosts": ["a.local", "b.local"]}, {"hosts": ["b.local"]}], "already in group 0"),
        ([{"hosts": ["x.local"]}], "'x.local' is not in 'hosts'"),
        ([{"hosts": ["a.local", "b.local"], "mode": "ring"}], "field 'mode' must be one of"),
        ([{"hosts": ["a.local", "b.local"], "size": 2}], "unknown field(s) size"),
        (
            [{"hosts": ["a.local"], "role": "prefill"}, {"hosts": ["b.local"], "role": "ask"}],
            "field 'role' must be one of prefill, decode",
        ),
        (
            [{"hosts": ["a.local"], "role": "prefill"}, {"hosts": ["b.local"], "role": "prefill"}],
            "every group has role prefill",
        ),
        ([], "non-empty list"),
    ],
)
def test_a_bad_group_is_named(groups, says):
    with pytest.raises(HostfileError, match=None) as e:
        parse_hostfile({"hosts": ["a.local", "b.local"], "groups": groups}, "rig.yaml")
    assert says in str(e.value) and "rig.yaml" in str(e.value)


def test_prefill_groups_get_their_role_and_the_fleets_key():
    """--prefill-groups K: the first K groups prefill, the rest decode, all with one secret
    for the decode ranks' doors; a hostfile's 'role: prefill' says the same; no prefill
    group: no role, no key; every group prefilling, or one group: refused."""
    four = parse_hostfile({"hosts": ["a", "b", "c", "d"]})
    plans = plan_groups(four, spec(prefill_groups=1), LaunchSettings(), 2)
    assert [p.spec.handoff.role for p in plans] == ["prefill", "decode"]
    assert len({p.spec.handoff.key for p in plans}) == 1 and len(plans[0].spec.handoff.key) == 64
    assert [p.spec.handoff.role for p in plan_groups(four, spec(), LaunchSettings(), 2)] == [
        "both", "both"]  # fmt: skip
    named = parse_hostfile({"hosts": ["a", "b"], "groups": [
        {"hosts": ["a"]}, {"hosts": ["b"], "role": "prefill"}]})  # fmt: skip
    assert [p.spec.handoff.role for p in plan_groups(named, spec(), LaunchSettings(), 1)] == [
        "decode", "prefill"]  # fmt: skip
    assert hostfile_data(named)["groups"][1] == {"hosts": ["b"], "role": "prefill"}
    with pytest.raises(HostfileError, match="at least one must decode"):
        plan_groups(four, spec(prefill_groups=2), LaunchSettings(), 2)
    with pytest.raises(HostfileError, match="makes group 1 decode, but rig.yaml gives it "
                                            "'role: prefill'"):  # fmt: skip
        plan_groups(dataclasses.replace(named, path="rig.yaml"), spec(prefill_groups=1),
                    LaunchSettings(), 1)  # fmt: skip
    with pytest.raises(HostfileError, match="needs several groups"):
        plan_groups(four, spec(prefill_groups=1), LaunchSettings(), 1)
    quantized = JobSpec(model="m", command="serve", serve=ServeSettings(prefill_groups=1),
                        kv_quant=KVQuant(kv_bits=4))  # fmt: skip
    with pytest.raises(HostfileError, match="cannot hand off a quantized KV cache"):
        plan_groups(four, quantized, LaunchSettings(), 2)


def test_prefill_groups_never_override_the_roles_a_hostfile_gives():
    """--prefill-groups K with a hostfile's roles: where they agree, the same plan; a group
    the hostfile says decodes that K would make prefill is refused naming both (before: it
    silently prefilled)."""
    hosts = ["a", "b", "c"]
    decode_first = parse_hostfile({"hosts": hosts, "groups": [
        {"hosts": ["a"], "role": "decode"}, {"hosts": ["b"]}, {"hosts": ["c"]}]})  # fmt: skip
    with pytest.raises(HostfileError, match="makes group 0 prefill, but <hostfile> gives "
                                            "it 'role: decode'"):  # fmt: skip
        plan_groups(decode_first, spec(prefill_groups=1), LaunchSettings(), 1)
    agreeing = parse_hostfile({"hosts": hosts, "groups": [
        {"hosts": ["a"], "role": "prefill"}, {"hosts": ["b"], "role": "decode"},
        {"hosts": ["c"]}]})  # fmt: skip
    plans = plan_groups(agreeing, spec(prefill_groups=1), LaunchSettings(), 1)
    assert [p.spec.handoff.role for p in plans] == ["prefill", "decode", "decode"]
    roles = plan_groups(decode_first, spec(), LaunchSettings(), 1)
    assert [p.spec.handoff.role for p in roles] == ["both", "both", "both"]


def test_replicas_of_one_local_host_keep_every_field_of_it():
    """``--replicas 2`` on a hostfile of one local host: each group's host keeps its device,
    memory, model folder, python and cwd (before: device, memory_gb and model_dir went)."""
    hf = parse_hostfile({"hosts": [{"ssh": "localhost", "slots": 4, "device": "cpu",
                                    "memory_gb": 64, "model_dir": "/models", "python": "/py",
                                    "cwd": "/w"}]})  # fmt: skip
    plans = plan_groups(hf, spec(), LaunchSettings(), 2)
    for g, plan in enumerate(plans):
        (host,) = plan.hostfile.hosts
        assert (host.index, host.slots, host.device, host.memory_gb, host.model_dir,
                host.python, host.cwd) == (g, 2, "cpu", 64, "/models", "/py", "/w")  # fmt: skip


def test_a_group_naming_a_target_two_hosts_share_is_refused():
    """Two hosts with the same ssh target (two slots' worth written twice): a group that
    names the target is ambiguous (before: the last host won silently)."""
    with pytest.raises(HostfileError, match="'mac.local' names hosts 0, 1; name them by index"):
        parse_hostfile({"hosts": ["mac.local", "mac.local", "b.local"],
                        "groups": [{"hosts": ["mac.local"]}, {"hosts": [1, 2]}]})  # fmt: skip
    ok = parse_hostfile({"hosts": ["mac.local", "mac.local", "b.local"],
                         "groups": [{"hosts": [0]}, {"hosts": [1, 2]}]})  # fmt: skip
    assert [g.hosts for g in ok.groups] == [[0], [1, 2]]


def test_replicas_split_the_ranks_in_order():
    four = parse_hostfile({"hosts": ["a", "b", "c", "d"]})
    plans = plan_groups(four, spec(), LaunchSettings(), 2)
    assert [[h.target for h in p.hostfile.hosts] for p in plans] == [["a", "b"], ["c", "d"]]
    local = plan_groups(local_hostfile(4), spec(), LaunchSettings(starting_port=5000), 2)
    assert [p.hostfile.world_size for p in local] == [2, 2]
    # local groups share this machine: their ring ports must not overlap
    assert [p.launch.starting_port for p in local] == [5000, 5002]
    with pytest.raises(HostfileError, match="3 ranks do not split into 2"):
        plan_groups(local_hostfile(3), spec(), LaunchSettings(), 2)
    slots = parse_hostfile({"hosts": [{"ssh": "a", "slots": 3}, "b"]})
    with pytest.raises(HostfileError, match="would span two groups"):
        plan_groups(slots, spec(), LaunchSettings(), 2)


def test_the_prefix_chain_names_what_two_prompts_share():
    system = {"role": "system", "content": "be brief"}
    one = request(False, messages=[system, {"role": "user", "content": "hi"}]).request
    two = request(False, messages=[system, {"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "hello"},
                                   {"role": "user", "content": "more"}]).request  # fmt: skip
    other = request(False, messages=[system, {"role": "user", "content": "bye"}]).request
    a, b, c = prefix_chain(one), prefix_chain(two), prefix_chain(other)
    assert [x.name for x in a] == [x.name for x in b[: len(a)]]  # turn 2 starts with turn 1
    assert a[-1].name != c[-1].name and a[1] == c[1]  # the system message only
    assert longest_held(b, {x.name for x in a}) == a[-1].chars > 0
    tools = request(False, messages=one.messages,
                    tools=[{"type": "function", "function": {"name": "f"}}]).request  # fmt: skip
    assert prefix_chain(tools)[0] != a[0]  # the tools come first in the template: nothing shared


def fleet(groups: int = 2, **serve) -> tuple[Fleet, list[Service], list[list[bytes]]]:
    metrics = Metrics(lambda: [], groups=lambda: [])
    services = [
        Service(local_hostfile(1), spec(**serve), io.StringIO(), thread=False, metrics=metrics,
                group=i)
        for i in range(groups)
    ]  # fmt: skip
    sent: list[list[bytes]] = [[] for _ in services]
    for s, out in zip(services, sent, strict=True):
        s.attach(out.append, JobState([RankState(0, "localhost")]))
        s.on_event(0, Serving("m", True))
    return Fleet(services, metrics), services, sent


def group_of(f: Fleet, req) -> int:
    f.submit(req)
    return req.group


def test_the_group_holding_the_longest_prefix_wins_unless_it_is_far_busier():
    f, groups, _ = fleet()
    first = request(False, messages=[{"role": "user", "content": "x" * 4000}])
    chain = prefix_chain(first.request)
    groups[1].on_event(0, Cached([x.name for x in chain]))
    assert group_of(f, first) == 1
    assert f.metrics.routed.labels(group="1", reason="prefix")._value.get() == 1
    # a second request with nothing cached goes to the idle group
    assert group_of(f, request(False, messages=[{"role": "user", "content": "y"}])) == 0
    # the prefix saves ~1000 tokens of prefill; a group with more work than that loses it
    busy = request(False, messages=[{"role": "user", "content": "x" * 4000}])
    for i in range(5):
        groups[1].on_event(0, Cached([x.name for x in chain]))
        other = request(False, messages=[{"role": "user", "content": f"z{i}" * 600}])
        other.chain = prefix_chain(other.request)  # as the router sets it
        groups[1].take(other)
    assert groups[1].load.prompt_tokens > 1000 + groups[0].load.prompt_tokens
    assert group_of(f, busy) == 0


def test_least_work_counts_queued_prompt_tokens_and_streams():
    f, groups, _ = fleet()
    groups[0].take(request(True))
    flight = next(iter(groups[0].inflight.values()))
    flight.shown = True  # streaming
    groups[0].post(lambda: None)  # its load is measured after each call
    assert groups[0].load.streams == 1
    assert f.cost(request(False), groups[0])[0] - f.cost(request(False), groups[1])[0] == (
        STREAM_TOKENS)  # fmt: skip
    assert group_of(f, request(False)) == 1


def test_a_session_stays_on_its_group_while_it_has_room():
    f, groups, _ = fleet(decode_concurrency=2)
    a = asking(user="alice")
    assert group_of(f, a) == 0
    groups[1].on_event(0, Cached([x.name for x in prefix_chain(request(False).request)]))
    assert group_of(f, asking(user="alice")) == 0  # the session beats the prefix
    assert group_of(f, asking(metadata={"user_id": "bob"})) == 1  # least work
    assert group_of(f, asking(metadata={"user_id": "bob"})) == 1
    # group 0 is full (2 requests under way): alice moves, and stays where she went
    assert group_of(f, asking(user="alice")) == 1
    assert f.sessions["alice"] == 1


def test_a_restarting_group_is_never_waited_on_while_another_serves():
    f, groups, _ = fleet()
    groups[1].on_event(0, Cached([x.name for x in prefix_chain(request(False).request)]))
    groups[1].job_ended(LaunchError("error: rank 0 (host 0 (localhost)) exited"))
    assert not groups[1].ready
    assert group_of(f, request(False)) == 0
    groups[0].job_ended(LaunchError("error: rank 0 exited"))
    waiting = request(False)
    f.submit(waiting)  # none serves: it waits on the cheapest, as with one group
    assert waiting in groups[waiting.group].pending


def test_a_failed_groups_requests_go_to_the_others_at_once():
    f, groups, sent = fleet(groups=3)
    reqs = [request(False, messages=[{"role": "user", "content": f"q{i}"}]) for i in range(6)]
    for r in reqs:
        groups[0].take(r)  # all on group 0
    streaming = request(True)
    groups[0].take(streaming)
    groups[0].inflight[streaming.id].shown = True
    groups[0].job_ended(LaunchError("error: rank 1 (host 0 (localhost)) exited"))
    assert not groups[0].pending and not groups[0].inflight
    wait_for(lambda: sum(len(out) for out in sent[1:]) >= len(reqs), timeout=10)
    moved = [json.loads(line)["request"]["id"] for out in sent[1:] for line in out]
    assert sorted(moved) == sorted(r.id for r in reqs)  # every plain one, sent again elsewhere
    assert {r.group for r in reqs} == {1, 2}  # spread by load
    assert f.metrics.routed.labels(group="1", reason="rerouted")._value.get() > 0
    chunks = []
    while not streaming.chunks.empty():
        chunks.append(streaming.chunks.get())
    assert "the answer was cut" in str(chunks[-1])  # a stream under way ends with an error
    assert "status" in f.health() and f.health()["groups_ready"] == 2


def test_health_says_each_group_and_the_fleets_status():
    f, groups, _ = fleet()
    health = f.health()
    assert health["status"] == "ok" and health["groups_ready"] == 2
    assert [g["group"] for g in health["groups"]] == [0, 1]
    groups[1].job_ended(LaunchError("error: rank 0 exited"))
    assert f.health()["status"] == "degraded"
    assert [g["status"] for g in f.health()["groups"]] == ["ok", "restarting"]


class FakeBatch:
    def __init__(self):
        self.kept_now: dict[int, list[list[int]]] = {}
        self.live: set[int] = set()
        self.disk = None

    def cached_ids(self):
        return self.live


def test_rank0_reports_the_prefixes_its_cache_holds_and_forgets_dropped_ones():
    told: list[Cached] = []
    prefixes = CachedPrefixes(told.append)
    batch = FakeBatch()
    one = request(False, messages=[{"role": "user", "content": "one"}]).request
    two = request(False, messages=[{"role": "user", "content": "two"}]).request
    t1, t2 = [1, 2, 3], [4, 5]
    snapshot = [4]  # two's prompt kept as a snapshot too (a cache that cannot be cut back)
    batch.kept_now = {7: [t1], 8: [snapshot, t2]}
    batch.live = {id(t1), id(t2), id(snapshot)}
    prefixes.report(batch, {7: one, 8: two})
    assert set(told[-1].links) == {x.name for x in prefix_chain(one) + prefix_chain(two)}
    assert not batch.kept_now
    batch.live = {id(t2), id(snapshot)}  # the LRU dropped one's cache
    prefixes.report(batch, {})
    assert set(told[-1].links) == {x.name for x in prefix_chain(two)}
    n = len(told)
    prefixes.report(batch, {})
    assert len(told) == n  # nothing changed: nothing said
    batch.live = {id(snapshot)}  # two's answer dropped, its prompt's snapshot still serves
    prefixes.report(batch, {})
    assert len(told) == n and set(told[-1].links) == {x.name for x in prefix_chain(two)}


def test_each_groups_log_lines_name_it():
    out = io.StringIO()
    log = GroupLog(out, 1)
    log.write("mlx-cluster: starting 2 rank(s)\nerror: rank 1 (host 0) exited\n  its last li")
    log.write("nes\n")
    assert out.getvalue().splitlines() == [
        "mlx-cluster: group 1: starting 2 rank(s)",
        "[group 1] error: rank 1 (host 0) exited",
        "[group 1]   its last lines",
    ]


def test_status_shows_each_group_and_its_ranks():
    from cluster.commands.status import render

    f, groups, _ = fleet()
    groups[1].job_ended(LaunchError("error: rank 0 exited"))
    text = render(f.cluster())
    assert "group 0: ok, pipeline mode" in text and "group 1: restarting" in text
    assert "0 streaming, 0 prompt tokens to prefill, 0 cached prefixes, 0 answered" in text
    assert "group  rank  host" in text


def test_the_router_learns_the_models_characters_per_token_from_rank0():
    f, groups, _ = fleet()
    req = asking(messages=[{"role": "user", "content": "x" * 3000}])
    f.submit(req)
    assert abs(req.to_prefill - req.chain[-1].chars / 4) <= 1  # 4 until rank 0 counted one
    g = groups[req.group]
    for _ in range(30):  # this tokenizer makes a token of every 2 characters
        g.on_event(0, Admitted(request=req.id, prompt_tokens=req.chain[-1].chars // 2,
                               cached_tokens=0))  # fmt: skip
    assert abs(g.chars_per_token - 2.0) < 0.05
    assert f.to_prefill(req, g) == pytest.approx(req.chain[-1].chars / 2, abs=5)


def test_one_request_cannot_steer_the_router():
    """A request with a 300k-character ``name`` (a field chat templates drop): its chain counts
    what the template writes, so rank 0's count of it is an ordinary sample; and a sample far
    off (a tokenizer's odd case) is held to a range and outvoted by the median. Bursts of 8
    stay spread over the two groups after it (before: 0/8, 1/7)."""
    f, groups, sent = fleet()
    normal = "word " * 600
    for g in groups:  # each group has counted a few prompts: 4 characters a token
        for i in range(8):
            req = asking(messages=[{"role": "user", "content": normal + str(i)}])
            req.chain = prefix_chain(req.request)
            g.submit(req)
            g.on_event(0, Admitted(request=req.id, prompt_tokens=req.chain[-1].chars // 4,
                                   cached_tokens=0))  # fmt: skip
            g.on_event(0, Stats("stop", {}, {}, request=req.id))
    poisoned = asking(messages=[{"role": "user", "content": "hi", "name": "n" * 300_000}])
    assert poisoned.request.messages[0]["name"] and prefix_chain(poisoned.request)[-1].chars < 20
    f.submit(poisoned)
    g = groups[poisoned.group]
    g.on_event(0, Admitted(request=poisoned.id, prompt_tokens=1, cached_tokens=0))
    assert g.chars_per_token == pytest.approx(4.0, rel=0.01)
    for _ in range(3):  # even three absurd counts in a row: held to a range, outvoted
        g.on_event(0, Admitted(request=poisoned.id, prompt_tokens=10**9, cached_tokens=0))
    assert min(g.density) == 0.5 and g.chars_per_token == pytest.approx(4.0, rel=0.01)
    g.on_event(0, Stats("stop", {}, {}, request=poisoned.id))
    for _ in range(3):
        burst = [asking(messages=[{"role": "user", "content": normal}]) for _ in range(8)]
        for req in burst:
            f.submit(req)
        assert sorted(Counter(r.group for r in burst).values()) == [4, 4]
        for req in burst:
            groups[req.group].on_event(0, Stats("stop", {}, {}, request=req.id))


def test_the_router_counts_the_tools_and_not_the_fields_templates_drop():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plain = asking(messages=[{"role": "user", "content": "x" * 100}]).request
    with_tools = asking(messages=plain.messages, tools=tools).request
    thinking = asking(messages=[{"role": "user", "content": "x" * 100},
                                {"role": "assistant", "content": "ok",
                                 "reasoning_content": "r" * 5000}]).request  # fmt: skip
    assert prefix_chain(plain)[-1].chars == 100 + MESSAGE_CHARS
    assert prefix_chain(with_tools)[0].chars == len(json.dumps(tools, separators=(",", ":")))
    assert prefix_chain(with_tools)[-1].chars == prefix_chain(plain)[-1].chars + len(
        json.dumps(tools, separators=(",", ":"))
    )
    assert prefix_chain(thinking)[-1].chars == 102 + 2 * MESSAGE_CHARS


def test_a_restart_forgets_the_memory_tiers_prefixes_but_not_the_disk_tiers():
    told: list[Cached] = []
    prefixes = CachedPrefixes(told.append)
    batch = FakeBatch()
    batch.disk = object()  # a disk tier: what is kept is written there too
    one = request(False, messages=[{"role": "user", "content": "one"}]).request
    keyed = request(False, messages=[{"role": "user", "content": "k"}],
                    prompt_cache_key="s").request  # fmt: skip
    t1, t2 = [1], [2]
    batch.kept_now, batch.live = {1: [t1], 2: [t2]}, {id(t1), id(t2)}
    prefixes.report(batch, {1: one, 2: keyed})
    names = {x.name for x in prefix_chain(one)}
    assert set(told[-1].disk) == names  # a keyed prompt's cache stays off the disk tier
    f, groups, _ = fleet()
    groups[0].on_event(0, told[-1])
    assert groups[0].cached == names | {x.name for x in prefix_chain(keyed)}
    groups[0].job_ended(LaunchError("error: rank 0 exited"))
    assert groups[0].cached == names


def test_a_hostfiles_groups_survive_being_written_back():
    import yaml

    from cluster.core.hostfile import dump_yaml

    hf = parse_hostfile(
        {
            "hosts": ["a.local", "b.local"],
            "groups": [{"hosts": [0], "mode": "tensor"}, {"hosts": ["b.local"]}],
        }
    )
    again = parse_hostfile(yaml.safe_load(dump_yaml(hf)))
    assert again.groups == hf.groups


def split_fleet():
    """A prefill group (0) and a decode group (1) of one rank each, ready, the decode rank's
    door open; (fleet, services, metrics, what each group's rank 0 was sent)."""
    from cluster.core.spec import Handoff

    metrics = Metrics(lambda: [], groups=lambda: [])
    roles = [Handoff("prefill", "00" * 32), Handoff("decode", "00" * 32)]
    services = [
        Service(local_hostfile(1), JobSpec(model="m", command="serve", handoff=role,
                                           serve=ServeSettings(disaggregate_min_tokens=1)),
                io.StringIO(), thread=False, metrics=metrics, group=i)
        for i, role in enumerate(roles)
    ]  # fmt: skip
    sent: list[list[bytes]] = [[] for _ in services]
    for s, out in zip(services, sent, strict=True):
        s.attach(out.append, JobState([RankState(0, "localhost")]))
        s.on_event(0, Serving("m", True))
    services[1].doors = {0: 5555}  # the decode rank's door is open
    return Fleet(services, metrics), services, metrics, sent


def handed_off(f, sent):
    """A long prompt submitted: (the client's request, its copy's id at the prefill group)."""
    req = request(False, messages=[{"role": "user", "content": "x" * 4000}])
    f.submit(req)
    assert req.group == 1 and req.request.handoff is not None
    wait_for(lambda: len(sent[0]) == 1 and len(sent[1]) == 1, timeout=10)  # the outboxes
    copy = json.loads(sent[0][0])["request"]
    assert copy["handoff"]["ticket"] == req.request.handoff.ticket and copy["id"] != req.id
    return req, copy["id"]


def test_a_client_that_leaves_takes_its_prefill_groups_copy_with_it():
    """A request handed to a prefill group (issue 53) whose client goes away: the decode group
    drops it and the prefill group is told to drop its copy (counted once in /metrics)."""
    f, services, metrics, sent = split_fleet()
    req, copy = handed_off(f, sent)
    f.cancel(req)
    wait_for(lambda: len(sent[0]) == 2 and len(sent[1]) == 2, timeout=10)
    assert json.loads(sent[0][1]) == {"op": "cancel", "id": copy}
    assert json.loads(sent[1][1]) == {"op": "cancel", "id": req.id}
    assert metrics.requests.labels(status="cancelled")._value.get() == 1
    # the prefill group, already under way, stops at a chunk's end and says so: no failure
    # is logged and the decode group (which forgot the request) is told nothing more
    from cluster.core.protocol import CANCELLED, Handed

    services[0].on_event(0, Handed(copy, req.request.handoff.ticket, 0, 100, 0.1, CANCELLED))
    assert "a handoff failed" not in services[0].stderr.getvalue()
    assert len(sent[1]) == 2 and metrics.handoffs.labels(group="0")._value.get() == 0


def test_groups_that_cannot_hand_this_models_cache_off_stop_trying_and_say_why_once():
    """A hybrid model's state split unlike the decode group's (issue 63: a linear attention
    from a pipeline group to a tensor one): the prefill group says so before prefilling; the
    decode group prefills that prompt, and every later one, itself."""
    from cluster.core.protocol import Handed

    f, services, metrics, sent = split_fleet()
    req, copy = handed_off(f, sent)
    why = "rank 0: layer 0 keeps a state that is not split by KV heads"
    services[0].on_event(0, Handed(copy, req.request.handoff.ticket, 0, 0, 0.0, why, True))
    wait_for(lambda: len(sent[1]) == 2, timeout=10)
    assert json.loads(sent[1][1]) == {"op": "handoff_failed", "ticket": req.request.handoff.ticket}
    log = services[0].stderr.getvalue()
    assert "group 0 cannot hand prompts to group 1" in log and why in log
    later = request(False, messages=[{"role": "user", "content": "y" * 4000}])
    f.submit(later)
    assert later.group == 1 and later.request.handoff is None  # prefilled where it decodes
    wait_for(lambda: len(sent[1]) == 3, timeout=10)
    assert len(sent[0]) == 1


@pytest.mark.parametrize("end", ["forgot", "answered", "refused", "ranks failed"])
def test_a_handoff_the_decode_group_no_longer_wants_is_cancelled_at_the_prefill_group(end):
    """Whenever the client's request stops waiting for its KV (the decode group forgot the
    ticket, the answer came, a refusal, the decode group's ranks failed), the prefill group
    is told to drop its copy at once: nothing is prefilled and sent that no one takes."""
    from cluster.core.protocol import Forgot, Refused, Stats

    f, services, metrics, sent = split_fleet()
    req, copy = handed_off(f, sent)
    ticket = req.request.handoff.ticket
    decoder = services[1]
    if end == "forgot":
        decoder.on_event(0, Forgot(req.id, ticket, "nothing came for 120 s"))
        assert "its prefill group's copy is cancelled" in decoder.stderr.getvalue()
    elif end == "answered":
        decoder.on_event(0, Stats("stop", {}, {}, request=req.id))
    elif end == "refused":
        decoder.on_event(0, Refused(req.id, 400, "too long"))
    else:
        decoder.job_ended(LaunchError("rank 0 died"))
    wait_for(lambda: len(sent[0]) == 2, timeout=10)
    assert json.loads(sent[0][1]) == {"op": "cancel", "id": copy}
    req.let_go()  # once only
    assert len(sent[0]) == 2


def test_a_prefill_copy_is_never_rerouted_to_a_decode_group():
    """A prefill group that cannot take the copy waiting for it (it failed, or closes): the
    copy goes to no other group (a decode group would take it for the client's request, by
    its ticket); the decode group is told at once that the KV will not come, and prefills
    the prompt itself."""
    f, services, metrics, sent = split_fleet()
    waiting = []
    services[0].submit = waiting.append  # the copy waits for the prefill group's ranks
    req = request(False, messages=[{"role": "user", "content": "x" * 4000}])
    f.submit(req)
    (copy,) = waiting
    assert copy.is_prefill_copy and copy.request.handoff.ticket == req.request.handoff.ticket
    assert f.reroute(services[0], [copy]) == []
    wait_for(lambda: len(sent[1]) == 2, timeout=10)
    lines = [json.loads(x) for x in sent[1]]
    assert lines[0]["request"]["id"] == req.id
    assert lines[1] == {"op": "handoff_failed", "ticket": req.request.handoff.ticket}
    assert metrics.routed.labels(group="1", reason="rerouted")._value.get() == 0


def test_a_group_waiting_for_a_lost_host_ends_its_wait_on_the_first_ctrl_c(monkeypatch):
    """A fleet's group whose lost host holds a share it cannot do without waits for it with
    backoff (up to 30 s a look); the first Ctrl-C drains the fleet, and that group stops
    waiting at once (before: only the second signal ended it)."""
    import threading
    import time

    import cluster.job.ssh as ssh
    from cluster.serve.supervisor import next_hosts

    monkeypatch.setattr(ssh, "host_answers", lambda *a: False)
    hf = parse_hostfile({"hosts": [{"ssh": "a.local", "memory_gb": 1},
                                   {"ssh": "b.local", "memory_gb": 1}]})  # fmt: skip
    error = LaunchError("host 1 (b.local) stopped answering", lost_hosts=[1])
    stop, wake, draining = threading.Event(), threading.Event(), threading.Event()
    log = io.StringIO()
    out: list = []
    big = JobSpec(model="m", command="serve", mode="tensor")
    monkeypatch.setattr("cluster.serve.supervisor.fits", lambda rest, spec: "it needs both")
    t = threading.Thread(target=lambda: out.append(next_hosts(
        hf, hf, error, big, LaunchSettings(), log, stop, wake, draining.is_set)))  # fmt: skip
    t.start()
    wait_for(lambda: "waiting for host 1" in log.getvalue(), timeout=10)
    began = time.monotonic()
    draining.set()
    wake.set()  # as serve_groups' signal handler does
    t.join(timeout=10)
    assert not t.is_alive() and time.monotonic() - began < 5
    assert out == [hf] and "the server is draining" in log.getvalue()
