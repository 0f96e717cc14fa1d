"""A prompt's KV cache from the ranks of a prefill group to those of a decode group, over
the rig's own links (issue 53; the plan of who sends what: cluster.core.handoff).

Each decode rank listens (``Door``) on its own address. A prefill rank connects to each
decode rank it has pieces for and proves it holds the serve's secret (an HMAC of the door's
random challenge: the door takes KV from no one else), then sends frames as each chunk of the
prompt is prefilled: a JSON header (ticket, layer, the heads' places, the span of tokens, the
arrays' dtype and shape) and the keys' and values' raw bytes. Nothing is unpickled. A
sender ends each ticket with a frame that counts the frames it sent; a decode rank holds a
ticket complete (``Door.complete``) only when every sender it expects ended it, the counts
agree and every layer's every head covers every token: a connection cut halfway, a sender
that died, a count that differs leave the ticket incomplete, and it is never used
(``Door.drop`` forgets it).

A layer whose cache is not plain KV (issue 63: a sliding window, a linear attention's state,
a CacheList) goes once the prompt is prefilled, in a state frame: the cache's ``state`` as
JSON (its arrays named, node.cache.disk.pack_state: the disk tier's form) and the arrays' raw
bytes; a sliding window's may come in head pieces (cluster.core.handoff.plan_pieces).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from cluster.core.handoff import KV, WINDOW, Layout, Piece, tokens_digest, travels_as
from cluster.core.spec import Expect

HEADER = struct.Struct("!I")
MOST_HEADER = 1 << 16  # bytes of one frame's JSON header
MOST_TOKENS = 1 << 22  # tokens of one handed-off prompt
MOST_HEAD_DIM = 1024
MOST_STATE_ARRAYS = 64  # arrays of one layer's state frame
MOST_STATE_DIM = 1 << 24  # the longest axis of one of them
MOST_TICKET = 64  # characters of a ticket
CHALLENGE = 32
SENDER_PROOF, DOOR_PROOF = b"mlx-cluster handoff sender", b"mlx-cluster handoff door"
DTYPES = {"bfloat16": (mx.bfloat16, np.uint16), "float16": (mx.float16, np.float16),
          "float32": (mx.float32, np.float32)}  # fmt: skip
MOST_QUEUED = 256 << 20  # bytes a sender holds for its links before the prefill waits
MOST_AGE_S = 600.0  # a ticket no one took this long after its last frame is dropped
QUIET_S = 120.0  # a handoff from which nothing came this long is given up (and its link)
PROOF_S = 5.0  # the whole proof, both ways, from the door's accept
MOST_UNPROVEN = 16  # connections proving themselves at once; the door closes newer ones
SEND_S = 60.0  # a sender's every read and send (a door that stops reading is given up)
CONNECT_S = 30.0  # a sender's tries to get through a crowded door
PRUNE_EVERY_S = 5.0  # the door's timer: tickets no one took, old tombstones
DOOR_SHARE = 0.25  # of the memory a decode rank has left after loading: what its door may hold
BUSY = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}  # accept() may recover


def proof(key: bytes, challenge: bytes, label: bytes = SENDER_PROOF) -> bytes:
    """The HMAC one side of a link answers the other's challenge with (each side its own
    label, so neither's answer can be reflected back as the other's)."""
    return hmac.new(key, label + challenge, hashlib.sha256).digest()


def to_bytes(a: mx.array) -> tuple[str, bytes]:
    """An array's dtype name and raw bytes (bfloat16 as its 16-bit words)."""
    name = str(a.dtype).removeprefix("mlx.core.")
    if name not in DTYPES:
        raise ValueError(f"a KV cache of {name} cannot be handed off")
    host = np.array(a.view(mx.uint16) if name == "bfloat16" else a, copy=False)
    return name, np.ascontiguousarray(host).tobytes()


def from_bytes(data: bytes | memoryview, name: str, shape: list[int]) -> np.ndarray:
    """The frame's array on the host (bfloat16 as its 16-bit words: ``to_mlx`` reads it)."""
    return np.frombuffer(data, dtype=DTYPES[name][1]).reshape(shape)


def to_mlx(a: np.ndarray, name: str) -> mx.array:
    out = mx.array(a)
    return out.view(DTYPES[name][0]) if name == "bfloat16" else out


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes, or EOFError when the peer closed first; with ``deadline``
    (time.monotonic), TimeoutError once it passes, however the bytes trickle in."""
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        if deadline is not None:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the link closed mid-frame")
        got += k
        if deadline is not None and got < n and time.monotonic() >= deadline:
            raise TimeoutError("too slow")
    return bytes(out)


def send_frame(sock: socket.socket, header: dict, payload: Iterable[bytes] = ()) -> int:
    """One frame; the bytes sent."""
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(HEADER.pack(len(data)) + data)
    sent = HEADER.size + len(data)
    for part in payload:
        sock.sendall(part)
        sent += len(part)
    return sent


def read_header(sock: socket.socket) -> dict:
    (n,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    if n > MOST_HEADER:
        raise ValueError(f"a frame header of {n} bytes")
    header = json.loads(recv_exact(sock, n))
    if not isinstance(header, dict):
        raise ValueError("a frame header that is not an object")
    return header


def read_frame(sock: socket.socket) -> tuple[dict, bytes]:
    """A frame whose header is trusted as to its size (a test's reading of a frame)."""
    header = read_header(sock)
    size = header.get("nbytes", 0)
    if not isinstance(size, int) or size < 0:
        raise ValueError("a frame with a bad size")
    return header, recv_exact(sock, size) if size else b""


def _int(header: dict, name: str, low: int, high: int) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"field {name!r} is {value!r}, not an integer in [{low}, {high}]")
    return value


