"""A decode rank's handoff door against hostile peers (issue 62): silent connections by the
thousand and spent descriptors do not close it, the proof has one short deadline and goes
both ways, a frame is checked against the rank's layout before anything is allocated, a
dropped ticket's late frames are read past, the door's bytes are bounded and pruned."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

import node.cache.handoff as handoff
from cluster.core.handoff import group_layouts, plan_pieces, tokens_digest
from node.cache.handoff import CHALLENGE, Door, Sender, check_frame, connect, proof, send_frame
from tests.support.serving import wait_for

KEY = b"k" * 32
CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
(LAYOUT,) = group_layouts(CONFIG, "pipeline", 1)
HEAD_DIM = 16
PROMPT = list(range(3, 40))


def kv(tokens: int, heads: int = 2) -> tuple[mx.array, mx.array]:
    k = mx.arange(heads * tokens * HEAD_DIM, dtype=mx.float32).reshape(1, heads, tokens, HEAD_DIM)
    return k, k + 1


def send_prompt(door_port: int, ticket: str = "t1", host: str = "127.0.0.1") -> str | None:
    """One prefill rank's whole handoff of PROMPT to a one-rank decode group; its error."""
    link = Sender(0, plan_pieces([LAYOUT], [LAYOUT]), [(host, door_port)], KEY)
    link.chunk(ticket, 0, len(PROMPT), {layer: kv(len(PROMPT)) for layer in LAYOUT.layers})
    link.end(ticket, PROMPT)
    return link.finish()


DOOR_PROCESS = """
import os, resource, sys, time
from cluster.core.handoff import group_layouts
from node.cache.handoff import Door
(layout,) = group_layouts({config}, "pipeline", 1)
door = Door(layout, b"k" * 32, log=lambda line: print(line, file=sys.stderr, flush=True))
used = len(os.listdir("/proc/self/fd"))
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 64, hard))
hog = []
try:  # the rank's other work holds every descriptor left
    while True:
        hog.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print(door.port, flush=True)
sys.stdin.readline()  # the crowd is there: the descriptors come free
for fd in hog:
    os.close(fd)
end = time.monotonic() + 60
while not door.complete("t1") and time.monotonic() < end:
    time.sleep(0.05)
print("complete" if door.complete("t1") else "incomplete", flush=True)
"""


def test_thousands_of_silent_connections_and_spent_descriptors_leave_the_door_open(tmp_path):
    """2,200 connections that never send a byte, while the rank has no descriptor to spare:
    the door's accept fails (EMFILE), it waits and goes on once descriptors come free, closes
    at once what comes past MOST_UNPROVEN connections proving themselves, and a real handoff
    still comes through (before: the accepting thread ended on EMFILE, and each silent
    connection held a descriptor and a thread for 120 s)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2400:
        pytest.skip(f"this process may open {hard} descriptors, 2,200 connections need more")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2400), hard))
    door = subprocess.Popen(
        [sys.executable, "-c", DOOR_PROCESS.format(config=CONFIG)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=os.getcwd(),
    )  # fmt: skip
    silent = []
    try:
        port = int(door.stdout.readline())
        for _ in range(2200):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            silent.append(s)
        door.stdin.write("\n")
        door.stdin.flush()
        assert send_prompt(port) is None
        assert door.stdout.readline().strip() == "complete"
    finally:
        for s in silent:
            s.close()
        door.kill()
        _, err = door.communicate(timeout=10)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "cannot accept (Too many open files)" in err


def test_a_connection_that_does_not_prove_itself_is_closed_within_the_deadline(monkeypatch):
    """One deadline for the whole proof (not 120 s per read): a peer that reads the challenge
    and answers nothing, or trickles a byte at a time, is cut off after PROOF_S."""
    monkeypatch.setattr(handoff, "PROOF_S", 0.5)
    door = Door(LAYOUT, KEY)
    try:
        for trickle in (False, True):
            with socket.create_connection(("127.0.0.1", door.port)) as s:
                s.recv(CHALLENGE)
                began = time.monotonic()
                s.settimeout(5)
                closed = False
                while time.monotonic() - began < 5:
                    try:
                        if trickle:
                            s.sendall(b"x")
                        if s.recv(1, socket.MSG_DONTWAIT if trickle else 0) == b"":
                            closed = True
                            break
                    except BlockingIOError:
                        time.sleep(0.1)
                    except ConnectionResetError:
                        closed = True
                        break
                assert closed and time.monotonic() - began < 2.0, trickle
    finally:
        door.close()


def test_the_door_proves_the_key_back_before_any_kv_leaves():
    """A listener that sends a challenge but cannot answer the sender's: the sender sends its
    64-byte proof and challenge, then nothing (no frame, no KV) and says why."""
    server = socket.create_server(("127.0.0.1", 0))
    got = []

    def impostor():
        conn, _ = server.accept()
        with conn:
            conn.sendall(os.urandom(CHALLENGE))
            conn.settimeout(2)
            data = b""
            try:
                while chunk := conn.recv(1 << 16):
                    data += chunk
                    if len(data) >= 64:
                        conn.sendall(os.urandom(32))  # not the key's answer
            except OSError:
                pass
            got.append(data)

    t = threading.Thread(target=impostor)
    t.start()
    with pytest.raises(ValueError, match="did not prove the serve's key"):
        connect(("127.0.0.1", server.getsockname()[1]), KEY)
    t.join()
    server.close()
    assert len(got[0]) == 64  # the proof and the sender's challenge, and nothing after


def test_a_stranger_gets_no_answer_to_its_challenge():
    """The door answers a sender's challenge only after its proof checked."""
    door = Door(LAYOUT, KEY)
    try:
        with socket.create_connection(("127.0.0.1", door.port), timeout=5) as s:
            challenge = s.recv(CHALLENGE)
            s.sendall(proof(b"x" * 32, challenge) + os.urandom(CHALLENGE))
            assert s.recv(32) == b""
    finally:
        door.close()


