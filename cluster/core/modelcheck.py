"""Checks on a model checkpoint that need only its config.json: run before any rank starts.

Pure Python on purpose: the launcher calls it on this machine before starting ranks, and every
rank calls it again on its own host (where the model may live only there) before reading weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MODES = ("pipeline", "tensor")


class ModelError(ValueError):
    """A model that cannot be loaded or sharded as asked; the message says why."""


class SetupError(ValueError):
    """A host that cannot run the job as asked (MLX without the backend); says what to do."""


MEMORY_FRACTION = 0.85  # of a host's memory a rank lets MLX take (node.memory sets it on Macs)


def default_model_path() -> Path:
    """The tiny Llama that ships inside the package (node/default_model)."""
    return Path(__file__).resolve().parents[2] / "node" / "default_model"


def default_draft_path() -> Path:
    """The embedded default model's draft (node/default_draft): ``--draft-model default``."""
    return default_model_path().parent / "default_draft"


def model_id(ref: str) -> str:
    """The name an API serves a model under: a local folder's name, else the repo id."""
    local = Path(ref).expanduser()
    return local.name if local.exists() else ref


def looks_like_repo(name: str) -> bool:
    """``org/name`` with no local directory of that name: a Hugging Face repo id."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def read_config(model_dir: Path, require_weights: bool = True) -> dict[str, Any]:
    """config.json of a local checkpoint, with clear errors for the usual wrong paths."""
    if model_dir.is_file():
        if model_dir.suffix == ".gguf":
            raise ModelError(
                f"{model_dir}: GGUF files are not supported; convert the model with "
                "`mlx_lm.convert` or use an MLX checkpoint from mlx-community"
            )
        raise ModelError(f"{model_dir}: is a file; --model wants a checkpoint directory")
    if not model_dir.exists():
        raise ModelError(f"{model_dir}: no such model directory")
    config_path = model_dir / "config.json"
    if not config_path.exists() and (model_dir / "adapter_config.json").exists():
        raise ModelError(
            f"{model_dir}: is a LoRA adapter, not a model; the ranks load plain checkpoints "
            "only. Fuse it into its base model first: mlx_lm.fuse --model BASE "
            f"--adapter-path {model_dir} --save-path FUSED, then pass --model FUSED"
        )
    if not config_path.exists():
        raise ModelError(f"{model_dir}: not an MLX/Hugging Face checkpoint (no config.json)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{config_path}: not valid JSON: {e}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelError(f"{config_path}: has no 'model_type'; not a transformers config")
    if require_weights and not list(model_dir.glob("*.safetensors")):
        raise ModelError(
            f"{model_dir}: no .safetensors weights (an MLX checkpoint has "
            "model*.safetensors; convert PyTorch .bin checkpoints with mlx_lm.convert)"
        )
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of the config (VLM configs nest it under text_config)."""
    return {**config, **config.get("text_config", {})}


def is_vision_model(config: dict[str, Any]) -> bool:
    """A vision-language checkpoint (mlx-vlm): its config nests a vision_config."""
    return "vision_config" in config


def check_request(config: dict[str, Any], command: str, image: bool, name: str) -> None:
    """What a job asks of the model: an image needs a vision model; logits, chat and serve a
    text one. Run by the launcher when it can read the config, and by rank 0 always."""
    vision = is_vision_model(config)
    if image and not vision:
        raise ModelError(
            f"--image needs a vision-language model; {name} is text-only "
            "(its config.json has no vision_config)"
        )
    if command in TEXT_COMMANDS and vision and not text_family_known(config):
        what = "--logits" if command == "logits" else command
        raise ModelError(
            f"{what} is for text models; this is a vision-language model whose family "
            f"({config.get('model_type')!r}) mlx-lm cannot load as text"
        )


TEXT_COMMANDS = ("logits", "chat", "serve", "bench")


def text_family_known(config: dict[str, Any]) -> bool:
    """Whether mlx-lm has a text model for this checkpoint's family: a vision-language
    conversion of Qwen3.5/3.6, Gemma 4 or Kimi K2.5 (``vision_config`` kept) then loads as
    text for chat, serve and bench, its vision weights left out (mlx-lm's sanitize). Looked
    up by file, without importing mlx-lm."""
    import importlib.util

    family = config.get("model_type")
    spec = importlib.util.find_spec("mlx_lm")
    if not isinstance(family, str) or not family.isidentifier() or spec is None:
        return False
    return any((Path(p) / "models" / f"{family}.py").is_file()
               for p in spec.submodule_search_locations or ())  # fmt: skip