def check_frame(header: dict, layout: Layout, head_dim: int | None,
                travel: dict[int, str] | None = None) -> int:  # fmt: skip
    """The payload's bytes a frame's header announces, once the header fits the receiving
    rank's layout: its layer, the heads' places, the tokens' span, the dtype, the shape and
    the size agree (ValueError naming the field otherwise). Nothing is allocated before.
    ``travel``: how each layer's cache travels (cluster.core.handoff.travels_as; KV where
    absent): a state frame only for a layer that keeps one."""
    ticket = header.get("ticket")
    if not isinstance(ticket, str) or not 0 < len(ticket) <= MOST_TICKET:
        raise ValueError("a frame without a ticket")
    _int(header, "sender", 0, 1 << 16)
    senders = header.get("senders", [])
    if not isinstance(senders, list) or len(senders) > 1 << 16 or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= 1 << 16
            for s in senders):  # fmt: skip
        raise ValueError("field 'senders' is not a list of ranks")
    nbytes = _int(header, "nbytes", 0, 1 << 40)
    if header.get("last"):
        _int(header, "frames", 0, 1 << 30)
        if nbytes % 4 or not 0 < nbytes // 4 <= MOST_TOKENS:
            raise ValueError(f"an end frame of {nbytes} bytes is not a prompt's tokens")
        return nbytes
    if header.get("layer") not in layout.layers:
        raise ValueError(f"layer {header.get('layer')!r} is not one this rank holds")
    kind = (travel or {}).get(header["layer"], KV)
    if ("state" in header) != (kind != KV):
        raise ValueError(f"layer {header['layer']}'s cache travels as {kind}, not as this frame")
    if kind != KV:
        return check_state_frame(header, layout, kind, nbytes)
    place = header.get("place")
    heads = len(layout.heads)
    if not isinstance(place, list) or not place or len(set(place)) != len(place) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 <= p < heads
            for p in place):  # fmt: skip
        raise ValueError(f"field 'place' is not a list of this rank's {heads} head places")
    start = _int(header, "start", 0, MOST_TOKENS - 1)
    stop = _int(header, "stop", start + 1, MOST_TOKENS)
    dtype = header.get("dtype")
    if dtype not in DTYPES:
        raise ValueError(f"field 'dtype' is {dtype!r}, not one of {sorted(DTYPES)}")
    shape = header.get("shape")
    dim = head_dim or MOST_HEAD_DIM
    if (not isinstance(shape, list) or len(shape) != 4
            or shape[:3] != [1, len(place), stop - start]
            or not isinstance(shape[3], int) or not 0 < shape[3] <= dim
            or (head_dim is not None and shape[3] != head_dim)):  # fmt: skip
        raise ValueError(f"field 'shape' is {shape!r}, not [1, {len(place)}, {stop - start}, "
                         f"{head_dim or 'the head size'}]")  # fmt: skip
    v_dim = header.get("v_dim", shape[3])  # a latent attention's values (its rope keys) differ
    if not isinstance(v_dim, int) or isinstance(v_dim, bool) or not 0 < v_dim <= MOST_HEAD_DIM:
        raise ValueError(f"field 'v_dim' is {v_dim!r}, not a head size")
    size = np.dtype(DTYPES[dtype][1]).itemsize * int(np.prod(shape[:3])) * (shape[3] + v_dim)
    if nbytes != size:
        raise ValueError(f"field 'nbytes' is {nbytes}, not the {size} its shape takes")
    return nbytes


def check_state_frame(header: dict, layout: Layout, kind: str, nbytes: int) -> int:
    """A state frame's payload bytes (``check_frame``): its arrays' names, dtypes and shapes
    bounded and adding up to ``nbytes``; a window's head piece names its heads' places and
    holds keys and values of that many heads."""
    arrays = header.get("arrays")
    if not isinstance(arrays, list) or not 0 < len(arrays) <= MOST_STATE_ARRAYS:
        raise ValueError("field 'arrays' is not a list of a state's arrays")
    size = 0
    for entry in arrays:
        if (not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], str)
                or not 0 < len(entry[0]) <= 64 or entry[1] not in DTYPES
                or not isinstance(entry[2], list) or len(entry[2]) > 6 or not all(
                    isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MOST_STATE_DIM
                    for d in entry[2])):  # fmt: skip
            raise ValueError(f"a state array {str(entry)[:80]} is not [name, dtype, shape]")
        size += np.dtype(DTYPES[entry[1]][1]).itemsize * int(np.prod(entry[2], dtype=np.int64))
    if size != nbytes:
        raise ValueError(f"field 'nbytes' is {nbytes}, not the {size} the state's arrays take")
    place = header.get("place")
    if place is not None:
        heads = len(layout.heads)
        if kind != WINDOW or not isinstance(place, list) or not place or len(set(place)) != len(
                place) or not all(isinstance(p, int) and not isinstance(p, bool)
                                  and 0 <= p < heads for p in place):  # fmt: skip
            raise ValueError(f"field 'place' is not a list of this rank's {heads} head places")
        if len(arrays) != 2 or any(len(a[2]) != 4 or a[2][1] != len(place) for a in arrays):
            raise ValueError("a window's head piece is not keys and values of its heads")
    return nbytes


