"""Which heads and which MLP columns each rank holds in tensor mode: the plan the ranks apply
(node/model/tensor.py) and the preflight checks and reports before any rank starts.

Query heads and MLP columns are split in proportion to each rank's weight (equal by default;
``memory_gb`` or ``--split`` otherwise), as contiguous spans: 6 heads over 4 ranks is 2/2/1/1.
A rank holds the KV heads its query heads use, so KV heads are replicated when ranks outnumber
them (as vLLM does). Where an even split of the query heads would cut a KV head's group (9
heads and 3 KV heads over 2 ranks: 5/4, each rank then holding one KV head per query head),
the heads are split on the groups instead (6/3, KV heads 2/1) whenever that gives the busiest
rank less attention work (``attention_load``); the MLP's columns then even out each rank's
work (``mlp_shares``: the rank with more heads gets fewer columns). On a quantized model
every span boundary that cuts the input of a row-parallel layer (o_proj, down_proj) falls on a
quantization-group boundary.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster.core.modelcheck import ModelError, check_shardable, text_config


def spans(total: int, weights: Sequence[float], unit: int = 1) -> list[tuple[int, int]]:
    """``total`` split into contiguous [start, end) spans in proportion to ``weights``, every
    boundary a multiple of ``unit``, none empty (largest remainder; ties to the low ranks)."""
    n = len(weights)
    if total % unit or total // unit < n:
        raise ValueError(f"{total} cannot be split into {n} non-empty parts of {unit}")
    units = total // unit
    whole = sum(weights)
    exact = [units * w / whole for w in weights]
    counts = [max(1, math.floor(x)) for x in exact]
    while sum(counts) > units:  # the max(1, ...) floors took too many
        i = max((i for i in range(n) if counts[i] > 1), key=lambda i: (counts[i] - exact[i], i))
        counts[i] -= 1
    order = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: units - sum(counts)]:
        counts[i] += 1
    out, start = [], 0
    for c in counts:
        out.append((start * unit, (start + c) * unit))
        start += c
    return out


def kv_heads_for(q_span: tuple[int, int], n_heads: int, n_kv: int) -> list[int]:
    """The KV heads a rank with query heads ``q_span`` holds, in the order its query heads use
    them (attention maps local query head j to local KV head j // (local q / local kv)): each
    needed KV head once when they serve equal runs of its query heads, else one per query
    head."""
    group = n_heads // n_kv
    needed = [h // group for h in range(*q_span)]
    unique = sorted(set(needed))
    run = len(needed) // len(unique)
    if len(needed) % len(unique) == 0 and needed == [k for k in unique for _ in range(run)]:
        return unique
    return needed


def by_kv_groups(
    n_heads: int, n_kv: int, weights: Sequence[float], heads_unit: int
) -> list[tuple[tuple[int, int], list[int]]] | None:
    """Query heads split on KV-group boundaries (each rank a span of whole KV heads with all
    their query heads): (query span, KV heads) per rank, or None when the ranks outnumber the
    KV heads or a boundary would cut a quantization group."""
    group = n_heads // n_kv
    if n_kv < len(weights) or math.lcm(group, heads_unit) != group:
        return None
    return [((a * group, b * group), list(range(a, b))) for a, b in spans(n_kv, weights)]


def attention_load(plan: list[tuple[tuple[int, int], list[int]]], weights: Sequence[float]
                   ) -> float:  # fmt: skip
    """The busiest rank's attention work for its share: a query head (its q and o
    projections, its scores) and a KV head held (its k and v projections, its cache read
    every step) count one each."""
    return max((b - a + len(kv)) / w for ((a, b), kv), w in zip(plan, weights, strict=True))


def mlp_shares(heads: list[tuple[int, int]], kv: list[list[int]], inter: Any, hidden: Any,
               head_dim: Any, weights: Sequence[float], experts: bool = False
               ) -> list[float] | None:  # fmt: skip
    """Each rank's share of a dense MLP's columns that evens out every rank's work for its
    weight, when the attention split is uneven (6/3 heads on KV groups): a rank with more
    heads gets fewer columns. Work counts multiply-adds per token: a query head's q and o
    projections and a KV head's k and v are 2 * hidden * head_dim each, an MLP column's gate,
    up and down 3 * hidden. None when the attention is even, the sizes are not known, or the
    model has experts (whose columns follow intermediate_size in some families, and whose work
    per token depends on how many are chosen)."""
    if not all(isinstance(x, int) and x > 0 for x in (inter, hidden, head_dim)) or experts:
        return None
    held = [b - a + len(k) for (a, b), k in zip(heads, kv, strict=True)]
    attention = [2 * hidden * head_dim * n for n in held]
    if len({a / w for a, w in zip(attention, weights, strict=True)}) == 1:
        return None
    total = sum(attention) + 3 * hidden * inter
    targets = [total * w / sum(weights) for w in weights]
    shares = [t - a for t, a in zip(targets, attention, strict=True)]
    return shares if min(shares) > 0 else None


def head_split(
    n_heads: int, n_kv: int, weights: Sequence[float], heads_unit: int = 1
) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Query heads and the KV heads they use, per rank: contiguous spans in proportion to
    ``weights``, or on whole KV groups when that loads the busiest rank less."""
    heads = spans(n_heads, weights, heads_unit)
    kv = [kv_heads_for(s, n_heads, n_kv) for s in heads]
    whole = by_kv_groups(n_heads, n_kv, weights, heads_unit)
    if whole is not None and attention_load(whole, weights) < attention_load(
        list(zip(heads, kv, strict=True)), weights
    ):
        heads, kv = [h for h, _ in whole], [k for _, k in whole]
    return heads, kv