FRAME = {"ticket": "t1", "sender": 0, "senders": [0], "layer": 1, "place": [0, 1],
         "start": 0, "stop": 4, "dtype": "float32", "shape": [1, 2, 4, HEAD_DIM],
         "nbytes": 2 * 4 * 2 * 4 * HEAD_DIM}  # fmt: skip

BAD_FRAMES = [
    ({"layer": 7}, "layer 7"),
    ({"place": [0, 2]}, "'place'"),
    ({"place": [1, 1]}, "'place'"),
    ({"place": []}, "'place'"),
    ({"start": 4}, "'stop'"),
    ({"start": -1}, "'start'"),
    ({"dtype": "int64"}, "'dtype'"),
    ({"shape": [1, 2, 4, 17]}, "'shape'"),
    ({"shape": [1, 3, 4, HEAD_DIM]}, "'shape'"),
    ({"nbytes": 64 << 30}, "'nbytes'"),
    ({"nbytes": True}, "'nbytes'"),
    ({"ticket": 5}, "ticket"),
    ({"ticket": "t" * 65}, "ticket"),
    ({"sender": "0"}, "'sender'"),
    ({"senders": ["a"]}, "'senders'"),
]


@pytest.mark.parametrize("change,says", BAD_FRAMES, ids=[s for _, s in BAD_FRAMES])
def test_a_frame_that_does_not_fit_the_rank_is_refused_naming_its_field(change, says):
    assert check_frame(FRAME, LAYOUT, HEAD_DIM) == FRAME["nbytes"]
    with pytest.raises(ValueError, match=says.replace("[", r"\[")):
        check_frame({**FRAME, **change}, LAYOUT, HEAD_DIM)


def test_an_end_frame_is_a_prompts_tokens():
    end = {"ticket": "t1", "sender": 0, "senders": [0], "last": True, "frames": 1}
    assert check_frame({**end, "nbytes": 4 * 10}, LAYOUT, HEAD_DIM) == 40
    for nbytes in (0, 6, 4 * (handoff.MOST_TOKENS + 1)):
        with pytest.raises(ValueError, match="end frame"):
            check_frame({**end, "nbytes": nbytes}, LAYOUT, HEAD_DIM)


def test_a_64_gib_frame_fails_its_ticket_before_anything_is_allocated():
    door = Door(LAYOUT, KEY, head_dim=HEAD_DIM)
    try:
        with connect(("127.0.0.1", door.port), KEY) as s:
            send_frame(s, {**FRAME, "shape": [1, 2, 1 << 28, HEAD_DIM], "stop": 1 << 28,
                           "nbytes": 64 << 30})  # fmt: skip
            wait_for(lambda: door.failed("t1") is not None)
        assert "'stop'" in door.failed("t1") and door.held_bytes == 0
    finally:
        door.close()


def test_a_dropped_tickets_late_frames_are_read_past_and_its_bytes_freed():
    """The decode group forgot t1 (a tombstone); frames still coming for it are not kept
    and do not re-create it, and the link stays good for the next ticket."""
    door = Door(LAYOUT, KEY, head_dim=HEAD_DIM)
    try:
        link = Sender(0, plan_pieces([LAYOUT], [LAYOUT]), [("127.0.0.1", door.port)], KEY)
        link.chunk("t1", 0, 10, {layer: kv(10) for layer in LAYOUT.layers})
        wait_for(lambda: door.held_bytes > 0)
        door.drop("t1")
        assert door.held_bytes == 0
        link.chunk("t1", 10, len(PROMPT), {layer: kv(len(PROMPT) - 10) for layer in LAYOUT.layers})
        link.end("t1", PROMPT)
        assert link.finish() is None  # read past, not cut
        assert send_prompt(door.port, "t2") is None
        wait_for(lambda: door.complete("t2", tokens_digest(PROMPT)))
        assert "t1" not in door.tickets and not door.complete("t1")
    finally:
        door.close()