@dataclass
class Received:
    """A ticket's frames on one decode rank, as they come."""

    tokens: list[int] | None = None  # the tokens the KV stands for (the senders' end frames)
    digest: str = ""  # theirs (tokens_digest), made once on the link's thread
    total: int = 0
    expected: set[int] = field(default_factory=set)  # senders that have pieces for this rank
    ended: dict[int, int] = field(default_factory=dict)  # sender -> frames it counted
    frames: dict[int, int] = field(default_factory=dict)  # sender -> frames that came
    chunks: list[tuple[int, tuple[int, ...], int, int, np.ndarray, np.ndarray]] = field(
        default_factory=list)  # (layer, places, start, end, keys, values)  # fmt: skip
    # layer -> its state frames: (head places, None for the whole state; the state as JSON;
    # its arrays by name, each as (host array, dtype name))
    states: dict[int, list[tuple[tuple[int, ...] | None, Any, dict[str, tuple]]]] = field(
        default_factory=dict)  # fmt: skip
    dtype: str | None = None  # the arrays' (``DTYPES``): every frame's alike
    nbytes: int = 0
    began: float = field(default_factory=time.monotonic)
    heard: float = field(default_factory=time.monotonic)  # its last frame
    failed: str | None = None


class Door:
    """A decode rank's listener for handoffs (a thread accepting, one per connection, a
    timer pruning).

    What it guards against, as a key holder or a stranger might try: a connection must prove
    the key within PROOF_S (and the door proves it back before any KV comes); at most
    MOST_UNPROVEN connections prove themselves at once (newer ones are closed at once), and
    running out of descriptors or threads only pauses the accepting; each frame's header is
    checked against this rank's layout before a byte of its payload is read; the tickets
    hold at most ``most_bytes`` together; a ticket dropped (taken elsewhere, forgotten,
    failed) leaves a tombstone, so its late frames are read past, never kept."""

    def __init__(self, layout: Layout, key: bytes, host: str = "127.0.0.1", port: int = 0,
                 head_dim: int | None = None, most_bytes: int | None = None,
                 log: Callable[[str], None] = lambda line: None,
                 travel: dict[int, str] | None = None):  # fmt: skip
        self.layout, self.key, self.head_dim = layout, key, head_dim
        self.travel = travel or {}  # layer -> how its cache travels (KV where absent)
        self.most_bytes = most_bytes
        self.log = log
        self.sock = listen_on(host, port)
        self.port = self.sock.getsockname()[1]
        self.tickets: dict[str, Received] = {}
        self.tombstones: dict[str, float] = {}  # ticket -> when it was dropped
        self.held_bytes = 0  # of every ticket's frames
        self.unproven = 0
        self.lock = threading.Lock()
        self.closing = threading.Event()
        threading.Thread(target=self._accept, name="handoff-door", daemon=True).start()
        threading.Thread(target=self._prune_every, name="handoff-prune", daemon=True).start()

    @property
    def closed(self) -> bool:
        return self.closing.is_set()

    def close(self) -> None:
        self.closing.set()
        self.sock.close()

    def _accept(self) -> None:
        pause = 0.0
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError as e:
                if self.closed or e.errno in (errno.EBADF, errno.EINVAL):
                    return
                pause = min(1.0, max(0.05, pause * 2))
                if e.errno in BUSY:  # descriptors or buffers run out: wait, then go on
                    self.log(f"handoff door: cannot accept ({e.strerror}); trying again")
                self.closing.wait(pause)
                continue
            pause = 0.0
            with self.lock:
                crowded = self.unproven >= MOST_UNPROVEN
                if not crowded:
                    self.unproven += 1
            if crowded:  # the newest goes: those before it are nearer their proof
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
            except RuntimeError as e:  # no thread to be had: drop it, wait, go on
                with self.lock:
                    self.unproven -= 1
                conn.close()
                self.log(f"handoff door: cannot start a thread ({e}); trying again")
                self.closing.wait(0.5)

    def _prove(self, conn: socket.socket) -> bool:
        """Both sides prove the key, within PROOF_S of the accept."""
        deadline = time.monotonic() + PROOF_S
        try:
            challenge = secrets.token_bytes(CHALLENGE)
            conn.settimeout(PROOF_S)
            conn.sendall(challenge)
            answer = recv_exact(conn, 32 + CHALLENGE, deadline)
            if not hmac.compare_digest(answer[:32], proof(self.key, challenge)):
                return False  # not one of ours: nothing it sent is read
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.sendall(proof(self.key, answer[32:] + challenge, DOOR_PROOF))
            return True
        except (OSError, EOFError):
            return False
        finally:
            with self.lock:
                self.unproven -= 1

    def _serve(self, conn: socket.socket) -> None:
        ticket = None
        try:
            with conn:
                if not self._prove(conn):
                    return
                conn.settimeout(QUIET_S)  # a sender silent this long is not coming back
                while True:
                    header = read_header(conn)
                    named = header.get("ticket")
                    ticket = named if isinstance(named, str) and named else None
                    nbytes = check_frame(header, self.layout, self.head_dim, self.travel)
                    ticket = header["ticket"]
                    if not self._room(ticket, header, nbytes):
                        skip(conn, nbytes)  # a ticket dropped here: its late frames go by
                        continue
                    self._take(ticket, header, recv_exact(conn, nbytes) if nbytes else b"")
        except EOFError:
            pass  # between frames: the sender is done with this link
        except (OSError, ValueError, KeyError, TypeError) as e:
            if ticket is not None:
                self.fail(ticket, f"a handoff frame could not be read ({e})")

    def _room(self, ticket: str, header: dict, nbytes: int) -> bool:
        """Whether this frame's payload is to be kept: not for a dropped or failed ticket;
        one that would take the door past its bytes fails its ticket (ValueError)."""
        with self.lock:
            if ticket in self.tombstones:
                return False
            got = self.tickets.get(ticket)
            if got is not None and got.failed:
                return False
            if header.get("last"):
                return True
            if self.most_bytes is not None and self.held_bytes + nbytes > self.most_bytes:
                raise ValueError(f"{nbytes} more bytes would take the door past its "
                                 f"{self.most_bytes} (a share of this rank's memory)")  # fmt: skip
            return True

    def _take(self, ticket: str, header: dict, payload: bytes) -> None:
        with self.lock:
            if ticket in self.tombstones:
                return
            got = self.tickets.setdefault(ticket, Received())
            if got.failed:
                return
            got.heard = time.monotonic()
            sender = int(header["sender"])
            got.expected.update(int(s) for s in header.get("senders", []))
            if header.get("last"):
                got.ended[sender] = int(header["frames"])
                tokens = np.frombuffer(payload, dtype="<i4").tolist()
                if got.tokens is not None and got.tokens != tokens:
                    self._fail(got, "the senders' end frames name different tokens")
                    return
                if got.tokens is None:
                    got.digest = tokens_digest(tokens)
                got.tokens, got.total = tokens, len(tokens)
                return
            if "state" in header:
                got.frames[sender] = got.frames.get(sender, 0) + 1
                arrays, at, view = {}, 0, memoryview(payload)
                for array_name, dtype, shape in header["arrays"]:
                    size = np.dtype(DTYPES[dtype][1]).itemsize * int(np.prod(shape, dtype=np.int64))
                    arrays[array_name] = (from_bytes(view[at : at + size], dtype, shape), dtype)
                    at += size
                place = header.get("place")
                got.states.setdefault(int(header["layer"]), []).append(
                    (tuple(place) if place is not None else None, header["state"], arrays)
                )
                got.nbytes += len(payload)
                self.held_bytes += len(payload)
                return
            name, shape = header["dtype"], list(header["shape"])
            if got.dtype is not None and name != got.dtype:
                self._fail(got, f"a frame of {name} in a handoff of {got.dtype}")
                return
            got.dtype = name
            got.frames[sender] = got.frames.get(sender, 0) + 1
            v_shape = [*shape[:3], int(header.get("v_dim", shape[3]))]
            half, view = len(payload) * shape[3] // (shape[3] + v_shape[3]), memoryview(payload)
            keys = from_bytes(view[:half], name, shape)
            values = from_bytes(view[half:], name, v_shape)
            span = int(header["start"]), int(header["stop"])
            got.chunks.append((int(header["layer"]), tuple(header["place"]), *span, keys, values))
            got.nbytes += len(payload)
            self.held_bytes += len(payload)

    def _fail(self, got: Received, why: str) -> None:
        """(Under the lock.) The ticket is given up: its bytes go now, its record stays to
        say why."""
        got.failed = got.failed or why
        self.held_bytes -= got.nbytes
        got.chunks, got.states, got.nbytes = [], {}, 0

    def heard(self, ticket: str) -> float | None:
        """When this ticket's last frame came (time.monotonic), None before its first."""
        with self.lock:
            got = self.tickets.get(ticket)
            return None if got is None else got.heard

    def fail(self, ticket: str, why: str) -> None:
        with self.lock:
            if ticket not in self.tombstones and len(ticket) <= MOST_TICKET:
                self._fail(self.tickets.setdefault(ticket, Received()), why)

    def complete(self, ticket: str, tokens: str | None = None) -> bool:
        """Whether every sender ended the ticket, every frame came, every layer's every head
        covers the prompt's every token, and (``tokens``: the digest of the prompt the
        waiting request has, ``tokens_digest``) the end frames name that prompt."""
        with self.lock:
            got = self.tickets.get(ticket)
            if got is None or got.failed or not got.expected:
                return False
            if set(got.ended) != got.expected or any(
                got.frames.get(s, 0) != n for s, n in got.ended.items()
            ):
                return False
            if tokens is not None and got.digest != tokens:
                self._fail(got, "the handed-off tokens are not the waiting request's prompt")
                return False
            return covered(got, self.layout, self.travel)

    def failed(self, ticket: str) -> str | None:
        with self.lock:
            got = self.tickets.get(ticket)
            return got.failed if got is not None else None

    def take(self, ticket: str) -> Received:
        """A complete ticket's frames, forgotten here (its late frames too)."""
        with self.lock:
            got = self.tickets.pop(ticket)
            self.held_bytes -= got.nbytes
            self.tombstones[ticket] = time.monotonic()
            return got

    def drop(self, ticket: str) -> None:
        """Forget a ticket and whatever of it comes later."""
        with self.lock:
            got = self.tickets.pop(ticket, None)
            if got is not None:
                self.held_bytes -= got.nbytes
            self.tombstones[ticket] = time.monotonic()

    def prune(self, now: float) -> None:
        """Tickets no one took MOST_AGE_S after their last frame are dropped; tombstones
        are kept as long (a sender quiet longer lost its link: QUIET_S)."""
        with self.lock:
            for t in [t for t, r in self.tickets.items() if now - r.heard > MOST_AGE_S]:
                self.held_bytes -= self.tickets.pop(t).nbytes
                self.tombstones[t] = now
            for t in [t for t, at in self.tombstones.items() if now - at > MOST_AGE_S]:
                del self.tombstones[t]

    def _prune_every(self) -> None:
        while not self.closing.wait(PRUNE_EVERY_S):
            self.prune(time.monotonic())


