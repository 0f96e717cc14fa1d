"""Which rank of a prefill group sends which part of a prompt's KV cache to which rank of a
decode group (issue 53): the plan of a handoff, shared by the launcher and the ranks, free of
MLX.

Every rank holds the KV of some layers (pipeline: its range; tensor and one rank: all) and,
of each, some KV heads in an order of its own (tensor: ``TensorPlan.kv``, a head on several
ranks when ranks outnumber them; otherwise every head in order). A ``Layout`` says that much
for one rank. The handoff is re-cut to the decode group's plan: for each layer and head a
decode rank needs, the lowest prefill rank that holds it sends it, so every sharding pair
works (one rank to pipeline or tensor 2, pipeline 2 to one rank, tensor to pipeline, ...)
and each byte crosses a link once per rank that needs it.

This year's models keep more than KV in some layers (issue 63): a sliding window
(``RotatingKVCache``: gpt-oss, Gemma, Step-3.5) still has a KV head axis, so it is re-cut by
heads like KV, sent whole at the prompt's end (its buffer is not laid out by token); any other
state (a linear attention's ``ArraysCache``: Qwen3.5/3.6, Qwen3-Next; a ``CacheList``) is not
split by KV heads, so it goes whole, and only between ranks that hold it alike (``Layout.part``:
both hold their layers whole, or the same rank of tensor groups of one plan).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

from cluster.core.modelcheck import choose_split, kv_shared_layers, num_layers, text_config
from cluster.core.shards import pipeline_range
from cluster.core.tensorplan import plan_tensor


@dataclass(frozen=True)
class Layout:
    """What one rank's KV cache holds: the model's layers (global indices, in the order of
    its cache) and, of each, the KV heads (global indices, in the order of its cache's head
    axis)."""

    layers: tuple[int, ...]  # places in the model's cache list (a layer's index where each has one)
    heads: tuple[int, ...]
    # how this rank holds each of its layers: () whole (pipeline, one rank); a tensor rank's
    # (rank, ranks, weights...): ranks with the same part hold a layer's state alike
    part: tuple = ()


@dataclass(frozen=True)
class Piece:
    """One layer's heads that one prefill rank sends one decode rank: ``send`` the heads'
    places on the sender's head axis, ``place`` where they go on the receiver's."""

    sender: int
    receiver: int
    layer: int
    send: tuple[int, ...]
    place: tuple[int, ...]
    whole: bool = False  # the layer's whole state, as the sender holds it (send/place empty)


KV, WINDOW, STATE = "kv", "window", "state"  # how a layer's cache travels (``plan_pieces``)


def travels_as(kind: str) -> str:
    """How a cache class (its name) travels: KV by tokens and heads, a sliding window by
    heads, anything else as a whole state."""
    if kind == "KVCache":
        return KV
    return WINDOW if kind == "RotatingKVCache" else STATE


def group_layouts(config: dict[str, Any], mode: str, world: int,
                  split: list[int] | None = None,
                  weights: list[float] | None = None) -> list[Layout]:  # fmt: skip
    """Each rank's Layout in a group of ``world`` ranks in ``mode``, as the ranks load the
    model (node.model.load: the same split, the same tensor plan)."""
    cfg = text_config(config)
    n = num_layers(config)
    if n is None:
        raise ValueError(f"config of {config.get('model_type')!r} gives no num_hidden_layers")
    n_kv = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if not isinstance(n_kv, int):
        raise ValueError("config.json gives no num_attention_heads")
    latent = isinstance(cfg.get("kv_lora_rank"), int)  # MLA: one latent "head", on every rank
    if latent:
        n_kv = 1
    cached = n - kv_shared_layers(config)  # Gemma 4's last layers reuse earlier ones' KV
    slots = cache_places(config, n)
    every_layer, every_head = tuple(s for s in slots[:cached] if s is not None), tuple(range(n_kv))
    if world == 1:
        return [Layout(every_layer, every_head)]
    if mode == "tensor":
        plan = plan_tensor(config, world, split or weights)
        shares = tuple(split or weights or ())
        kvs = [every_head] * world if latent else [tuple(kv) for kv in plan.kv]
        return [Layout(every_layer, kv, (r, world, *shares)) for r, kv in enumerate(kvs)]
    chosen = choose_split(config, world, split, weights)
    return [Layout(tuple(s for s in slots[min(cached, a) : min(cached, b)] if s is not None),
                   every_head)
            for a, b in (pipeline_range(n, world, r, chosen) for r in range(world))]  # fmt: skip


def cache_places(config: dict[str, Any], n: int) -> list[int | None]:
    """Each layer's place in the model's cache list: its own index, or (nemotron_h, whose
    MLP and MoE blocks keep none) the count of Mamba and attention blocks before it, None
    for a block without a cache (node.model.stage.cache_slots_of, as the ranks see it)."""
    pattern = text_config(config).get("hybrid_override_pattern")
    if not isinstance(pattern, (list, str)) or len(pattern) != n:
        return list(range(n))
    places: list[int | None] = []
    for block in pattern:
        places.append(sum(p is not None for p in places) if block in ("M", "*") else None)
    return places


def plan_pieces(senders: list[Layout], receivers: list[Layout],
                kinds: dict[int, str] | None = None) -> list[Piece]:  # fmt: skip
    """The pieces of a handoff from a group laid out as ``senders`` to one laid out as
    ``receivers``: every (layer, head) each receiver holds, from the lowest sender that
    holds it; ValueError naming one that no sender holds (the groups serve different
    models). ``kinds``: each layer's cache class (``travels_as``; KV where absent): a state
    comes whole from the lowest sender that holds it alike (a window too, else by heads),
    ValueError saying which groups can hand it where none does."""
    pieces = []
    for r, need in enumerate(receivers):
        for layer in need.layers:
            travel = travels_as((kinds or {}).get(layer, "KVCache"))
            if travel != KV:
                alike = next((s for s, have in enumerate(senders)
                              if layer in have.layers and have.part == need.part
                              and have.heads == need.heads), None)  # fmt: skip
                if alike is not None:
                    pieces.append(Piece(alike, r, layer, (), (), whole=True))
                    continue
                if travel == STATE:
                    raise ValueError(
                        f"layer {layer} keeps a state that is not split by KV heads (a "
                        f"{(kinds or {}).get(layer)}: a linear attention's, or several caches): "
                        "it can be handed only between ranks that hold it alike (both groups "
                        "pipeline or one rank, or tensor groups of the same size)"
                    )
            by_sender: dict[int, tuple[list[int], list[int]]] = {}
            for place, head in enumerate(need.heads):
                s = next((s for s, have in enumerate(senders)
                          if layer in have.layers and head in have.heads), None)  # fmt: skip
                if s is None:
                    raise ValueError(f"no prefill rank holds layer {layer}, KV head {head}")
                send, where = by_sender.setdefault(s, ([], []))
                send.append(senders[s].heads.index(head))
                where.append(place)
            for s, (send, where) in sorted(by_sender.items()):
                pieces.append(Piece(s, r, layer, tuple(send), tuple(where)))
    return pieces


def tokens_digest(tokens: list[int]) -> str:
    """A prompt's tokens as a decode group's rank 0 tells every rank the handed-off KV must
    stand for (the end frames' tokens, ``Expect.tokens``)."""
    data = struct.pack(f"<{len(tokens)}i", *tokens)
    return hashlib.blake2b(data, digest_size=16).hexdigest()
