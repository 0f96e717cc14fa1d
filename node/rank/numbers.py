"""An array's values on the host, with the Python types they have.

mlx types ``item()`` and ``tolist()`` as any scalar (int, float or complex) or a nested list;
the ranks only ever read integer and real arrays, and these say so once, for the checker."""

from __future__ import annotations

from typing import cast

import mlx.core as mx


def host_int(a: mx.array) -> int:
    return int(cast(float, a.item()))


def host_float(a: mx.array) -> float:
    return float(cast(float, a.item()))


def host_ints(a: mx.array) -> list[int]:
    return cast(list[int], a.tolist())


def host_floats(a: mx.array) -> list[float]:
    return cast(list[float], a.tolist())


def host_rows(a: mx.array) -> list[list[int]]:
    return cast(list[list[int]], a.tolist())