def listen_on(host: str, port: int) -> socket.socket:
    """A listening socket on ``host`` (an IPv4 or IPv6 address, or a name), ``port``."""
    host = host.strip("[]")
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return socket.create_server(address[:2], family=family, backlog=128)


def skip(sock: socket.socket, n: int) -> None:
    """Read ``n`` bytes past, a bounded buffer at a time."""
    while n > 0:
        n -= len(recv_exact(sock, min(n, 1 << 20)))


def covered(got: Received, layout: Layout, travel: dict[int, str] | None = None) -> bool:
    """Every head place of every KV layer of ``layout`` has the tokens [0, total) without
    gaps; every other layer its whole state, or (a window) each head place once."""
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for layer, places, start, end, _, _ in got.chunks:
        for p in places:
            spans.setdefault((layer, p), []).append((start, end))
    for layer in layout.layers:
        if (travel or {}).get(layer, KV) != KV:
            frames = got.states.get(layer, [])
            whole = [f for f in frames if f[0] is None]
            came = sorted(p for f in frames if f[0] is not None for p in f[0])
            if not (len(whole) == 1 == len(frames) or came == list(range(len(layout.heads)))):
                return False
            continue
        for p in range(len(layout.heads)):
            at = 0
            for start, end in sorted(spans.get((layer, p), [])):
                if start != at:
                    return False
                at = end
            if at != got.total:
                return False
    return True


