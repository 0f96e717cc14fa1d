"""Pipeline stages for model families that mlx-lm cannot pipeline itself (llama among them).

The family's own ``__call__`` keeps running unchanged over the full list of layers. Layers of
other ranks become pass-through placeholders that keep the plain attributes the family's loop
reads (``use_sliding`` and the like). The first local layer receives the hidden state from the
previous stage, the last local layer sends it on, and the model's last layer shares the final
stage's hidden state with every rank before the final norm and head, so every rank computes the
same logits and samples the same token. Ranks and layer order follow mlx-lm's ``PipelineMixin``:
rank 0 holds the last layers, rank N-1 the first.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, _BaseCache

from cluster.core.modelcheck import ModelError
from cluster.core.shards import pipeline_range

_collective_stream: list[Any] = [None]  # where the stages' collectives run (None: inline)
_call_cache: list[Any] = [None]  # the cache list of the model call under way (a send's tie)


def inner_model(model: Any) -> nn.Module | None:
    """The module that holds a language model's ``layers`` list: ``model.model``, or
    ``model.backbone`` (nemotron_h)."""
    for name in ("model", "backbone"):
        inner = getattr(model, name, None)
        if inner is not None and isinstance(getattr(inner, "layers", None), list):
            return inner
    return None


def cache_slots_of(layers: list, caches: int) -> list[int | None]:
    """Each layer's place in the family's cache list (None: it keeps no cache): one per layer,
    the first ``caches`` layers' (Gemma 4's KV-sharing tail has none), or one per block that
    mixes tokens (nemotron_h: its Mamba and attention blocks; its MLP blocks have none)."""
    if any(hasattr(layer, "block_type") for layer in layers):
        slots: list[int | None] = []
        for layer in layers:
            keeps = getattr(layer, "block_type", None) in ("M", "*")
            slots.append(sum(s is not None for s in slots) if keeps else None)
        return slots
    return [i if i < caches else None for i in range(len(layers))]


@contextmanager
def collectives_on(stream) -> Iterator[None]:
    """Every stage's send, receive and share while the block runs goes on ``stream`` (None:
    the stream of the work around it). Micro-batches decoded on streams of their own
    (node.jobs.batch) put their collectives on one stream, so that each rank makes them in
    the order its Python built them, which is the same on every rank: two collectives at once
    over the same sockets would interleave their bytes."""
    _collective_stream[0] = stream
    try:
        yield
    finally:
        _collective_stream[0] = None


def staged(model: nn.Module) -> bool:
    """Whether this model's pipeline runs through StageLayer (whose collectives
    ``collectives_on`` can move), rather than a family's own ``pipeline()``."""
    inner = inner_model(getattr(model, "language_model", model))
    return any(isinstance(layer, StageLayer) for layer in getattr(inner, "layers", None) or ())


