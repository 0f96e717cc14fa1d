"""Load this rank's share of a model: pipeline stage or tensor shard.

A pipeline rank opens only the safetensors files that hold its layers (plus the ones with the
embeddings, final norm and head); a tensor rank loads lazily and shards before any weight is
materialised, so each rank's memory is about its share of the model.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

from cluster.core.modelcheck import (
    ModelError,
    SetupError,
    choose_split,
    is_vision_model,
    looks_like_repo,
    num_layers,
    read_config,
    text_family_known,
)
from cluster.core.shards import (
    LAYER_RE,
    VLM_LAYER_RE,
    all_weight_files,
    pipeline_range,
    weight_files_for_layers,
)
from cluster.core.tensorplan import TensorPlan, check_mode
from node.model.stage import apply_stages, inner_model
from node.model.tensor import layer_problem, shard_tensor
from node.model.vlm import load_vlm

META_PATTERNS = ["*.json", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jsonl", "*.jinja"]


@dataclass
class Loaded:
    model: nn.Module
    tokenizer: Any
    config: dict
    layers: tuple[int, int] | None  # this rank's pipeline range
    files: list[str]  # weight files this rank opened
    processor: Any = None  # mlx-vlm's processor, for vision-language models
    speculation: Any = None  # node.draft.Speculation: the proposer, the same on every rank
    path: Path = field(default_factory=Path)  # the checkpoint's folder on this host


def resolve_model(ref: str, allow_patterns: list[str] | None = None) -> Path:
    """A local checkpoint directory, or a Hugging Face repo fetched (or found in the cache)."""
    path = Path(ref).expanduser()
    if path.exists() or not looks_like_repo(ref):
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref, allow_patterns=allow_patterns))
    except Exception as e:  # the hub client raises many kinds; all mean "not here"
        raise ModelError(
            f"{ref}: not a local directory, and it could not be fetched from the Hugging Face "
            f"hub ({type(e).__name__}: {e}); copy the model to this host and pass its path"
        ) from e


def _view(model_dir: Path, weight_files: list[str]) -> Path:
    """A directory of links: every non-weight file plus only ``weight_files``.

    mlx-lm's load_model reads every model*.safetensors in a directory; this lets a pipeline rank
    give it just the files of its own layers without copying anything.
    """
    view = Path(tempfile.mkdtemp(prefix="mlx-cluster-view-"))
    for p in model_dir.iterdir():
        if p.suffix != ".safetensors" or p.name in weight_files:
            (view / p.name).symlink_to(p.resolve())
    return view


def _model_class(config: dict) -> type:
    try:
        return _get_classes(config)[0]
    except ValueError as e:  # mlx-lm: "Model type X not supported."
        raise ModelError(
            f"model family {config.get('model_type')!r} is not supported by the installed "
            f"mlx-lm ({e}); upgrade mlx-lm on every host, or use another model"
        ) from None


@contextmanager
def recording_loads(names: set[str]):
    """While loading, note the names of the weights handed to ``load_weights``.

    A pipeline rank loads with strict=False (it has only some layers' files), and then a
    weight missing from its own files would silently keep its random initial value. A patch
    of nn.Module rather than a model subclass, so it serves mlx-lm and mlx-vlm alike.
    """
    original = nn.Module.load_weights

    def load_weights(self, weights, strict=True):
        weights = list(weights)
        names.update(name for name, _ in weights)
        return original(self, weights, strict=strict)

    nn.Module.load_weights = load_weights  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.load_weights = original  # type: ignore[method-assign]


def check_complete(
    model: nn.Module,
    loaded: set[str],
    layers: tuple[int, int],
    model_dir: Path,
    layer_re: re.Pattern = LAYER_RE,
) -> None:
    """Every parameter this rank will use (its layers and everything outside the layers)
    must have come from the weight files; name the missing ones otherwise."""
    start, end = layers
    missing = []
    for name, _ in named_arrays(model):
        m = layer_re.search(name)
        if (m is None or start <= int(m.group(1)) < end) and name not in loaded:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:5])
        if len(missing) > 5:
            shown += f" and {len(missing) - 5} more"
        raise ModelError(
            f"{model_dir}: the weight files lack {len(missing)} weight(s) this rank needs: "
            f"{shown}. A file named in model.safetensors.index.json is missing or incomplete, "
            "or the checkpoint does not match its config.json; copy or convert the model again"
        )


def materialize(model: nn.Module) -> None:
    """Read the weights one array at a time. A tensor rank's slices are cut from whole tensors
    read from disk; evaluating them all at once would hold every whole tensor at the same
    moment, and the rank's peak would be the full model's."""
    for _, array in named_arrays(model):
        mx.eval(array)


def named_arrays(model: nn.Module) -> list[tuple[str, mx.array]]:
    """The model's parameters by dotted name (tree_flatten's list form)."""
    return cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))


def shard_for_tensor(model: nn.Module, plan: TensorPlan, weights, group) -> None:
    """Our sharding by layer role (node/model/tensor.py) where it knows every layer; else mlx-lm's
    own shard() (deepseek_v3's latent attention), which splits evenly only."""
    layers = getattr(model, "layers", None)
    problem: str | None = "it has no list of layers"
    if isinstance(layers, list) and layers:
        problem = next((p for p in map(layer_problem, layers) if p), None)
    if problem is None and layers:
        shard_tensor(layers, plan, group)
        return
    family = type(model).__module__.rsplit(".", 1)[-1]
    if not hasattr(model, "shard"):
        raise ModelError(
            f"tensor mode cannot split model family {family!r} by its parts ({problem}), and "
            "mlx-lm has no shard() for it; use --mode pipeline"
        )
    if weights or not plan.even():
        raise ModelError(
            f"model family {family!r} is sharded by mlx-lm's own shard(), which splits heads "
            "evenly and does not replicate KV heads: use a rank count that divides "
            "num_attention_heads and num_key_value_heads, without --split or memory_gb "
            "weights, or --mode pipeline"
        )
    args: Any = getattr(getattr(model, "language_model", None), "args", None)
    vocab = getattr(args, "vocab_size", None)
    whole_head = (  # qwen3_5's shard() splits an untied head by vocabulary, evenly only: the
        # head stays whole on every rank instead (each computes every logit) when it cannot
        isinstance(vocab, int) and getattr(args, "tie_word_embeddings", True) is False
        and vocab % group.size() != 0
    )  # fmt: skip
    try:
        if whole_head:
            args.tie_word_embeddings = True  # read by shard() alone to split the head
        model.shard(group)
    except (AssertionError, ValueError) as e:  # its own checks (qwen3_5: the ranks must divide
        # the vocabulary; deepseek_v41: the heads and output groups)
        why = str(e).rstrip(".")
        raise ModelError(
            f"mlx-lm's shard() for model family {family!r} cannot split it over "
            f"{group.size()} ranks ({why}); use a rank count it divides, or --mode pipeline"
        ) from None
    finally:
        if whole_head:
            args.tie_word_embeddings = False


def load_shard(
    ref: str,
    mode: str,
    group,
    split: list[int] | None = None,
    split_weights: list[float] | None = None,
    text_only: bool = False,
) -> Loaded:
    """``text_only`` (no image in the job): a vision-language checkpoint whose family mlx-lm
    knows is loaded as text by mlx-lm, its vision weights left out."""
    size, rank = group.size(), group.rank()
    model_dir = resolve_model(ref, META_PATTERNS)
    config = read_config(model_dir, require_weights=not looks_like_repo(ref))
    weights = split or split_weights
    plan = check_mode(config, mode, size, weights)
    vlm = is_vision_model(config) and not (text_only and text_family_known(config))
    layer_re = VLM_LAYER_RE if is_vision_model(config) else LAYER_RE

    layers = None
    if mode == "pipeline" and size > 1:
        n = num_layers(config)
        if n is None:
            raise ModelError(f"config of {config.get('model_type')!r} gives no num_hidden_layers")
        split = choose_split(config, size, split, split_weights)
        layers = pipeline_range(n, size, rank, split)
        files = weight_files_for_layers(model_dir, *layers, layer_re)
        if looks_like_repo(ref):
            model_dir = resolve_model(ref, META_PATTERNS + files)
    else:
        if looks_like_repo(ref):
            model_dir = resolve_model(ref)
        files = all_weight_files(model_dir)

    absent = [f for f in files if not (model_dir / f).exists()]
    if absent:
        raise ModelError(
            f"{model_dir}: weight file(s) {', '.join(absent)} named in "
            "model.safetensors.index.json are missing; the copy or download is incomplete "
            "(after `mlx-cluster sync`: sync again with the --mode and --split you run with)"
        )
    view = _view(model_dir, files)
    loaded_names: set[str] = set()
    processor = None
    try:
        with recording_loads(loaded_names):
            if vlm:
                model, processor = load_vlm(view, model_dir)
            else:
                model, config = load_model(view, lazy=True, strict=False)
    finally:
        for p in view.iterdir():
            p.unlink()
        view.rmdir()
    check_complete(model, loaded_names, layers or (0, 10**9), model_dir, layer_re)

    if size > 1 and mode == "tensor":
        assert plan is not None  # check_mode plans tensor mode
        shard_for_tensor(model.language_model if vlm else model, plan, weights, group)
    elif size > 1:
        text_model = model.language_model if vlm else model
        inner = inner_model(text_model)
        if inner is None:
            raise ModelError(
                f"model family {config['model_type']!r} has no list of layers under model or "
                "backbone; pipeline mode cannot split it (try --mode tensor)"
            )
        if hasattr(inner, "pipeline"):
            inner.pipeline(group) if split is None else inner.pipeline(group, split=split)
        else:
            apply_stages(text_model, group, split, vlm_cache=vlm)
    materialize(model)
    model.eval()

    if processor is not None:
        tokenizer = processor.tokenizer
    else:
        tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    return Loaded(model, tokenizer, config, layers, files, processor, path=Path(model_dir))


def tokenizer_digest(model_dir: Path, eos_ids, vocab: int) -> int:
    """31 bits of what makes this rank's tokens mean what rank 0's mean: tokenizer.json (or
    the files that stand for it), the end-of-sequence ids and the logits' width."""
    h = hashlib.sha256(f"{sorted(eos_ids)}:{vocab}".encode())
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt"):
        path = Path(model_dir) / name
        if path.exists():
            h.update(name.encode() + path.read_bytes())
    return int.from_bytes(h.digest()[:4], "little") & 0x7FFFFFFF


def check_same_tokenizer(loaded, vocab: int, group) -> None:
    """Every rank's tokenizer is rank 0's, or the job stops at start with a sentence: ranks
    whose tokens differ would mask, stop and count differently (a grammar failing on one rank
    alone, a batch out of step). The ranks that differ say so; the others wait on them."""
    from node.rank.dist import gather_ints
    from node.rank.share import PeerFailed

    digests = gather_ints(tokenizer_digest(loaded.path, loaded.tokenizer.eos_token_ids, vocab),
                          group)  # fmt: skip
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if not odd:
        return
    where = f"{', '.join(f'rank {r}' for r in odd)} {'differs' if len(odd) == 1 else 'differ'}"
    if group.rank() in odd:
        raise SetupError(
            f"this rank's tokenizer (tokenizer.json, end-of-sequence ids or vocabulary) is not "
            f"rank 0's ({where}): the model's copy on this host is another version or "
            "incomplete; copy it again from the host of rank 0 (mlx-cluster sync)"
        )
    raise PeerFailed(f"a rank's tokenizer is not rank 0's ({where}); see that rank's error")