def layer_arrays(got: Received, layout: Layout) -> dict[int, tuple[mx.array, mx.array]]:
    """Each layer's keys and values (1, heads, tokens, head dim) in the receiver's head
    order, from a complete ticket's chunks: put in place on the host (one copy per chunk),
    then one array each for MLX, so the decode loop that adopts it waits little."""
    out = {}
    for layer in layout.layers:
        mine = [c for c in got.chunks if c[0] == layer]
        if not mine:  # a layer whose state came whole (``layer_states``)
            continue
        k0 = mine[0][4]
        keys = np.empty((k0.shape[0], len(layout.heads), got.total, k0.shape[3]), k0.dtype)
        values = np.empty((k0.shape[0], len(layout.heads), got.total, mine[0][5].shape[3]),
                          mine[0][5].dtype)  # fmt: skip
        for _, places, start, stop, k, v in mine:
            keys[:, list(places), start:stop] = k
            values[:, list(places), start:stop] = v
        out[layer] = (to_mlx(keys, got.dtype or "float32"), to_mlx(values, got.dtype or "float32"))
    return out


def layer_states(got: Received, layout: Layout) -> dict[int, Any]:
    """Each state layer's ``state`` (node.cache.disk.unpack_state's form), from a complete
    ticket's state frames: a window's head pieces put in place on the head axis, their
    numbers (offset, window, ...) the same in every piece (ValueError otherwise)."""
    from node.cache.disk import unpack_state

    out = {}
    for layer, frames in got.states.items():
        if frames[0][0] is None:
            _, packed, arrays = frames[0]
            out[layer] = unpack_state(packed, {n: to_mlx(a, d) for n, (a, d) in arrays.items()})
            continue
        packed = frames[0][1]
        if any(f[1] != packed for f in frames):  # names and numbers: alike in every piece
            raise ValueError(f"layer {layer}'s window came in pieces that disagree")
        names = [n for n, _ in sorted(frames[0][2].items())]
        whole = {}
        for name in names:
            first, dtype = frames[0][2][name]
            shape = (first.shape[0], len(layout.heads), *first.shape[2:])
            buffer = np.empty(shape, first.dtype)
            for at, _, arrays in frames:
                part, _ = arrays[name]
                if part.shape[2:] != first.shape[2:]:
                    raise ValueError(f"layer {layer}'s window came in pieces that disagree")
                buffer[:, list(at or ())] = part
            whole[name] = to_mlx(buffer, dtype)
        out[layer] = unpack_state(packed, whole)
    return out


def connect(door: tuple[str, int], key: bytes) -> socket.socket:
    """A proven link to a decode rank's door: the door proves the key to us too before any KV
    goes. A crowded door closes newer links before its challenge: tried again for CONNECT_S;
    every read and send after has SEND_S. OSError or ValueError says why not."""
    host, port = door
    deadline = time.monotonic() + CONNECT_S
    pause = 0.05
    while True:
        try:  # a full listen queue drops our SYN: the kernel sends it again, we wait
            sock = socket.create_connection(
                (host.strip("[]"), port), timeout=max(0.1, deadline - time.monotonic())
            )
        except TimeoutError:
            raise OSError(f"the door at {host}:{port} did not answer in {CONNECT_S:g} s") from None
        try:
            try:
                challenge = recv_exact(sock, CHALLENGE, time.monotonic() + PROOF_S)
            except (EOFError, ConnectionResetError):
                if time.monotonic() + pause >= deadline:
                    raise OSError(f"the door at {host}:{port} stayed crowded") from None
                sock.close()
                time.sleep(pause)  # a crowded door: its unproven links go within PROOF_S
                pause = min(1.0, pause * 2)
                continue
            mine = secrets.token_bytes(CHALLENGE)
            sock.settimeout(PROOF_S)
            sock.sendall(proof(key, challenge) + mine)
            answer = recv_exact(sock, 32, time.monotonic() + PROOF_S)
            if not hmac.compare_digest(answer, proof(key, mine + challenge, DOOR_PROOF)):
                raise ValueError(f"the door at {host}:{port} did not prove the serve's key")
            sock.settimeout(SEND_S)
            return sock
        except (OSError, EOFError, ValueError) as e:
            sock.close()
            if isinstance(e, ValueError):
                raise
            raise OSError(f"the door at {host}:{port} refused the link ({e})") from None


