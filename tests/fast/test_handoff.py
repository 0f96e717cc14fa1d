"""A prompt's KV cache handed from a prefill group's ranks to a decode group's (issue 53), in
one process over loopback: re-cut for each sharding pair, every layer and head where the
decode rank holds it, a cache built from it continues the prompt exactly; a cut link, a
missing sender or a stranger's key leave nothing to use."""

from __future__ import annotations

import json
import socket
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cluster.core.handoff import Layout, group_layouts, plan_pieces, tokens_digest, travels_as
from node.cache.handoff import Door, Sender, check_frame, fill_cache, layer_arrays, layer_states
from tests.support.kv import SMALL, TOKENS, next_logits, prefilled, small_llama

KEY = b"k" * 32
CONFIG = {"model_type": "llama", **SMALL}
CHUNK = 300


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return small_llama(tmp_path_factory.mktemp("handoff"))[1]


@pytest.fixture(scope="module")
def full(model):
    """The prompt (all but its last token) prefilled by one rank: each layer's keys and
    values (1, every KV head, tokens, dim)."""
    cache, _ = prefilled(model, TOKENS[:-1])
    return {i: (c.keys[:, :, : c.offset], c.values[:, :, : c.offset]) for i, c in enumerate(cache)}


def held(full, layout: Layout, start: int, end: int) -> dict:
    """What a rank laid out as ``layout`` holds of the tokens [start, end)."""
    idx = mx.array(layout.heads)
    return {layer: (full[layer][0][:, idx, start:end], full[layer][1][:, idx, start:end])
            for layer in layout.layers}  # fmt: skip


def hand_off(full, senders: list[Layout], receivers: list[Layout], ticket="t1", key=KEY):
    doors = [Door(r, KEY) for r in receivers]
    pieces = plan_pieces(senders, receivers)
    links = [Sender(s, pieces, [("127.0.0.1", d.port) for d in doors], key)
             for s in range(len(senders))]  # fmt: skip
    n = len(TOKENS) - 1
    for start in range(0, n, CHUNK):  # as the prefill goes: a chunk at a time
        end = min(n, start + CHUNK)
        for s, link in enumerate(links):
            link.chunk(ticket, start, end, held(full, senders[s], start, end))
    for link in links:
        link.end(ticket, TOKENS[:-1])
    errors = [link.finish() for link in links]
    assert errors == [None] * len(links)
    return doors