class PassThrough(nn.Module):
    """A layer that another rank runs: hands the hidden state on unchanged, holds no weights.

    A layer that hands its keys and values on to later layers (gemma4's KV sharing: it returns
    ``(h, shared_kv, offset)``) hands on what it was given; the split keeps the layers that
    read them on the stage that makes them (cluster.core.modelcheck.kv_shared_tail)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name, value in vars(layer).items():
            if not name.startswith("_"):
                object.__setattr__(self, name, value)
        object.__setattr__(self, "hands_kv", _hands_kv(layer))

    def __call__(self, x, *args, **kwargs):
        if self.hands_kv:
            return x, kwargs.get("shared_kv"), kwargs.get("offset")
        return x


def _hands_kv(layer: nn.Module) -> bool:
    params = inspect.signature(type(layer).__call__).parameters
    return "shared_kv" in params and "offset" in params


class StageLayer(nn.Module):
    """A layer at a stage boundary: receive before it, send and/or share after it."""

    def __init__(self, layer: nn.Module, group, recv_from=None, send_to=None, share=False):
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "recv_from", recv_from)
        object.__setattr__(self, "send_to", send_to)
        object.__setattr__(self, "share", share)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            layer = dict.get(self, "layer")  # not self.layer: that would recurse
            if layer is None:
                raise
            return getattr(layer, name)

    def __call__(self, x, *args, **kwargs):
        on = {"stream": _collective_stream[0]} if _collective_stream[0] is not None else {}
        if self.recv_from is not None:
            x = mx.distributed.recv_like(x, self.recv_from, group=self.group, **on)
        out = self.layer(x, *args, **kwargs)
        h, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        if self.send_to is not None:
            h = mx.distributed.send(h, self.send_to, group=self.group, **on)
            cache = _find_cache(args, kwargs) or _held_cache(_call_cache[0])
            if cache is not None:
                _depend(cache, h)
        if self.share:
            h = mx.distributed.all_gather(h, group=self.group, **on)[: h.shape[0]]
        return h if rest is None else (h, *rest)


def _find_cache(args, kwargs):
    cache = kwargs.get("cache")
    if cache is None:
        # duck-typed: mlx-vlm's caches are not mlx-lm's classes
        cache = next((a for a in args if hasattr(a, "update_and_fetch")), None)
    return cache


def _held_cache(cache: list | None):
    """The last cache of the call's list that this stage keeps: the send's tie when the
    stage's last layer keeps none (nemotron_h's MLP blocks)."""
    held = [c for c in cache or () if not isinstance(c, SkippedCache)]
    return held[-1] if held else None


def _depend(cache, h: mx.array) -> None:
    """Make the cache depend on the send: mlx-lm's prefill evaluates only the cache state, and
    a send nobody evaluates never runs, leaving the next stage waiting forever."""
    if isinstance(cache, CacheList):  # longcat's pair of attentions per layer
        _depend(cache.caches[0], h)
        return
    keys = getattr(cache, "keys", None)
    if isinstance(keys, tuple):  # a QuantizedKVCache: (packed, scales, biases)
        cache.keys = tuple(mx.depends(list(keys), h))
    elif keys is not None:
        cache.keys = mx.depends(keys, h)
    elif hasattr(cache, "cache") and cache.cache and cache.cache[-1] is not None:
        cache.cache[-1] = mx.depends(cache.cache[-1], h)
    else:
        raise NotImplementedError(
            f"cannot tie a pipeline send to a {type(cache).__name__}; this family needs tensor mode"
        )


class SkippedCache(_BaseCache):
    """Cache slot of a layer another rank runs: stores nothing, reports the offset and mask of
    a local layer's cache (its twin) so masks built from it (the family reads e.g.
    ``cache[fa_idx]``) stay right.

    mlx-lm's BatchGenerator merges, filters and extends caches slot by slot, making new cache
    objects; so a skipped slot names its twin by layer index and ``resolve_twins`` points it at
    the twin in the list the model is called with."""

    def __init__(self, twin: Any, twin_index: int, stands_for: bool | None = None,
                 kind: str = "", alike: bool = True):  # fmt: skip
        self.twin = twin
        self.twin_index = twin_index
        # whether the twin is of the slot's own kind: a stage that keeps none of that kind
        # (nemotron_h's Mamba blocks only) runs no layer that reads the slot's mask
        self.alike = alike
        # whether the slot's own cache could always be cut back (node.cache.snapshots asks
        # every rank alike, whichever layers it holds), and its class's name (a handoff's
        # plan: node.cache.handoff.cache_kinds)
        self.stands_for = stands_for
        self.kind = kind

    @property
    def offset(self):
        return self.twin.offset

    def make_mask(self, *args, **kwargs):
        return self.twin.make_mask(*args, **kwargs) if self.alike else None

    def __getitem__(self, idx):  # a CacheList's part (longcat reads ``cache[0][0]``)
        return SkippedCache(self.twin[idx], -1)

    @property
    def state(self):
        return []

    @state.setter
    def state(self, value):
        pass

    def is_trimmable(self):
        return True

    def trim(self, n):
        return n

    def size(self):
        return self.twin.size()

    def empty(self):
        return self.twin.empty()

    @property
    def nbytes(self):
        return 0

    # what BatchGenerator does to each slot: a skipped slot has nothing to merge or cut
    @classmethod
    def merge(cls, caches):
        c = caches[0]
        return cls(None, c.twin_index, c.stands_for, c.kind, c.alike)

    def extract(self, idx):
        return SkippedCache(None, self.twin_index, self.stands_for, self.kind, self.alike)

    def prepare(self, **kwargs):
        pass

    def finalize(self):
        pass

    def filter(self, batch_indices):
        pass

    def extend(self, other):
        pass


def always_trimmable(cache: Any) -> bool:
    """Whether a cache slot can be cut back to any prefix whatever it holds (a sliding window
    cannot once it has filled; node.cache.snapshots)."""
    if isinstance(cache, RotatingKVCache):
        return False
    parts = getattr(cache, "caches", None)  # a CacheList
    if parts is not None:
        return all(always_trimmable(c) for c in parts)
    if isinstance(cache, SkippedCache) and cache.stands_for is not None:
        return cache.stands_for
    is_trimmable = getattr(cache, "is_trimmable", None)
    return bool(is_trimmable()) if callable(is_trimmable) else False


def resolve_twins(cache) -> None:
    for c in cache or ():
        if isinstance(c, SkippedCache):
            c.twin = cache[c.twin_index]


def _resolving_call(model: nn.Module) -> None:
    """Give ``model`` a ``__call__`` that resolves skipped cache slots first (``__call__`` is
    looked up on the type, so the instance gets a subclass of its own)."""
    family = type(model)

    def __call__(self, *args, **kwargs):
        cache = kwargs["cache"] if "cache" in kwargs else (args[1:2] or [None])[0]
        resolve_twins(cache)
        _call_cache[0] = cache
        try:
            return family.__call__(self, *args, **kwargs)
        finally:
            _call_cache[0] = None

    model.__class__ = type(family.__name__, (family,), {"__call__": __call__})


def apply_stages(
    model: nn.Module, group, split: list[int] | None = None, vlm_cache: bool = False
) -> tuple[int, int]:
    """Turn a loaded (lazy) model into this rank's pipeline stage in place; returns (start, end).

    ``model`` is a language model with ``model.layers`` (for a VLM, its ``language_model``;
    ``vlm_cache`` then makes the default caches mlx-vlm's, as its generation loop expects).
    Call after the weights are loaded: the wrappers change parameter paths.
    """
    inner = inner_model(model)
    assert inner is not None  # node.model.load asks first
    layers = inner.layers
    n, rank, size = len(layers), group.rank(), group.size()
    start, end = pipeline_range(n, size, rank, split)
    for i in range(n):
        layer = layers[i] if start <= i < end else PassThrough(layers[i])
        recv_from = rank + 1 if i == start and rank < size - 1 else None
        send_to = rank - 1 if i == end - 1 and rank > 0 else None
        share = i == n - 1
        if recv_from is not None or send_to is not None or share:
            layer = StageLayer(layer, group, recv_from, send_to, share)
        layers[i] = layer

    family_cache = getattr(model, "make_cache", None)
    default_cache: Any = KVCache
    if vlm_cache:
        from mlx_vlm.models.cache import KVCache as VisionKVCache

        default_cache = VisionKVCache

    def make_cache():
        caches = family_cache() if family_cache else [default_cache() for _ in layers]
        slots = cache_slots_of(layers, len(caches))
        held = [s for s in slots[start:end] if s is not None]
        if not held:
            raise ModelError(f"layers {start}-{end - 1} of this stage keep no cache: "
                                      "split the layers otherwise (--split)")  # fmt: skip
        for i in [i for i in range(len(caches)) if i not in held]:
            twin = next((j for j in held if type(caches[j]) is type(caches[i])), held[0])
            caches[i] = SkippedCache(caches[twin], twin, always_trimmable(caches[i]),
                                     type(caches[i]).__name__,
                                     type(caches[twin]) is type(caches[i]))  # fmt: skip
        return caches

    object.__setattr__(model, "make_cache", make_cache)
    _resolving_call(model)
    return start, end