def check_kv_quant(config: dict[str, Any], kv_bits: int | None, group_size: int) -> None:
    """--kv-bits quantizes keys and values along the head dimension in groups: the group size
    must divide it (mlx's quantize), which the launcher checks before any rank starts."""
    if kv_bits is None:
        return
    cfg = config.get("text_config", config)
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (hidden // heads if heads and hidden else None)
    if isinstance(head_dim, int) and head_dim % group_size:
        fits = [g for g in (32, 64, 128) if head_dim % g == 0]
        hint = f"use --kv-group-size {fits[-1]}" if fits else "run without --kv-bits"
        raise ModelError(
            f"--kv-bits: --kv-group-size {group_size} does not divide the model's head "
            f"dimension {head_dim}; {hint}"
        )


def check_shardable(config: dict[str, Any], mode: str, num_ranks: int) -> None:
    """Raise ModelError when ``num_ranks`` cannot split this model in ``mode``; name the numbers.
    Tensor mode's own split is checked by cluster.core.tensorplan.check_mode."""
    if mode not in MODES:
        raise ModelError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    if num_ranks < 2:
        return
    layers = num_layers(config)
    if mode == "pipeline":
        if layers is not None and num_ranks > layers:
            raise ModelError(
                f"pipeline mode needs at least one layer per rank: the model has {layers} "
                f"layers but {num_ranks} ranks were asked for; use at most {layers} ranks"
            )
        return
    # tensor mode (a VLM's language model; its vision tower stays whole on every rank): the
    # heads and columns each rank holds, cluster.core.tensorplan.plan_tensor


def num_layers(config: dict[str, Any]) -> int | None:
    cfg = text_config(config)
    n = cfg.get("num_hidden_layers") or cfg.get("n_layers") or cfg.get("num_layers")
    return n if isinstance(n, int) else None


def check_split(split: list[int], layers: int, num_ranks: int) -> None:
    """An explicit --split: one positive layer count per rank, summing to the model's layers."""
    text = ",".join(map(str, split))
    if len(split) != num_ranks:
        raise ModelError(
            f"--split {text} has {len(split)} entries for {num_ranks} ranks; "
            "give one layer count per rank"
        )
    if any(s < 1 for s in split):
        raise ModelError(f"--split {text}: every rank needs at least one layer")
    if sum(split) != layers:
        raise ModelError(f"--split {text} sums to {sum(split)} but the model has {layers} layers")


def choose_split(
    config: dict[str, Any], num_ranks: int, split: list[int] | None, weights: list[float] | None
) -> list[int] | None:
    """The pipeline split: explicit, else weighted (by memory), else None for mlx-lm's even one."""
    layers = num_layers(config)
    if layers is None or num_ranks < 2:
        return None
    tail = kv_shared_tail(config)
    if split:
        check_split(split, layers, num_ranks)
        if tail is not None and split[0] < layers - tail:
            raise ModelError(
                f"--split {','.join(map(str, split))}: this model's last "
                f"{layers - kv_shared_layers(config)} layers reuse the keys and values of layers "
                f"from {tail} on, so the last stage (the first entry) must hold layers "
                f"{tail}-{layers - 1}: give it at least {layers - tail}, or use --mode tensor"
            )
        return list(split)
    if tail is not None:
        return tail_split(weights or [1.0] * num_ranks, layers, layers - tail)
    if weights and len(set(weights)) > 1:
        return weighted_split(weights, layers)
    return None


def kv_shared_layers(config: dict[str, Any]) -> int:
    """How many of the last layers keep no cache of their own (Gemma 4's and 3n's: they
    attend over an earlier layer's keys and values)."""
    shared = text_config(config).get("num_kv_shared_layers")
    return shared if isinstance(shared, int) and shared > 0 else 0


def kv_shared_tail(config: dict[str, Any]) -> int | None:
    """Gemma 4's (and 3n's) last ``num_kv_shared_layers`` layers attend over the keys and values
    the last earlier layer of their kind (sliding or full) made, handed on within the forward
    pass: the first layer that one pipeline stage must hold with all that follow (None: no
    sharing). Handing a stage's keys and values to the next would cost a KV cache per token."""
    shared, n = kv_shared_layers(config), num_layers(config)
    if not shared or n is None or shared >= n:
        return None
    cfg = text_config(config)
    kinds = cfg.get("layer_types")
    if not (isinstance(kinds, list) and len(kinds) == n):
        pattern = cfg.get("sliding_window_pattern") or 5
        kinds = ["sliding_attention"] * (pattern - 1) + ["full_attention"]
        kinds = (kinds * (n // len(kinds) + 1))[:n]
    first = n - shared
    sources = [
        max((i for i in range(first) if kinds[i] == k), default=first) for k in kinds[first:]
    ]
    return min(sources, default=first)


def tail_split(weights: list[float], layers: int, last: int) -> list[int]:
    """A split whose last stage (rank 0) holds at least ``last`` layers, the others in
    proportion to ``weights`` (kv_shared_tail)."""
    n = len(weights)
    if layers - last < n - 1:
        raise ModelError(
            f"this model's last {last} layers share keys and values and must stay on one "
            f"stage, which leaves {layers - last} layers for {n - 1} more ranks; "
            f"use at most {layers - last + 1} ranks, or --mode tensor"
        )
    split = weighted_split(weights, layers)
    if split[0] >= last:
        return split
    rest = weighted_split(weights[1:], layers - last) if n > 1 else []
    return [last, *rest]


def weighted_split(weights: list[float], layers: int) -> list[int]:
    """Layers per rank in proportion to ``weights`` (e.g. memory), at least one each.

    Floors first, then the left-over layers go to the largest remainders (lower rank on ties).
    """
    n = len(weights)
    if layers < n:
        raise ModelError(f"{layers} layers cannot be split over {n} ranks")
    total = sum(weights)
    exact = [w / total * (layers - n) for w in weights]  # one layer each is given up front
    split = [1 + int(e) for e in exact]
    by_remainder = sorted(range(n), key=lambda r: (-(exact[r] - int(exact[r])), r))
    for r in by_remainder[: layers - sum(split)]:
        split[r] += 1
    return split
