"""Bytes each rank holds, and whether a hostfile's hosts can hold them: the weights of each
rank's share (doctor shows them; serve checks a restart without a lost host against them) and
the KV cache serve needs."""

from __future__ import annotations

from pathlib import Path

from cluster.core.hostfile import Hostfile, split_weights
from cluster.core.modelcheck import (
    MEMORY_FRACTION,
    ModelError,
    choose_split,
    read_config,
    text_config,
)
from cluster.core.shards import pipeline_split
from cluster.core.spec import JobSpec
from cluster.core.tensorplan import check_mode


def model_shares(
    model: str, mode: str, hostfile: Hostfile, split: list[int] | None = None
) -> dict[int, int]:
    """Bytes of weights each rank holds (pipeline: its layers' share, plus embeddings/head),
    with the split launch would use (``split``, else by memory_gb, else even)."""
    path = Path(model).expanduser()
    config = read_config(path)
    n = hostfile.world_size
    weights = split or split_weights(hostfile)
    plan = check_mode(config, mode, n, weights)
    total = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    if n == 1:
        return {0: total}
    layers = text_config(config).get("num_hidden_layers") or n
    per_layer = total / (layers + 2)  # embeddings and head counted as about two layers each
    if plan is not None:  # every rank holds the embeddings and head, and its span of each layer
        cols = plan.mlp or plan.moe or plan.heads
        width = cols[-1][1]
        return {r: int(per_layer * (2 + layers * (b - a) / width)) for r, (a, b) in enumerate(cols)}
    split = pipeline_split(layers, n, choose_split(config, n, split, split_weights(hostfile)))
    return {r: int(per_layer * (split[r] + 2)) for r in range(n)}


def fits(hostfile: Hostfile, spec: JobSpec) -> str | None:
    """None when each rank's weights and the KV cache serve needs fit under the cap a rank
    sets itself (MEMORY_FRACTION of its share of memory_gb), else why not (or why that cannot
    be known here). The KV counted: one request at the longest prompt serve takes, plus the
    kept answers' caches when --prompt-cache-gb is given."""
    if not hostfile.hosts:
        return "no host is left"
    unknown = [h.label for h in hostfile.hosts if not h.memory_gb]
    if unknown:
        return f"the hostfile gives no memory_gb for {', '.join(unknown)}"
    if not Path(spec.model).expanduser().exists():
        return f"the model {spec.model} is not on this machine to measure"
    try:
        shares = model_shares(spec.model, spec.mode, hostfile, spec.split)
        kv = kv_bytes(read_config(Path(spec.model).expanduser()), spec)
    except (ModelError, ValueError) as e:
        return str(e)
    hosts = hostfile.rank_hosts()
    total = sum(shares.values()) or 1
    for rank, share in shares.items():
        budget = (hosts[rank].memory_gb or 0) / hosts[rank].slots * 1e9 * MEMORY_FRACTION
        need = share + kv * share / total  # a rank's KV follows its share of the layers/heads
        if need > budget:
            return (
                f"rank {rank} on {hosts[rank].label} would hold {share / 1e9:.1f} GB of "
                f"weights and {(need - share) / 1e9:.1f} GB of KV cache, over its "
                f"{budget / 1e9:.1f} GB ({MEMORY_FRACTION:.0%} of its memory_gb)"
            )
    return None


def kv_bytes(config: dict, spec: JobSpec) -> float:
    """The KV cache serve needs across all ranks, from the model's config: one request at
    the longest prompt it takes (fp16 keys and values of every layer), plus the kept
    answers' caches when their size is given."""
    text = text_config(config)
    layers = text.get("num_hidden_layers") or 0
    heads = text.get("num_key_value_heads") or text.get("num_attention_heads") or 0
    dim = text.get("head_dim") or (
        text.get("hidden_size", 0) // (text.get("num_attention_heads") or 1)
    )
    tokens = spec.serve.max_prompt_tokens or text.get("max_position_embeddings") or 0
    kept = (spec.prompt_cache_gb or 0) * 1e9
    return 2 * layers * heads * dim * 2 * tokens + kept