class Sender:
    """A prefill rank's links to the decode ranks it has pieces for: frames go out on a
    thread, so the prefill's next chunk runs while the last one's KV crosses the link."""

    def __init__(self, rank: int, pieces: list[Piece], doors: list[tuple[str, int]],
                 key: bytes):  # fmt: skip
        self.rank, self.key = rank, key
        self.pieces = [p for p in pieces if p.sender == rank]
        self.receivers = sorted({p.receiver for p in self.pieces})
        self.senders_of = {r: sorted({p.sender for p in pieces if p.receiver == r})
                           for r in self.receivers}  # fmt: skip
        self.doors = doors
        self.socks: dict[int, socket.socket] = {}
        self.counts: dict[int, int] = {}
        self.sent_bytes = 0
        self.queue: queue.Queue = queue.Queue()
        self.held = 0
        self.cond = threading.Condition()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="handoff-send", daemon=True)
        self.thread.start()

    def _connect(self, r: int) -> socket.socket:
        if r not in self.socks:
            self.socks[r] = connect(self.doors[r], self.key)
        return self.socks[r]

    def chunk(self, ticket: str, start: int, end: int,
              layers: dict[int, tuple[mx.array, mx.array]]) -> None:  # fmt: skip
        """Queue this rank's pieces of the tokens [start, end): ``layers`` maps each layer
        this rank holds to its keys and values of those tokens (1, heads, tokens, dim)."""
        for p in self.pieces:
            if p.layer not in layers:
                continue
            k, v = layers[p.layer]
            idx = mx.array(p.send)
            k, v = k[:, idx], v[:, idx]
            mx.eval(k, v)
            self._put(("frame", p, ticket, start, end, k, v), k.nbytes + v.nbytes)

    def states(self, ticket: str, states: dict[int, Any]) -> None:
        """Queue this rank's pieces of the layers that keep a state (``states``: each such
        layer it holds -> its cache's ``state``), once the prompt is prefilled: whole, or a
        window's heads (its keys and values sliced, its numbers as they are)."""
        from node.cache.disk import pack_state

        for p in self.pieces:
            if p.layer not in states:
                continue
            arrays: dict[str, mx.array] = {}
            value = states[p.layer]
            if not p.whole:
                keys, values, *numbers = value
                idx = mx.array(p.send)
                value = (keys[:, idx], values[:, idx], *numbers)
            packed = pack_state(value, "s", arrays)
            mx.eval(list(arrays.values()))
            self._put(("state", p, ticket, packed, arrays), sum(a.nbytes for a in arrays.values()))

    def end(self, ticket: str, tokens: list[int]) -> None:
        self._put(("end", ticket, tokens), 0)

    def _put(self, item: tuple, nbytes: int) -> None:
        with self.cond:
            while self.held > MOST_QUEUED and self.error is None:
                self.cond.wait()
            self.held += nbytes
        self.queue.put((item, nbytes))

    def finish(self) -> str | None:
        """Wait until every frame left; the first error, if any."""
        self.queue.put(None)
        self.thread.join()
        for sock in self.socks.values():
            sock.close()
        return self.error

    def _run(self) -> None:
        while (got := self.queue.get()) is not None:
            item, nbytes = got
            try:
                if self.error is None:
                    self._send(item)
            except (OSError, ValueError) as e:
                self.error = f"the handoff to a decode rank failed ({e})"
            with self.cond:
                self.held -= nbytes
                self.cond.notify_all()

    def _send(self, item: tuple) -> None:
        if item[0] == "end":
            _, ticket, tokens = item
            data = np.asarray(tokens, dtype="<i4").tobytes()
            for r in self.receivers:
                header = {"ticket": ticket, "sender": self.rank, "last": True,
                          "frames": self.counts.get(r, 0), "senders": self.senders_of[r],
                          "nbytes": len(data)}  # fmt: skip
                self.sent_bytes += send_frame(self._connect(r), header, (data,))
            return
        if item[0] == "state":
            _, p, ticket, packed, arrays = item
            entries, parts = [], []
            for array_name, a in arrays.items():
                dtype, data = to_bytes(a)
                entries.append([array_name, dtype, list(a.shape)])
                parts.append(data)
            header = {"ticket": ticket, "sender": self.rank,
                      "senders": self.senders_of[p.receiver], "layer": p.layer, "state": packed,
                      "arrays": entries, "nbytes": sum(len(d) for d in parts)}  # fmt: skip
            if not p.whole:
                header["place"] = list(p.place)
            self.sent_bytes += send_frame(self._connect(p.receiver), header, parts)
            self.counts[p.receiver] = self.counts.get(p.receiver, 0) + 1
            return
        _, p, ticket, start, end, k, v = item
        name, kb = to_bytes(k)
        _, vb = to_bytes(v)
        header = {"ticket": ticket, "sender": self.rank, "senders": self.senders_of[p.receiver],
                  "layer": p.layer, "place": list(p.place), "start": start, "stop": end,
                  "dtype": name, "shape": list(k.shape), "nbytes": len(kb) + len(vb)}  # fmt: skip
        if v.shape[3] != k.shape[3]:
            header["v_dim"] = v.shape[3]
        self.sent_bytes += send_frame(self._connect(p.receiver), header, (kb, vb))
        self.counts[p.receiver] = self.counts.get(p.receiver, 0) + 1


def fill_cache(cache: list, slots: dict[int, int], arrays: dict[int, Any],
               states: dict[int, Any] | None = None) -> list:  # fmt: skip
    """``cache`` (the model's fresh cache list) holding the handed-off keys and values, and
    the other layers' states (``layer_states``): ``slots`` maps each layer to its place in
    the list."""
    for layer, (k, v) in arrays.items():
        cache[slots[layer]].update_and_fetch(k, v)  # laid out as a prefill lays it out
    for layer, state in (states or {}).items():
        cache[slots[layer]].state = state
    mx.eval([(cache[slots[layer]].keys, cache[slots[layer]].values) for layer in arrays])
    mx.eval([cache[slots[layer]].state for layer in states or {}])
    return cache


# A rank's side of handoffs in serve (issue 53): a decode rank's door, the tickets every
# rank of its group expects (in the order rank 0's orders named them, the same everywhere).
DOOR: Door | None = None
PENDING: dict[str, str] = {}  # ticket -> the digest of the tokens it must hold


def rank_layouts(loaded, mode: str, world: int, split, weights) -> list[Layout]:
    from cluster.core.handoff import group_layouts

    return group_layouts(loaded.config, mode, world, split, weights)