@dataclass
class TensorPlan:
    heads: list[tuple[int, int]]  # query heads per rank
    kv: list[list[int]]  # KV heads per rank (global indices, a head may be on several ranks)
    n_kv: int
    mlp: list[tuple[int, int]] | None  # intermediate columns per rank (dense MLP)
    moe: list[tuple[int, int]] | None  # per-expert intermediate columns per rank
    shared: list[tuple[int, int]] | None  # shared experts' intermediate columns per rank
    weights: list[float] | None = None  # each rank's share (None: equal)
    heads_unit: int = 1  # query heads per span step (quantization groups)
    group: int = 0  # quantization group size (0: not quantized)

    def attention(self, n_heads: int, n_kv: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
        """The split of an attention whose head counts differ from the config's (mimo's
        sliding layers have their own), by the same rule; the plan's own for the config's."""
        if n_kv == self.n_kv and self.heads[-1][1] == n_heads:
            return self.heads, self.kv
        return head_split(n_heads, n_kv, self.weights or [1.0] * len(self.heads), self.heads_unit)

    def columns(self, width: int) -> list[tuple[int, int]]:
        """A span of ``width`` columns per rank, by the same shares (and quantization groups)."""
        return spans(width, self.weights or [1.0] * len(self.heads), self.group or 1)

    def even(self) -> bool:
        """Every rank the same share and no KV head replicated (what mlx-lm's shard() does)."""

        def same(spans: list[tuple[int, int]] | None) -> bool:
            return spans is None or len({b - a for a, b in spans}) == 1

        held = sum(len(k) for k in self.kv)
        return all(map(same, (self.heads, self.mlp, self.moe, self.shared))) and held == self.n_kv

    def kv_note(self) -> str | None:
        """The memory cost of replicated KV heads, when there is one."""
        held = sum(len(k) for k in self.kv)
        if held == self.n_kv:
            return None
        per_rank = ", ".join(str(len(k)) for k in self.kv)
        return (
            f"KV heads replicated: the ranks hold {per_rank} of the model's {self.n_kv} KV heads "
            f"({held / self.n_kv:.2f}x the KV cache and k/v projections of an even split)"
        )


def quant_group(config: dict[str, Any]) -> int:
    q = config.get("quantization") or config.get("quantization_config") or {}
    return int(q.get("group_size") or 0) if isinstance(q, dict) else 0


def plan_tensor(
    config: dict[str, Any], size: int, weights: Sequence[float] | None = None
) -> TensorPlan:
    """Each rank's heads, KV heads and MLP columns; ModelError (naming the numbers) when a
    model cannot be split over ``size`` ranks this way."""
    cfg = text_config(config)
    weights = weights or [1.0] * size
    if len(weights) != size or any(w <= 0 for w in weights):
        raise ModelError(
            f"the tensor split {list(weights)} needs one positive share per rank ({size} ranks)"
        )
    n_heads = cfg.get("num_attention_heads")
    if not isinstance(n_heads, int):
        raise ModelError("tensor mode needs num_attention_heads in config.json")
    n_kv = cfg.get("num_key_value_heads") or n_heads
    if n_heads % n_kv:
        raise ModelError(
            f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}"
        )
    hidden = cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (hidden // n_heads if hidden else None)
    group = quant_group(config)
    why = "tensor mode gives each rank a span of the query heads and of the MLP columns"
    heads_unit = math.lcm(head_dim, group) // head_dim if group and head_dim else 1

    def split(name: str, total: Any, unit: int) -> list[tuple[int, int]] | None:
        if not isinstance(total, int):
            return None
        try:
            return spans(total, weights, unit)
        except ValueError:
            if unit > 1:
                raise ModelError(
                    f"{why}, cut on quantization groups of {group}: {name}={total} cannot give "
                    f"{size} ranks a non-empty span of whole groups ({unit} at a time); "
                    "use fewer ranks or --mode pipeline"
                ) from None
            raise ModelError(
                f"{why}: {name}={total} is fewer than {size} ranks; use at most {total} ranks "
                "or --mode pipeline"
            ) from None

    split("num_attention_heads", n_heads, heads_unit)  # names the numbers when it cannot
    heads, kv = head_split(n_heads, n_kv, weights, heads_unit)
    inter = cfg.get("intermediate_size")
    experts = any(k in cfg for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    even_out = mlp_shares(heads, kv, inter, hidden, head_dim, weights, experts)
    mlp = split("intermediate_size", inter, group or 1)
    if even_out is not None and isinstance(inter, int):
        with contextlib.suppress(ValueError):  # too few columns to even out: as the weights say
            mlp = spans(inter, even_out, group or 1)
    moe = split("moe_intermediate_size", cfg.get("moe_intermediate_size"), group or 1)
    shared_width = cfg.get("shared_expert_intermediate_size")
    n_shared = cfg.get("n_shared_experts")
    moe_width = cfg.get("moe_intermediate_size")
    if shared_width is None and isinstance(n_shared, int) and isinstance(moe_width, int):
        shared_width = n_shared * moe_width  # GLM's and DeepSeek's shared experts
    shared = split("the shared experts' width", shared_width, group or 1)
    return TensorPlan(heads, kv, n_kv, mlp, moe, shared, list(weights), heads_unit, group)


def check_mode(
    config: dict[str, Any], mode: str, size: int, weights: Sequence[float] | None = None
) -> TensorPlan | None:
    """check_shardable, and in tensor mode the plan (None otherwise); ModelError names why a
    model cannot be split as asked."""
    check_shardable(config, mode, size)
    if mode != "tensor" or size < 2 or not config:
        return None
    return plan_tensor(config, size, weights)
