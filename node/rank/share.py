"""share_object: rank 0 broadcasts one object to every rank with two ``all_sum`` calls.

MLX has no broadcast, so rank 0 contributes the data and every other rank contributes zeros.
Wire format: a JSON header (the object, with each ``bytes`` value replaced by a reference) followed
by the raw bytes values, never base64 and never pickle. Size 0 means "no object" (None); a
negative size means rank 0 could not send, and every rank raises the same error instead of
waiting in a collective that will never come.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any, TypeVar, cast

import mlx.core as mx
import numpy as np

from cluster.core.spec import Order, from_dict, to_dict
from node.rank.dist import control_stream
from node.rank.numbers import host_ints

T = TypeVar("T")

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
CHUNK_BYTES = 16 * 1024 * 1024
BLOB_KEY = "$blob"

ENCODE_FAILED = -1
TOO_LARGE = -2


class PeerFailed(RuntimeError):
    """Rank 0 told the others that it could not go on."""


class ShareError(RuntimeError):
    """Raised on every rank when an object could not be shared."""


def encode(obj: Any) -> bytes:
    """Header length (4 bytes, little endian), JSON header, then the bytes values back to back."""
    blobs: list[bytes] = []

    def strip(value):
        if isinstance(value, (bytes, bytearray, memoryview)):
            blobs.append(bytes(value))
            return {BLOB_KEY: [len(blobs) - 1, len(value)]}
        if isinstance(value, dict):
            return {str(k): strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value

    header = json.dumps(strip(obj), ensure_ascii=False, allow_nan=False).encode()
    return b"".join([struct.pack("<I", len(header)), header, *blobs])


def decode(data: bytes) -> Any:
    (n,) = struct.unpack_from("<I", data)
    header = json.loads(data[4 : 4 + n].decode())
    offsets = []
    pos = 4 + n

    def collect(value):
        nonlocal pos
        if isinstance(value, dict):
            if set(value) == {BLOB_KEY}:
                index, size = value[BLOB_KEY]
                offsets.append((index, pos, size))
                pos += size
                return
            for v in value.values():
                collect(v)
        elif isinstance(value, list):
            for v in value:
                collect(v)

    collect(header)
    blobs = {index: data[start : start + size] for index, start, size in offsets}

    def restore(value):
        if isinstance(value, dict):
            if set(value) == {BLOB_KEY}:
                return blobs[value[BLOB_KEY][0]]
            return {k: restore(v) for k, v in value.items()}
        if isinstance(value, list):
            return [restore(v) for v in value]
        return value

    return restore(header)


def _all_sum(x: mx.array, group: mx.distributed.Group) -> mx.array:
    y = mx.distributed.all_sum(x, group=group, stream=control_stream())
    mx.eval(y)
    return y


def share_object(
    obj: Any = None,
    group: mx.distributed.Group | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Any:
    """Rank 0's ``obj`` on every rank (other ranks' ``obj`` is ignored); None travels as size 0.

    Every rank must call this the same number of times. Raises ShareError on every rank if rank 0
    failed to encode its object or it is larger than ``max_bytes``.
    """
    group = group or mx.distributed.init()
    if group.size() == 1:
        return None if obj is None else decode(encode(obj))
    rank = group.rank()
    data = b""
    encode_error = None
    status = [0, 0]  # [size or sentinel, detail]
    if rank == 0:
        if obj is not None:
            try:
                data = encode(obj)
                status = [len(data), 0]
                if len(data) > max_bytes:
                    status = [TOO_LARGE, len(data)]
            except (TypeError, ValueError) as e:
                status = [ENCODE_FAILED, 0]
                encode_error = e
    header = _all_sum(mx.array(status if rank == 0 else [0, 0], dtype=mx.int64), group)
    size, detail = host_ints(header)
    if size == TOO_LARGE:
        raise ShareError(
            f"share_object: the object is {detail} bytes, over the limit of {max_bytes} bytes"
        )
    if size < 0:
        why = f": {encode_error}" if rank == 0 else ""
        raise ShareError(f"share_object: rank 0 could not encode the object{why}")
    if size == 0:
        return None

    out = bytearray(size if rank != 0 else 0)
    for start in range(0, size, CHUNK_BYTES):
        n = min(CHUNK_BYTES, size - start)
        if rank == 0:
            chunk = mx.array(np.frombuffer(data, np.uint8, n, start))
        else:
            chunk = mx.zeros((n,), dtype=mx.uint8)
        received = _all_sum(chunk, group)
        if rank != 0:
            out[start : start + n] = memoryview(cast(Any, received))
    return decode(data if rank == 0 else bytes(out))


def share_typed(cls: type[T], make: Callable[[], T | None] | None, group, what: str) -> T | None:
    """``share_from_rank0`` of a typed message (a cluster.core.spec dataclass: SharedRequest,
    ServeSetup): rank 0's ``make()`` reaches every rank as a ``cls`` (its bytes raw)."""
    wire = share_from_rank0(None if make is None else lambda: to_dict(make(), raw_bytes=True),
                            group, what)  # fmt: skip
    return None if wire is None else from_dict(cls, wire)


def share_order(order: Order | None, group) -> Order | None:
    """Rank 0's order of the round (None: nothing new, every rank goes on as before)."""
    wire = share_object(None if order is None else to_dict(order, raw_bytes=True), group)
    return None if wire is None else from_dict(Order, wire)


FAILED_KEY = "$rank0_failed"


def share_from_rank0(make: Callable[[], Any] | None, group, what: str) -> Any:
    """Rank 0 (``make`` given) builds an object and shares it; the others (``make`` None)
    receive it. If ``make`` raises, rank 0 still shares the error before re-raising, so the
    other ranks raise PeerFailed naming ``what`` instead of waiting in a collective forever."""
    obj = None
    if make is not None:
        try:
            obj = make()
        except Exception as e:
            share_object({FAILED_KEY: f"{type(e).__name__}: {e}"}, group)
            raise
    obj = share_object(obj, group)
    if isinstance(obj, dict) and FAILED_KEY in obj:
        raise PeerFailed(f"rank 0 failed to {what}: {obj[FAILED_KEY]}")
    return obj