def cache_slots(cache: list, layout: Layout) -> dict[int, int]:
    """Each of ``layout``'s layers -> its place in the model's cache list (a pipeline stage's
    list covers every layer, its others' as SkippedCache; a family's own pipeline() keeps
    its own layers only); ValueError when a layer's cache cannot travel: a quantized one, or
    one that cannot be set from its state."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if len(cache) == len(layout.layers):
        slots = {layer: i for i, layer in enumerate(layout.layers)}
    else:
        slots = {layer: layer for layer in layout.layers}
    for layer, i in slots.items():
        kind = type(cache[i])
        settable = getattr(getattr(kind, "state", None), "fset", None) is not None
        if kind is not KVCache and (issubclass(kind, QuantizedKVCache) or not settable):
            raise ValueError(f"layer {layer}'s cache is a {kind.__name__}: it cannot be handed "
                             "between groups (serve without prefill groups)")  # fmt: skip
    return slots


def cache_kinds(cache: list, slots: dict[int, int]) -> dict[int, str]:
    """Each layer's cache class (its name) that this rank's fresh cache list names: its own
    layers', and a pipeline stage's skipped slots' (the kind each stands for), so every rank
    of a group plans a handoff alike (cluster.core.handoff.plan_pieces)."""
    from node.model.stage import SkippedCache

    full = {layer: layer for layer in range(len(cache))} if len(cache) > len(slots) else {}
    kinds = {}
    for layer, i in {**full, **slots}.items():
        c = cache[i]
        kinds[layer] = (c.kind or "KVCache") if isinstance(c, SkippedCache) else type(c).__name__
    return kinds


def open_door(loaded, spec, rank: int, log: Callable[[str], None] = lambda line: None) -> int:
    """A decode rank's door, on its address; its port (the launcher tells prefill groups).
    It holds at most DOOR_SHARE of the memory the rank has left once loaded."""
    from mlx_lm.models.cache import make_prompt_cache

    from cluster.core.modelcheck import text_config
    from node.rank.memory import memory_left

    global DOOR
    layout = rank_layouts(loaded, spec.mode, spec.world_size, spec.split, spec.split_weights)[rank]
    fresh = make_prompt_cache(loaded.model)
    slots = cache_slots(fresh, layout)  # a cache that can take KV, or why not
    travel = {layer: travels_as(kind) for layer, kind in cache_kinds(fresh, slots).items()}
    text = text_config(loaded.config)
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    head_dim = (
        text.get("kv_lora_rank")
        or text.get("head_dim")
        or (hidden // heads if heads and hidden else None)
    )  # a latent attention's: its rank
    most = int(memory_left(spec.ranks_on_host) * DOOR_SHARE)
    DOOR = Door(layout, bytes.fromhex(spec.handoff.key), spec.handoff.host,
                head_dim=head_dim if isinstance(head_dim, int) else None, most_bytes=most,
                log=log, travel=travel)  # fmt: skip
    return DOOR.port


def heard(ticket: str) -> float | None:
    """When this rank's door last had a frame of ``ticket`` (rank 0's: the decode group's
    sign that a handoff is under way)."""
    return None if DOOR is None else DOOR.heard(ticket)


def held_bytes() -> int | None:
    """Bytes of handed-off KV this rank's door holds now (None: no door)."""
    return None if DOOR is None else DOOR.held_bytes


def expect(tickets: list[Expect]) -> None:
    for e in tickets:
        PENDING.setdefault(e.ticket, e.tokens)


def forget(tickets: list[str]) -> None:
    for t in tickets:
        PENDING.pop(t, None)
        if DOOR is not None:
            DOOR.drop(t)


FAILED_FLAG = 1 << 16  # a rank's flag for a ticket its door failed (any rank's: all see it)


def agree_handed(group, wait: float) -> tuple[list[str], list[str]]:
    """Every rank at once: (the pending tickets every rank holds whole, those some rank's
    door failed: the KV of another prompt, a bad frame, past its bytes), one all_sum of a
    flag per ticket; ``wait``: how long a rank with nothing to decode waits for them first."""
    from node.rank.dist import control_stream
    from node.rank.numbers import host_ints

    door = DOOR

    def flag(ticket: str, tokens: str) -> int:
        if door is None:
            return 0
        if door.complete(ticket, tokens):
            return 1
        return FAILED_FLAG if door.failed(ticket) else 0

    deadline = time.monotonic() + wait
    while True:
        flags = [flag(t, d) for t, d in PENDING.items()]
        if all(flags) or time.monotonic() >= deadline:
            break
        time.sleep(0.002)
    size = 1 if group is None else group.size()
    if size > 1:
        counts = mx.distributed.all_sum(mx.array(flags, dtype=mx.int32), group=group,
                                        stream=control_stream())  # fmt: skip
        flags = host_ints(counts)
    done = [t for t, n in zip(PENDING, flags, strict=True) if n == size]
    failed = [t for t, n in zip(PENDING, flags, strict=True) if n >= FAILED_FLAG]
    return done, failed


def adopted_cache(ticket: str, model) -> tuple[Received, list]:
    """A ticket every rank holds whole, as (what came, a cache holding its KV)."""
    from mlx_lm.models.cache import make_prompt_cache

    if DOOR is None:
        raise RuntimeError("a handoff adopted on a rank without a door")
    got = DOOR.take(ticket)
    PENDING.pop(ticket, None)
    cache = make_prompt_cache(model)
    fill_cache(cache, cache_slots(cache, DOOR.layout), layer_arrays(got, DOOR.layout),
               layer_states(got, DOOR.layout))  # fmt: skip
    return got, cache


