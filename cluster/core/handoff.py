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
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

from cluster.core.modelcheck import choose_split, num_layers, text_config
from cluster.core.shards import pipeline_range
from cluster.core.tensorplan import plan_tensor


@dataclass(frozen=True)
class Layout:
    """What one rank's KV cache holds: the model's layers (global indices, in the order of
    its cache) and, of each, the KV heads (global indices, in the order of its cache's head
    axis)."""

    layers: tuple[int, ...]
    heads: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """One layer's heads that one prefill rank sends one decode rank: ``send`` the heads'
    places on the sender's head axis, ``place`` where they go on the receiver's."""

    sender: int
    receiver: int
    layer: int
    send: tuple[int, ...]
    place: tuple[int, ...]


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
    every_layer, every_head = tuple(range(n)), tuple(range(n_kv))
    if world == 1:
        return [Layout(every_layer, every_head)]
    if mode == "tensor":
        plan = plan_tensor(config, world, split or weights)
        return [Layout(every_layer, tuple(kv)) for kv in plan.kv]
    chosen = choose_split(config, world, split, weights)
    return [Layout(tuple(range(*pipeline_range(n, world, r, chosen))), every_head)
            for r in range(world)]  # fmt: skip


def plan_pieces(senders: list[Layout], receivers: list[Layout]) -> list[Piece]:
    """The pieces of a handoff from a group laid out as ``senders`` to one laid out as
    ``receivers``: every (layer, head) each receiver holds, from the lowest sender that
    holds it; ValueError naming one that no sender holds (the groups serve different
    models)."""
    pieces = []
    for r, need in enumerate(receivers):
        for layer in need.layers:
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