def wait_complete(door: Door, ticket="t1", timeout=10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if door.complete(ticket):
            return True
        time.sleep(0.01)
    return False


PAIRS = [((1, "pipeline"), (1, "pipeline")), ((1, "pipeline"), (2, "pipeline")),
         ((1, "pipeline"), (2, "tensor")), ((2, "pipeline"), (1, "pipeline")),
         ((2, "tensor"), (2, "pipeline")), ((2, "pipeline"), (4, "tensor"))]  # fmt: skip


@pytest.mark.parametrize("prefill,decode", PAIRS, ids=lambda g: f"{g[1]}{g[0]}")
def test_each_decode_rank_gets_exactly_what_it_holds(full, prefill, decode):
    senders = group_layouts(CONFIG, prefill[1], prefill[0])
    receivers = group_layouts(CONFIG, decode[1], decode[0])
    doors = hand_off(full, senders, receivers)
    for door, layout in zip(doors, receivers, strict=True):
        assert wait_complete(door)
        got = door.take("t1")
        assert got.tokens == TOKENS[:-1]
        arrays = layer_arrays(got, layout)
        want = held(full, layout, 0, len(TOKENS) - 1)
        assert sorted(arrays) == sorted(want) == sorted(layout.layers)
        for layer, (k, v) in arrays.items():
            assert mx.array_equal(k, want[layer][0]).item()
            assert mx.array_equal(v, want[layer][1]).item()
        door.close()


def test_a_replicated_kv_head_comes_to_every_rank_that_holds_it():
    receivers = group_layouts(CONFIG, "tensor", 4)  # 2 KV heads over 4 ranks
    assert [r.heads for r in receivers] == [(0,), (0,), (1,), (1,)]
    pieces = plan_pieces(group_layouts(CONFIG, "pipeline", 2), receivers)
    for r in range(4):  # each layer from the pipeline rank that holds it
        assert sorted((p.layer, p.sender) for p in pieces if p.receiver == r) == [(0, 1), (1, 0)]


def test_a_cache_built_from_a_handoff_continues_the_prompt_exactly(model, full):
    (layout,) = group_layouts(CONFIG, "pipeline", 1)
    (door,) = hand_off(full, group_layouts(CONFIG, "pipeline", 2), [layout])
    assert wait_complete(door)
    cache = fill_cache(make_prompt_cache(model), {i: i for i in layout.layers},
                       layer_arrays(door.take("t1"), layout))  # fmt: skip
    want = next_logits(model, prefilled(model, TOKENS[:-1])[0], TOKENS[-1:])
    assert mx.array_equal(next_logits(model, cache, TOKENS[-1:]), want).item()
    door.close()


def test_a_link_cut_halfway_leaves_the_ticket_incomplete(full):
    (layout,) = group_layouts(CONFIG, "pipeline", 1)
    door = Door(layout, KEY)
    pieces = plan_pieces([layout], [layout])
    link = Sender(0, pieces, [("127.0.0.1", door.port)], KEY)
    link.chunk("t1", 0, CHUNK, held(full, layout, 0, CHUNK))
    assert link.finish() is None  # the sender dies here: no second chunk, no end frame
    time.sleep(0.2)
    assert not door.complete("t1") and door.failed("t1") is None
    # an end frame that counts more frames than came: still not complete
    link = Sender(0, pieces, [("127.0.0.1", door.port)], KEY)
    link.counts[0] = 5
    link.end("t1", TOKENS[:-1])
    assert link.finish() is None
    assert not wait_complete(door, timeout=0.5)
    door.drop("t1")
    assert "t1" not in door.tickets
    door.close()


def test_a_stranger_without_the_key_is_not_read(full):
    (layout,) = group_layouts(CONFIG, "pipeline", 1)
    door = Door(layout, KEY)
    pieces = plan_pieces([layout], [layout])
    link = Sender(0, pieces, [("127.0.0.1", door.port)], b"x" * 32)
    link.chunk("t1", 0, len(TOKENS) - 1, held(full, layout, 0, len(TOKENS) - 1))
    link.end("t1", TOKENS[:-1])
    link.finish()  # the door closed on it: an error, or nothing taken
    with socket.create_connection(("127.0.0.1", door.port)) as s:  # a frame without the proof
        s.recv(32)
        s.sendall(b"\0" * 32 + json.dumps({"ticket": "t2"}).encode())
    time.sleep(0.2)
    assert door.tickets == {}
    door.close()


def test_a_sender_gone_quiet_mid_frame_fails_its_ticket_and_frees_the_link(monkeypatch):
    """A prefill host that stops sending (frozen, its link dead without a reset) holds its
    door connection no longer than QUIET_S: the ticket is failed, the reading thread ends."""
    import node.cache.handoff as handoff
    from node.cache.handoff import connect, send_frame

    monkeypatch.setattr(handoff, "QUIET_S", 0.3)
    (layout,) = group_layouts(CONFIG, "pipeline", 1)
    door = Door(layout, KEY)
    with connect(("127.0.0.1", door.port), KEY) as s:
        ended = {"ticket": "t1", "sender": 0, "senders": [0], "last": True, "frames": 1,
                 "nbytes": 8}  # fmt: skip
        send_frame(s, ended, [bytes(8)])
        frame = {"ticket": "t1", "sender": 0, "senders": [0], "layer": 0, "place": [0],
                 "start": 0, "stop": 1, "dtype": "float32", "shape": [1, 1, 1, 125],
                 "nbytes": 1000}  # fmt: skip
        send_frame(s, frame, [bytes(10)])  # 990 bytes never come
        end = time.monotonic() + 10
        while door.failed("t1") is None and time.monotonic() < end:
            time.sleep(0.01)
        assert "could not be read" in (door.failed("t1") or ""), door.tickets
        assert door.heard("t1") is not None and not door.complete("t1")
    door.close()


class Inbox:
    """Rank 0's inbox as the scheduler reads it, without the channel behind it."""

    def __init__(self):
        import queue
        import threading

        self.flights = queue.Queue()
        self.prepared_all, self.draining = threading.Event(), threading.Event()
        self.handoffs_failed: dict[str, float] = {}
        self.gone: list[str] = []

    def ended(self, flight):
        self.gone.append(flight.request.id)


def scheduler(role: str, emit=lambda e: None):
    import node.jobs.serve as ns

    s = ns.Scheduler(None, emit, True, 30.0, ns.Admission(100, None, None), role=role)
    s.inbox = Inbox()
    return s


def flight(rid: str, ticket: str | None, prompt: int = 8, copy: bool = False):
    """A prepared request waiting for ``ticket``'s KV (``copy``: a prefill group's copy of
    it, which names the decode ranks' doors)."""
    import node.jobs.serve as ns
    from cluster.core.spec import HandoffTicket, Sampling, ServeRequest, SharedRequest

    doors = [["127.0.0.1", 1]] if copy else []
    handoff = HandoffTicket(ticket, doors=doors) if ticket else None
    f = ns.Flight(ServeRequest(id=rid, kind="completion", sampling=Sampling(), handoff=handoff))
    f.shared = SharedRequest(Sampling(max_tokens=4), list(range(1, prompt + 1)))
    if ticket:  # as rank 0's prepare thread makes it
        f.handed = tokens_digest(f.shared.tokens[:-1])
    return f


def tickets(expect) -> list[str]:
    return [e.ticket for e in expect]


def test_a_decode_group_holds_a_request_until_every_rank_has_its_kv():
    """Expected on every rank first; once every rank holds it whole, adopted in the same
    order that inserts the request; a handoff that failed, a cancel or a wait past
    HANDOFF_WAIT_S: forgotten, and the request prefills here (or ends)."""
    from cluster.core.spec import Adopt

    s = scheduler("decode")
    held = flight("a", "t1")
    s.take(held)
    order = s.order(live=0)
    assert tickets(order.expect) == ["t1"] and not order.insert and not order.adopt
    assert order.expect[0].tokens == tokens_digest(held.shared.tokens[:-1])
    assert s.order(live=0) is None  # waiting: nothing to order
    s.handed_now = ["t1"]
    order = s.order(live=0)
    assert order.adopt == [Adopt("t1", None)] and order.insert == [held.shared]
    s.inserting = []
    failed, cancelled = flight("b", "t2"), flight("c", "t3")
    s.take(failed)
    s.take(cancelled)
    assert tickets(s.order(live=1).expect) == ["t2", "t3"]
    s.inbox.handoffs_failed["t2"] = time.monotonic()
    cancelled.cancel.set()
    order = s.order(live=1)
    assert order.forget == ["t2", "t3"] and order.insert == [failed.shared]
    assert s.inbox.gone == ["c"] and not s.awaiting and not s.inbox.handoffs_failed


def test_a_handoff_not_made_in_time_is_prefilled_here(monkeypatch):
    import node.jobs.serve as ns

    monkeypatch.setattr(ns, "HANDOFF_WAIT_S", 0.0)
    s = scheduler("decode")
    late = flight("a", "t1")
    s.take(late)
    order = s.order(live=0)
    assert tickets(order.expect) == ["t1"] and order.forget == ["t1"]
    assert order.insert == [late.shared]


def test_a_long_handoff_still_sending_is_waited_for(monkeypatch):
    """The wait runs from the handoff's last frame, not from the request: a 100k-token
    prompt prefills for minutes, its frames coming all along."""
    import node.cache.handoff as handoff
    import node.jobs.serve as ns

    class Door:
        last: float | None = None

        def heard(self, ticket):
            return self.last

    door = Door()
    monkeypatch.setattr(handoff, "DOOR", door)
    s = scheduler("decode")
    long = flight("a", "t1")
    s.take(long)
    assert tickets(s.order(live=1).expect) == ["t1"]
    f, shared, since = s.awaiting["t1"]
    s.awaiting["t1"] = (f, shared, since - 10 * ns.HANDOFF_WAIT_S)  # asked long ago
    door.last = time.monotonic()  # a frame just came
    assert s.order(live=1) is None and "t1" in s.awaiting
    door.last -= 2 * ns.HANDOFF_WAIT_S  # and then nothing
    order = s.order(live=1)
    assert order.forget == ["t1"] and order.insert == [long.shared]


def test_a_prefill_group_prefills_all_but_the_last_token_and_says_so():
    from cluster.core.protocol import Handed

    events = []
    s = scheduler("prefill", events.append)
    f = flight("a", "t1", prompt=8, copy=True)
    s.take(f)
    order = s.order(live=0)
    assert order.prefill is not None and order.prefill.tokens == list(range(1, 8))
    assert order.prefill.handoff.ticket == "t1" and order.prefill.request == "a"
    assert not s.prefill_cancelled()
    f.cancel.set()  # the client left: the ranks stop after the chunk under way
    assert s.prefill_cancelled()
    f.cancel.clear()
    s.handed(order.prefill, 1234, 0.5, None)
    assert events == [Handed("a", "t1", 7, 1234, 0.5, None)] and s.inbox.gone == ["a"]


@pytest.mark.parametrize("leaves", [False, True], ids=["stays", "leaves"])
def test_a_prefill_whose_client_leaves_stops_at_the_chunks_end(model, leaves):
    """The prefill group's loop (node.cache.handoff.prefill_and_send, one rank): a client that
    stays gets every chunk and the end frame; one that leaves during the first chunk stops
    the prefill there, no end frame goes, and the decode rank never takes what came."""
    from types import SimpleNamespace

    from cluster.core.protocol import CANCELLED
    from cluster.core.spec import Handoff, HandoffTicket
    from node.cache.handoff import prefill_and_send

    (layout,) = group_layouts(CONFIG, "pipeline", 1)
    door = Door(layout, KEY)
    ticket = HandoffTicket("t1", doors=[["127.0.0.1", door.port]])
    order = SimpleNamespace(handoff=ticket, tokens=TOKENS[:-1])
    loaded = SimpleNamespace(model=model, config=CONFIG)
    spec = SimpleNamespace(mode="pipeline", world_size=1, split=None, split_weights=None,
                           handoff=Handoff(role="prefill", key=KEY.hex()))  # fmt: skip
    chunks = []
    sent, _, error, _ = prefill_and_send(order, loaded, spec, None, CHUNK,
                                      lambda: chunks.append(1), lambda: leaves)  # fmt: skip
    n = len(TOKENS) - 1
    if leaves:
        assert error == CANCELLED and len(chunks) == 1 < -(-n // CHUNK)
        assert not wait_complete(door, timeout=0.5)
    else:
        assert error is None and len(chunks) == -(-n // CHUNK)
        assert wait_complete(door)
    assert sent > 0
    door.close()


def test_rank0_forgets_failed_handoffs_whose_requests_never_came(monkeypatch):
    """The launcher's "handoff_failed" lines are kept HANDOFF_WAIT_S for a request that may
    still come, then forgotten (before: kept for as long as the ranks ran)."""
    import os

    import node.jobs.serve as ns
    from tests.support.serving import wait_for

    monkeypatch.setattr(ns, "HANDOFF_WAIT_S", 0.2)
    r, w = os.pipe()
    inbox = ns.Inbox(os.fdopen(r, "rb"), lambda m: None)
    os.write(w, b'{"op": "handoff_failed", "ticket": "t1"}\n')
    wait_for(lambda: "t1" in inbox.handoffs_failed, timeout=5)
    time.sleep(0.3)  # t1 is older than HANDOFF_WAIT_S now
    os.write(w, b'{"op": "handoff_failed", "ticket": "t2"}\n')
    wait_for(lambda: "t2" in inbox.handoffs_failed, timeout=5)
    assert list(inbox.handoffs_failed) == ["t2"]
    os.close(w)


def test_rank0_refuses_a_duplicate_ticket_and_a_prefill_copy_and_says_what_it_forgot():
    """A decode group's rank 0: a second request under a ticket already waiting, or a prefill
    group's copy (it names the doors), fails alone and the first keeps its place; a ticket
    some rank's door refused is forgotten at once, and each forgotten ticket is told to the
    launcher (Forgot), which cancels the prefill group's copy."""
    from cluster.core.protocol import Forgot, Refused

    events = []
    s = scheduler("decode", events.append)
    first = flight("a", "t1")
    s.take(first)
    s.take(flight("b", "t1"))
    s.take(flight("c", "t2", copy=True))
    assert [(e.request, e.status) for e in events] == [("b", 500), ("c", 500)]
    assert all(isinstance(e, Refused) for e in events) and s.awaiting["t1"][0] is first
    assert "already waiting" in events[0].message and "copy" in events[1].message
    assert tickets(s.order(live=1).expect) == ["t1"]
    s.failed_now = ["t1"]
    order = s.order(live=1)
    assert order.forget == ["t1"] and order.insert == [first.shared]
    assert events[2:] == [Forgot("a", "t1", "a rank's door refused what came")]


# This year's cache kinds (issue 63): what each family keeps beside (or instead of) llama's KV
HYBRIDS = {"qwen3_5": "ArraysCache (linear attention)", "gpt_oss": "RotatingKVCache (windows)",
           "longcat_flash": "CacheList",
           "gemma4_text": "RotatingKVCache, KV-sharing layers without a cache",
           "nemotron_h": "ArraysCache (Mamba), blocks without a cache",
           "kimi_linear": "ArraysCache (delta attention), latent KV (one head)",
           "deepseek_v3": "latent KV only (MLA: one head, its rope keys narrower)"}  # fmt: skip


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """family -> (its config, the loaded model, its prompt's cache prefilled by one rank)."""
    from mlx_lm import load

    from tests.support.tiny import make_model

    out = {}
    for family in HYBRIDS:
        path = make_model(tmp_path_factory.mktemp(family) / "m", family, seed=1)
        m, _ = load(str(path))
        out[family] = (json.loads((path / "config.json").read_text()), m,
                       prefilled(m, TOKENS[:-1])[0])  # fmt: skip
    return out


def kinds_of(m) -> dict[int, str]:
    from node.cache.handoff import cache_kinds

    cache = make_prompt_cache(m)
    return cache_kinds(cache, {i: i for i in range(len(cache))})


def hand_off_cache(cache, kinds, senders: list[Layout], receivers: list[Layout]) -> list[Door]:
    """``cache`` (one rank's, whole) handed from ranks laid out as ``senders`` (each holding
    its layers whole) to doors laid out as ``receivers``, as prefill_and_send sends it: KV
    a chunk at a time, the other layers' states at the end."""
    travel = {layer: travels_as(kind) for layer, kind in kinds.items()}
    doors = [Door(r, KEY, travel=travel) for r in receivers]
    pieces = plan_pieces(senders, receivers, kinds)
    n = len(TOKENS) - 1
    for s, have in enumerate(senders):
        link = Sender(s, pieces, [("127.0.0.1", d.port) for d in doors], KEY)
        kv = [i for i in have.layers if travel[i] == "kv"]
        for start in range(0, n, CHUNK):
            end = min(n, start + CHUNK)
            span = {i: (cache[i].keys[:, :, start:end], cache[i].values[:, :, start:end])
                    for i in kv}  # fmt: skip
            link.chunk("t1", start, end, span)
        link.states("t1", {i: cache[i].state for i in have.layers if i not in kv})
        link.end("t1", TOKENS[:-1])
        assert link.finish() is None
    return doors


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_a_hybrid_models_state_comes_whole_and_the_cache_continues_the_prompt_exactly(
    hybrids, family
):
    config, m, cache = hybrids[family]
    kinds = kinds_of(m)
    want = next_logits(m, prefilled(m, TOKENS[:-1])[0], TOKENS[-1:])
    for senders in (group_layouts(config, "pipeline", 2), group_layouts(config, "pipeline", 1)):
        (layout,) = group_layouts(config, "pipeline", 1)
        (door,) = hand_off_cache(cache, kinds, senders, [layout])
        assert wait_complete(door)
        got = door.take("t1")
        fresh = make_prompt_cache(m)
        slots = {i: i for i in layout.layers}
        filled = fill_cache(fresh, slots, layer_arrays(got, layout), layer_states(got, layout))
        assert [type(c) for c in filled] == [type(c) for c in cache]
        assert mx.array_equal(next_logits(m, filled, TOKENS[-1:]), want).item()
        door.close()


def test_a_window_is_recut_by_heads_and_a_linear_attentions_state_only_goes_alike(hybrids):
    config, m, cache = hybrids["gpt_oss"]
    kinds = kinds_of(m)
    receivers = group_layouts(config, "tensor", 2)
    doors = hand_off_cache(cache, kinds, group_layouts(config, "pipeline", 2), receivers)
    for door, layout in zip(doors, receivers, strict=True):
        assert wait_complete(door)
        states = layer_states(door.take("t1"), layout)
        windows = [i for i, k in kinds.items() if k == "RotatingKVCache"]
        assert sorted(states) == windows
        idx = mx.array(layout.heads)
        for i in windows:
            keys, values, *numbers = states[i]
            assert mx.array_equal(keys, cache[i].keys[:, idx]).item()
            assert mx.array_equal(values, cache[i].values[:, idx]).item()
            assert numbers == list(cache[i].state[2:])
        door.close()
    config, m, _ = hybrids["qwen3_5"]
    with pytest.raises(ValueError, match="only between ranks that hold it alike"):
        plan_pieces(group_layouts(config, "pipeline", 2), group_layouts(config, "tensor", 2),
                    kinds_of(m))  # fmt: skip
    same = group_layouts(config, "tensor", 2)  # tensor to tensor of one plan: rank to rank
    pieces = plan_pieces(same, same, kinds_of(m))
    assert {(p.sender, p.receiver) for p in pieces if p.whole} == {(0, 0), (1, 1)}


def test_a_state_frame_is_checked_before_its_bytes_are_read():
    layout = Layout((0, 1), (0, 1))
    travel = {0: "state", 1: "window"}
    frame = {"ticket": "t", "sender": 0, "layer": 0, "state": [{"array": "s.0"}],
             "arrays": [["s.0", "float32", [1, 4, 8]]], "nbytes": 128}  # fmt: skip
    assert check_frame(frame, layout, None, travel) == 128
    for change, why in [({"nbytes": 64}, "nbytes"), ({"arrays": []}, "arrays"),
                        ({"arrays": [["s.0", "int64", [1]]]}, "state array"),
                        ({"arrays": [["s.0", "float32", [1 << 30]]]}, "state array"),
                        ({"place": [0]}, "place"), ({"layer": 7}, "layer")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            check_frame({**frame, **change}, layout, None, travel)
    with pytest.raises(ValueError, match="travels as"):  # KV where a state is kept, and back
        check_frame({k: v for k, v in frame.items() if k != "state"}, layout, None, travel)
    with pytest.raises(ValueError, match="travels as"):
        check_frame(frame, layout, None, {})
    piece = {
        **frame,
        "layer": 1,
        "place": [1],
        "nbytes": 2 * 4 * 8 * 4,
        "arrays": [["k", "float32", [1, 1, 8, 4]], ["v", "float32", [1, 1, 8, 4]]],
    }
    assert check_frame(piece, layout, None, travel) == 256
    with pytest.raises(ValueError, match="head piece"):
        check_frame({**piece, "place": [0, 1]}, layout, None, travel)


def test_a_layout_names_places_in_the_cache_list_not_layers():
    """nemotron_h keeps a cache for its Mamba and attention blocks only: a layout's layers
    are places in the cache list the ranks make (node.model.stage.cache_slots_of)."""
    from tests.support.tiny import FAMILIES

    config = FAMILIES["nemotron_h"]  # M - * M E M * -
    assert group_layouts(config, "pipeline", 1)[0].layers == (0, 1, 2, 3, 4)
    assert [r.layers for r in group_layouts(config, "pipeline", 2)] == [(3, 4), (0, 1, 2)]
    assert all(r.layers == (0, 1, 2, 3, 4) for r in group_layouts(config, "tensor", 2))


def test_a_latent_attentions_kv_goes_whole_to_every_tensor_rank(hybrids):
    """MLA (DeepSeek V3/V3.2, Kimi K2, Kimi-Linear): the cache holds one latent "head" and its
    rope keys (narrower: the frame says ``v_dim``), the same on every tensor rank."""
    config, m, cache = hybrids["deepseek_v3"]
    receivers = group_layouts(config, "tensor", 2)
    assert [r.heads for r in receivers] == [(0,), (0,)]
    doors = hand_off_cache(cache, kinds_of(m), group_layouts(config, "pipeline", 2), receivers)
    for door, layout in zip(doors, receivers, strict=True):
        assert wait_complete(door)
        arrays = layer_arrays(door.take("t1"), layout)
        for i, (k, v) in arrays.items():
            assert k.shape[-1] != v.shape[-1]
            assert mx.array_equal(k, cache[i].keys[..., : cache[i].offset, :]).item()
            assert mx.array_equal(v, cache[i].values[..., : cache[i].offset, :]).item()
        door.close()