def test_tickets_no_one_takes_are_pruned_on_a_timer(monkeypatch):
    monkeypatch.setattr(handoff, "PRUNE_EVERY_S", 0.05)
    monkeypatch.setattr(handoff, "MOST_AGE_S", 0.3)
    door = Door(LAYOUT, KEY, head_dim=HEAD_DIM)
    try:
        assert send_prompt(door.port) is None
        wait_for(lambda: door.complete("t1"))
        assert door.held_bytes > 0
        wait_for(lambda: "t1" not in door.tickets, timeout=5)  # no new ticket needed
        assert door.held_bytes == 0
        wait_for(lambda: not door.tombstones, timeout=5)
    finally:
        door.close()


def test_the_door_holds_at_most_its_bytes():
    """A handoff past the door's share of the rank's memory fails alone; its bytes go."""
    need = 2 * 2 * len(PROMPT) * HEAD_DIM * 4 * 2  # keys and values, 2 heads, 2 layers
    door = Door(LAYOUT, KEY, head_dim=HEAD_DIM, most_bytes=need - 1)
    try:
        send_prompt(door.port)
        wait_for(lambda: door.failed("t1") is not None)
        assert "past its" in door.failed("t1") and door.held_bytes == 0
    finally:
        door.close()
    door = Door(LAYOUT, KEY, head_dim=HEAD_DIM, most_bytes=need)
    try:
        assert send_prompt(door.port) is None
        wait_for(lambda: door.complete("t1"))
        assert door.held_bytes == need
        door.take("t1")
        assert door.held_bytes == 0
    finally:
        door.close()


def test_the_kv_of_another_prompt_is_never_complete():
    door = Door(LAYOUT, KEY, head_dim=HEAD_DIM)
    try:
        assert send_prompt(door.port) is None
        wait_for(lambda: door.complete("t1", tokens_digest(PROMPT)))
        assert not door.complete("t1", tokens_digest(PROMPT[:-1] + [7]))
        assert "not the waiting request's prompt" in door.failed("t1")
    finally:
        door.close()


def test_the_door_listens_on_ipv6_too():
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    door = Door(LAYOUT, KEY, "::1", head_dim=HEAD_DIM)
    try:
        assert door.sock.family == socket.AF_INET6
        assert send_prompt(door.port, host="[::1]") is None
        wait_for(lambda: door.complete("t1"))
        got = door.take("t1")
        assert got.tokens == PROMPT and np.asarray(got.chunks[0][4]).shape[-1] == HEAD_DIM
    finally:
        door.close()


def test_a_ranks_door_listens_on_the_hostfiles_address():
    """The door's address is the host's first ``ips`` entry (the ring's), not its ssh name
    as that host resolves it (127.0.1.1 on Debian-style hosts)."""
    from cluster.core.hostfile import parse_hostfile
    from cluster.core.spec import Handoff, JobSpec, LaunchSettings
    from cluster.job.launcher import rank_launches

    hf = parse_hostfile({"hosts": [{"ssh": "mac-1.local", "ips": ["10.0.0.1"]},
                                   {"ssh": "mac-2.local", "ips": ["fd00::2"]}]})  # fmt: skip
    spec = JobSpec(model="", command="serve", handoff=Handoff("decode", "00" * 32))
    launches = rank_launches(hf, spec, LaunchSettings(starting_port=5000))
    hosts = [json.loads(r.spec)["handoff"]["host"] for r in launches]
    assert hosts == ["10.0.0.1", "fd00::2"]


def test_a_thread_that_cannot_start_pauses_the_door_and_it_goes_on(monkeypatch):
    """No thread to be had for a connection (the rank's threads run out): that connection is
    closed, the door says so and waits, and the next sender gets through."""
    import node.cache.handoff as module

    said: list[str] = []
    real = threading.Thread
    failures = [1]

    class Refusing(real):
        def start(self):
            serving = getattr(getattr(self, "_target", None), "__name__", "") == "_serve"
            if serving and failures[0]:
                failures[0] -= 1
                raise RuntimeError("can't start new thread")
            super().start()

    door = Door(LAYOUT, KEY, head_dim=HEAD_DIM, log=said.append)
    monkeypatch.setattr(module.threading, "Thread", Refusing)
    try:
        assert send_prompt(door.port) is None  # the first link is dropped, the sender retries
        wait_for(lambda: door.complete("t1"), timeout=10)
        assert any("cannot start a thread" in line for line in said), said
    finally:
        door.close()