def handoff_figures(got: Received, group) -> dict:
    """The answer's timings of its handoff, the same on every rank: tokens, the bytes every
    rank of the group took in, and the time from rank 0's first frame to its adoption."""
    from node.rank.dist import control_stream
    from node.rank.numbers import host_float

    nbytes = float(got.nbytes)
    if group is not None and group.size() > 1:
        total = mx.distributed.all_sum(mx.array([nbytes]), group=group, stream=control_stream())
        nbytes = host_float(total[0])
    return {"handoff_n": got.total, "handoff_bytes": int(nbytes),
            "handoff_ms": round((time.monotonic() - got.began) * 1000, 1)}  # fmt: skip


def check_windows(states: dict[int, Any], kinds: dict[int, str], heads: int,
                  pieces: list[Piece], rank: int) -> None:  # fmt: skip
    """ValueError when a window this rank sends by heads does not hold the model's count of
    KV heads (MiMo's sliding layers have their own: re-cut by the layout's, they would go
    to the wrong places)."""
    for p in pieces:
        if p.sender == rank and not p.whole and travels_as(kinds[p.layer]) == WINDOW:
            held = states[p.layer][0].shape[1]
            if held != heads:
                raise ValueError(
                    f"layer {p.layer}'s sliding window keeps {held} KV heads, not the model's "
                    f"{heads}: it can be handed only between groups of the same mode and size"
                )


def prefill_chunks(order, loaded, group, step: int, tick, cancelled: Callable[[], bool],
                   sender: Sender, cache: list, slots: dict[int, int],
                   kv: dict[int, int]) -> str | None:  # fmt: skip
    """``order.tokens`` prefilled into ``cache`` a chunk at a time, each chunk's KV (the
    layers in ``kv``) queued to ``sender``; CANCELLED when rank 0's client left."""
    from cluster.core.protocol import CANCELLED
    from node.rank.dist import rank0_stopped

    tokens = order.tokens
    for start in range(0, len(tokens), step):
        end = min(len(tokens), start + step)
        loaded.model(mx.array(tokens[start:end])[None], cache=cache)
        mx.eval([cache[i].state for i in slots.values()])
        sender.chunk(order.handoff.ticket, start, end, {
            layer: (cache[i].keys[:, :, start:end], cache[i].values[:, :, start:end])
            for layer, i in kv.items()})  # fmt: skip
        tick()
        if end < len(tokens) and (
            rank0_stopped(cancelled(), group, mx.default_stream(mx.default_device()))
            if group is not None and group.size() > 1
            else cancelled()
        ):
            return CANCELLED
    return None


def prefill_and_send(
    order, loaded, spec, group, step: int, tick, cancelled: Callable[[], bool] = lambda: False
) -> tuple[int, float, str | None, bool]:
    """A prefill group's every rank: prefill ``order.tokens`` a chunk of ``step`` at a time,
    each chunk's KV to the decode ranks as it is done; (bytes this group sent, seconds,
    the first rank's error or None, whether the error is the plan's: every prompt would
    meet it), the same on every rank. After each chunk every rank
    learns whether rank 0's ``cancelled()`` (its client left): then they stop there, send no
    end frame (the decode ranks never take what came) and say CANCELLED."""
    from mlx_lm.models.cache import make_prompt_cache

    from cluster.core.handoff import plan_pieces
    from cluster.core.protocol import CANCELLED
    from node.rank.dist import control_stream
    from node.rank.numbers import host_floats

    h = order.handoff
    began = time.perf_counter()
    mine = rank_layouts(loaded, spec.mode, spec.world_size, spec.split, spec.split_weights)
    rank = group.rank() if group is not None else 0
    error: str | None = None
    sender = None
    pieces: list[Piece] = []
    cache: list = []
    slots: dict[int, int] = {}
    kinds: dict[int, str] = {}
    kv: dict[int, int] = {}
    try:  # the plan first, agreed before any rank prefills (a stage waits for its peers)
        theirs = rank_layouts(loaded, h.mode, h.world, h.split, h.weights)
        cache = make_prompt_cache(loaded.model)
        slots = cache_slots(cache, mine[rank])
        kinds = cache_kinds(cache, slots)
        pieces = plan_pieces(mine, theirs, kinds)
        kv = {layer: i for layer, i in slots.items() if travels_as(kinds[layer]) == KV}
    except ValueError as e:
        error = f"rank {rank}: {e}"
    if group is not None and group.size() > 1:
        flags = mx.distributed.all_sum(mx.array([1.0 if error else 0.0]), group=group,
                                       stream=control_stream())  # fmt: skip
        if host_floats(flags)[0] and error is None:
            error = "another rank of the prefill group cannot hand this model's cache off"
    if error is not None:  # the plan, not this prompt: the same for every prompt
        return 0, time.perf_counter() - began, error, True
    try:
        if error is None:
            sender = Sender(rank, pieces, [(str(d[0]), int(d[1])) for d in h.doors],
                            bytes.fromhex(spec.handoff.key))  # fmt: skip
            error = prefill_chunks(order, loaded, group, step, tick, cancelled, sender,
                                   cache, slots, kv)  # fmt: skip
            if error is None:
                states = {layer: cache[i].state for layer, i in slots.items() if layer not in kv}
                check_windows(states, kinds, len(mine[rank].heads), pieces, rank)
                sender.states(h.ticket, states)
                sender.end(h.ticket, order.tokens)
    except (OSError, ValueError, RuntimeError) as e:
        error = f"rank {rank}: {e}"
    if sender is not None:
        closed = sender.finish()  # a cancel's links may close under it: still a cancel
        error = error if error == CANCELLED else closed or error
    figures = [float(sender.sent_bytes if sender else 0), 1.0 if error else 0.0]
    if group is not None and group.size() > 1:
        total = mx.distributed.all_sum(mx.array(figures), group=group, stream=control_stream())
        figures = host_floats(total)
        if figures[1] and error is None:
            error = "another rank of the prefill group could not hand its KV off"
    return int(figures[0]), time.perf_counter() - began, error, False
