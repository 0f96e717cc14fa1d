"""Which layers and which files each rank of a pipeline needs: shared by the ranks (to load
only their files) and by `mlx-cluster sync` (to copy only those files to each host)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from cluster.core.modelcheck import ModelError, choose_split, is_vision_model, num_layers

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# A VLM's language-model layers; the vision tower has "layers" of its own that are not ours.
VLM_LAYER_RE = re.compile(r"^language_model\.(?:model\.)?layers\.(\d+)\.")


def bad_file_name(name: object) -> str | None:
    """Why a weight file's name from an index may not be read or written (None: it may): a
    plain relative name inside the model folder (cluster.rig.transfer.inside checks the same on
    each host, with links resolved)."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        return f"is not a file name ({name!r})"
    if name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
        return f"leaves the model folder ({name!r}: absolute, or with . or ..)"
    return None


def pipeline_split(num_layers: int, size: int, split: list[int] | None = None) -> list[int]:
    """Layers per rank; the even split gives the extra layers to the low ranks (as mlx-lm)."""
    if split is None:
        base, extra = divmod(num_layers, size)
        split = [base + (1 if r < extra else 0) for r in range(size)]
    if len(split) != size or any(s <= 0 for s in split) or sum(split) != num_layers:
        raise ValueError(
            f"split {split} must have {size} positive entries summing to {num_layers} layers"
        )
    return split


def pipeline_range(
    num_layers: int, size: int, rank: int, split: list[int] | None = None
) -> tuple[int, int]:
    """(start, end) of the layers this rank holds: rank r follows ranks r+1 ... size-1."""
    split = pipeline_split(num_layers, size, split)
    start = sum(split[rank + 1 :])
    return start, start + split[rank]


def weight_files_for_layers(
    model_dir: Path, start: int, end: int, layer_re: re.Pattern = LAYER_RE
) -> list[str]:
    """Safetensors files holding layers [start, end) or weights outside the layers."""
    index_path = model_dir / "model.safetensors.index.json"
    if not index_path.exists():
        return sorted(p.name for p in model_dir.glob("model*.safetensors"))
    weight_map = json.loads(index_path.read_text())["weight_map"]
    for file in set(weight_map.values()):
        if why := bad_file_name(file):
            raise ModelError(f"{index_path}: the weight_map names a file that {why}; "
                             "this checkpoint cannot be used as it is")  # fmt: skip
    files = set()
    for name, file in weight_map.items():
        m = layer_re.search(name)
        if m is None or start <= int(m.group(1)) < end:
            files.add(file)
    return sorted(files)


def all_weight_files(model_dir: Path) -> list[str]:
    """Every weight file of a checkpoint: the model*.safetensors mlx-lm reads, and the ones its
    index names (which a partial copy may lack)."""
    present = {p.name for p in model_dir.glob("model*.safetensors")}
    return sorted(present | set(weight_files_for_layers(model_dir, 0, 2**31)))


def rank_weight_files(
    model_dir: Path,
    config: dict[str, Any],
    mode: str,
    size: int,
    split: list[int] | None = None,
    weights: list[float] | None = None,
) -> list[list[str]]:
    """Per rank, the weight files it reads: its layers' in pipeline mode, all in tensor mode."""
    n = num_layers(config)
    if mode != "pipeline" or size < 2 or n is None:
        return [all_weight_files(model_dir)] * size
    split = choose_split(config, size, split, weights)
    layer_re = VLM_LAYER_RE if is_vision_model(config) else LAYER_RE
    return [
        weight_files_for_layers(model_dir, *pipeline_range(n, size, r, split), layer_re)
        for r in range(size)
    ]
