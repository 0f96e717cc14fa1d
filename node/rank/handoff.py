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
"""

from __future__ import annotations

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

from cluster.core.handoff import Layout, Piece

HEADER = struct.Struct("!I")
MOST_HEADER = 1 << 16  # bytes of one frame's JSON header
CHALLENGE = 32
PROOF = b"mlx-cluster handoff"
DTYPES = {"bfloat16": (mx.bfloat16, np.uint16), "float16": (mx.float16, np.float16),
          "float32": (mx.float32, np.float32)}  # fmt: skip
MOST_QUEUED = 256 << 20  # bytes a sender holds for its links before the prefill waits
MOST_AGE_S = 600.0  # a ticket no one took this long after its last frame is dropped
QUIET_S = 120.0  # a handoff from which nothing came this long is given up (and its link)


def proof(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, PROOF + challenge, hashlib.sha256).digest()


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


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, or EOFError when the peer closed first."""
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the link closed mid-frame")
        got += k
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


def read_frame(sock: socket.socket) -> tuple[dict, bytes]:
    (n,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    if n > MOST_HEADER:
        raise ValueError(f"a frame header of {n} bytes")
    header = json.loads(recv_exact(sock, n))
    if not isinstance(header, dict):
        raise ValueError("a frame header that is not an object")
    size = header.get("nbytes", 0)
    if not isinstance(size, int) or size < 0:
        raise ValueError("a frame with a bad size")
    return header, recv_exact(sock, size) if size else b""


@dataclass
class Received:
    """A ticket's frames on one decode rank, as they come."""

    tokens: list[int] | None = None  # the tokens the KV stands for (the senders' end frames)
    total: int = 0
    expected: set[int] = field(default_factory=set)  # senders that have pieces for this rank
    ended: dict[int, int] = field(default_factory=dict)  # sender -> frames it counted
    frames: dict[int, int] = field(default_factory=dict)  # sender -> frames that came
    chunks: list[tuple[int, tuple[int, ...], int, int, np.ndarray, np.ndarray]] = field(
        default_factory=list)  # (layer, places, start, end, keys, values)  # fmt: skip
    dtype: str = "float32"  # the arrays' (``DTYPES``)
    nbytes: int = 0
    began: float = field(default_factory=time.monotonic)
    heard: float = field(default_factory=time.monotonic)  # its last frame
    failed: str | None = None


class Door:
    """A decode rank's listener for handoffs (a thread accepting, one per connection)."""

    def __init__(self, layout: Layout, key: bytes, host: str = "127.0.0.1", port: int = 0):
        self.layout, self.key = layout, key
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self.tickets: dict[str, Received] = {}
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, name="handoff-door", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        ticket = None
        try:
            with conn:
                conn.settimeout(QUIET_S)  # a sender silent this long is not coming back
                challenge = secrets.token_bytes(CHALLENGE)
                conn.sendall(challenge)
                if not hmac.compare_digest(recv_exact(conn, 32), proof(self.key, challenge)):
                    return  # not one of ours: nothing it sent is read
                while True:
                    header, payload = read_frame(conn)
                    ticket = header.get("ticket")
                    if not isinstance(ticket, str):
                        raise ValueError("a frame without a ticket")
                    self._take(ticket, header, payload)
        except EOFError:
            pass  # between frames: the sender is done with this link
        except (OSError, ValueError, KeyError, TypeError) as e:
            if ticket is not None:
                self.fail(ticket, f"a handoff frame could not be read ({e})")

    def _take(self, ticket: str, header: dict, payload: bytes) -> None:
        with self.lock:
            if ticket not in self.tickets:  # and those no one took: their requests went away
                now = time.monotonic()
                for t in [t for t, r in self.tickets.items() if now - r.heard > MOST_AGE_S]:
                    del self.tickets[t]
            got = self.tickets.setdefault(ticket, Received())
            if got.failed:
                return
            got.heard = time.monotonic()
            sender = int(header["sender"])
            got.expected.update(int(s) for s in header.get("senders", []))
            if header.get("last"):
                got.ended[sender] = int(header["frames"])
                got.tokens = np.frombuffer(payload, dtype="<i4").tolist()
                got.total = len(got.tokens)
                return
            got.frames[sender] = got.frames.get(sender, 0) + 1
        name, shape = header["dtype"], list(header["shape"])
        half, view = len(payload) // 2, memoryview(payload)
        keys = from_bytes(view[:half], name, shape)
        values = from_bytes(view[half:], name, shape)
        with self.lock:
            got.dtype = name
            span = int(header["start"]), int(header["stop"])
            got.chunks.append((int(header["layer"]), tuple(header["place"]), *span, keys, values))
            got.nbytes += len(payload)

    def heard(self, ticket: str) -> float | None:
        """When this ticket's last frame came (time.monotonic), None before its first."""
        with self.lock:
            got = self.tickets.get(ticket)
            return None if got is None else got.heard

    def fail(self, ticket: str, why: str) -> None:
        with self.lock:
            self.tickets.setdefault(ticket, Received()).failed = why

    def complete(self, ticket: str) -> bool:
        """Whether every sender ended the ticket, every frame came and every layer's every
        head covers the prompt's every token."""
        with self.lock:
            got = self.tickets.get(ticket)
            if got is None or got.failed or not got.expected:
                return False
            if set(got.ended) != got.expected or any(
                got.frames.get(s, 0) != n for s, n in got.ended.items()
            ):
                return False
            return covered(got, self.layout)

    def failed(self, ticket: str) -> str | None:
        with self.lock:
            got = self.tickets.get(ticket)
            return got.failed if got is not None else None

    def take(self, ticket: str) -> Received:
        """A complete ticket's frames, forgotten here."""
        with self.lock:
            return self.tickets.pop(ticket)

    def drop(self, ticket: str) -> None:
        with self.lock:
            self.tickets.pop(ticket, None)


def covered(got: Received, layout: Layout) -> bool:
    """Every head place of every layer of ``layout`` has the tokens [0, total) without gaps."""
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for layer, places, start, end, _, _ in got.chunks:
        for p in places:
            spans.setdefault((layer, p), []).append((start, end))
    for layer in layout.layers:
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
        k0 = mine[0][4]
        keys = np.empty((k0.shape[0], len(layout.heads), got.total, k0.shape[3]), k0.dtype)
        values = np.empty((k0.shape[0], len(layout.heads), got.total, mine[0][5].shape[3]),
                          mine[0][5].dtype)  # fmt: skip
        for _, places, start, stop, k, v in mine:
            keys[:, list(places), start:stop] = k
            values[:, list(places), start:stop] = v
        out[layer] = (to_mlx(keys, got.dtype), to_mlx(values, got.dtype))
    return out


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
            host, port = self.doors[r]
            sock = socket.create_connection((host, port), timeout=30)
            sock.settimeout(None)
            sock.sendall(proof(self.key, recv_exact(sock, CHALLENGE)))
            self.socks[r] = sock
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
        _, p, ticket, start, end, k, v = item
        name, kb = to_bytes(k)
        _, vb = to_bytes(v)
        header = {"ticket": ticket, "sender": self.rank, "senders": self.senders_of[p.receiver],
                  "layer": p.layer, "place": list(p.place), "start": start, "stop": end,
                  "dtype": name, "shape": list(k.shape), "nbytes": len(kb) + len(vb)}  # fmt: skip
        self.sent_bytes += send_frame(self._connect(p.receiver), header, (kb, vb))
        self.counts[p.receiver] = self.counts.get(p.receiver, 0) + 1


def fill_cache(cache: list, slots: dict[int, int], arrays: dict[int, Any]) -> list:
    """``cache`` (the model's fresh cache list) holding the handed-off keys and values:
    ``slots`` maps each layer to its place in the list."""
    for layer, (k, v) in arrays.items():
        cache[slots[layer]].update_and_fetch(k, v)  # laid out as a prefill lays it out
    mx.eval([(cache[slots[layer]].keys, cache[slots[layer]].values) for layer in arrays])
    return cache


# A rank's side of handoffs in serve (issue 53): a decode rank's door, the tickets every
# rank of its group expects (in the order rank 0's orders named them, the same everywhere).
DOOR: Door | None = None
PENDING: list[str] = []


def rank_layouts(loaded, mode: str, world: int, split, weights) -> list[Layout]:
    from cluster.core.handoff import group_layouts

    return group_layouts(loaded.config, mode, world, split, weights)


def cache_slots(cache: list, layout: Layout) -> dict[int, int]:
    """Each of ``layout``'s layers -> its place in the model's cache list (a pipeline stage's
    list covers every layer, its others' as SkippedCache; a family's own pipeline() keeps
    its own layers only); ValueError when a layer's cache is not a plain KVCache."""
    from mlx_lm.models.cache import KVCache

    if len(cache) == len(layout.layers):
        slots = {layer: i for i, layer in enumerate(layout.layers)}
    else:
        slots = {layer: layer for layer in layout.layers}
    for layer, i in slots.items():
        if type(cache[i]) is not KVCache:
            raise ValueError(f"layer {layer}'s cache is a {type(cache[i]).__name__}, not a plain "
                             "KV cache: its KV cannot be handed between groups")  # fmt: skip
    return slots


def open_door(loaded, spec, rank: int) -> int:
    """A decode rank's door, on its address; its port (the launcher tells prefill groups)."""
    from mlx_lm.models.cache import make_prompt_cache

    global DOOR
    layout = rank_layouts(loaded, spec.mode, spec.world_size, spec.split, spec.split_weights)[rank]
    cache_slots(make_prompt_cache(loaded.model), layout)  # a cache that can take KV, or why not
    DOOR = Door(layout, bytes.fromhex(spec.handoff.key), spec.handoff.host)
    return DOOR.port


def heard(ticket: str) -> float | None:
    """When this rank's door last had a frame of ``ticket`` (rank 0's: the decode group's
    sign that a handoff is under way)."""
    return None if DOOR is None else DOOR.heard(ticket)


def expect(tickets: list[str]) -> None:
    PENDING.extend(t for t in tickets if t not in PENDING)


def forget(tickets: list[str]) -> None:
    for t in tickets:
        if t in PENDING:
            PENDING.remove(t)
        if DOOR is not None:
            DOOR.drop(t)


def agree_handed(group, wait: float) -> list[str]:
    """Every rank at once: the pending tickets every rank holds whole (one all_sum of a flag
    per ticket); ``wait``: how long a rank with nothing to decode waits for them first."""
    from node.rank.dist import control_stream
    from node.rank.numbers import host_ints

    door = DOOR
    deadline = time.monotonic() + wait
    while True:
        flags = [door is not None and door.complete(t) for t in PENDING]
        if all(flags) or time.monotonic() >= deadline:
            break
        time.sleep(0.002)
    if group is None or group.size() == 1:
        return [t for t, done in zip(PENDING, flags, strict=True) if done]
    counts = mx.distributed.all_sum(mx.array(flags, dtype=mx.int32), group=group,
                                    stream=control_stream())  # fmt: skip
    return [t for t, n in zip(PENDING, host_ints(counts), strict=True) if n == group.size()]


def adopted_cache(ticket: str, model) -> tuple[Received, list]:
    """A ticket every rank holds whole, as (what came, a cache holding its KV)."""
    from mlx_lm.models.cache import make_prompt_cache

    if DOOR is None:
        raise RuntimeError("a handoff adopted on a rank without a door")
    got = DOOR.take(ticket)
    PENDING.remove(ticket)
    cache = make_prompt_cache(model)
    fill_cache(cache, cache_slots(cache, DOOR.layout), layer_arrays(got, DOOR.layout))
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


def prefill_and_send(
    order, loaded, spec, group, step: int, tick, cancelled: Callable[[], bool] = lambda: False
) -> tuple[int, float, str | None]:
    """A prefill group's every rank: prefill ``order.tokens`` a chunk of ``step`` at a time,
    each chunk's KV to the decode ranks as it is done; (bytes this group sent, seconds,
    the first rank's error or None), the same on every rank. After each chunk every rank
    learns whether rank 0's ``cancelled()`` (its client left): then they stop there, send no
    end frame (the decode ranks never take what came) and say CANCELLED."""
    from mlx_lm.models.cache import make_prompt_cache

    from cluster.core.protocol import CANCELLED
    from node.rank.dist import control_stream, rank0_stopped
    from node.rank.numbers import host_floats

    h = order.handoff
    began = time.perf_counter()
    mine = rank_layouts(loaded, spec.mode, spec.world_size, spec.split, spec.split_weights)
    rank = group.rank() if group is not None else 0
    error = None
    sender = None
    try:
        theirs = rank_layouts(loaded, h.mode, h.world, h.split, h.weights)
        from cluster.core.handoff import plan_pieces

        pieces = plan_pieces(mine, theirs)
        sender = Sender(rank, pieces, [(str(d[0]), int(d[1])) for d in h.doors],
                        bytes.fromhex(spec.handoff.key))  # fmt: skip
        cache = make_prompt_cache(loaded.model)
        slots = cache_slots(cache, mine[rank])
        tokens = order.tokens
        for start in range(0, len(tokens), step):
            end = min(len(tokens), start + step)
            loaded.model(mx.array(tokens[start:end])[None], cache=cache)
            mx.eval([(cache[i].keys, cache[i].values) for i in slots.values()])
            sender.chunk(h.ticket, start, end, {
                layer: (cache[i].keys[:, :, start:end], cache[i].values[:, :, start:end])
                for layer, i in slots.items()})  # fmt: skip
            tick()
            if end < len(tokens) and (
                rank0_stopped(cancelled(), group, mx.default_stream(mx.default_device()))
                if group is not None and group.size() > 1
                else cancelled()
            ):
                error = CANCELLED
                break
        else:
            sender.end(h.ticket, tokens)
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
    return int(figures[0]), time.perf_counter() - began, error
