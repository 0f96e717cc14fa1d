"""Which of mlx-lm's model families tensor mode can split by the parts of their layers.

    python -m tests.support.families    # a markdown list on stdout (docs/models.md keeps it)

Each family's Model is built from one small generic config (the fields its ModelArgs does not
take are dropped) with random weights, and each decoder layer goes through node.model.tensor's
``layer_problem``: the same test ``launch --mode tensor`` applies before it shards. This says
whether the rules recognise the layers, not that a sharded run of the family matches: the
families in docs/models.md's table are the ones run and compared.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import mlx_lm.models  # noqa: E402

from node.model.tensor import layer_problem  # noqa: E402

NOT_MODELS = {"base", "cache", "rope_utils", "switch_layers", "activations", "pipeline", "ssm"}
CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "rms_norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": True,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_shared_experts": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "sliding_window": 32,
    "sliding_window_pattern": 2,
    "attention_bias": False,
    "mlp_bias": False,
    "use_qkv_bias": False,
    "partial_rotary_factor": 1.0,
    "rope_scaling": None,
    "qk_norm": False,
    "use_qk_norm": False,
    "post_norm": False,
    "logits_scaling": 1.0,
    "attention_multiplier": 1.0,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "scale_depth": 1.0,
    "scale_emb": 1.0,
    "dim_model_base": 64,
    "rotary_emb_base": 10000.0,
    "rotary_pct": 1.0,
    "rotary_dim": 16,
    "shared_intermediate_size": 64,
    "moe_num_experts": 4,
    "use_bias": False,
}


def survey() -> dict[str, str | None]:
    """family -> None (recognised), a reason, or 'could not be built: ...'."""
    out: dict[str, str | None] = {}
    for info in sorted(pkgutil.iter_modules(mlx_lm.models.__path__), key=lambda m: m.name):
        name = info.name
        if name in NOT_MODELS or name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"mlx_lm.models.{name}")
        except (Exception, SystemExit) as e:  # a family that needs another package
            out[name] = f"could not be built: its module does not import ({type(e).__name__})"
            continue
        if not hasattr(module, "Model") or not hasattr(module, "ModelArgs"):
            continue  # a helper module (layers, attention kinds), not a family
        try:
            args_cls, model_cls = module.ModelArgs, module.Model
            fields = inspect.signature(args_cls).parameters
            config = {k: v for k, v in {**CONFIG, "model_type": name}.items() if k in fields}
            model = model_cls(args_cls(**config))
            layers = model.layers
        except (Exception, SystemExit) as e:  # args that need more than the generic config
            out[name] = f"could not be built from the generic config ({type(e).__name__})"
            continue
        problems = [p for p in map(layer_problem, layers) if p]
        shard = " (mlx-lm's shard() covers it)" if hasattr(model_cls, "shard") else ""
        out[name] = f"{problems[0]}{shard}" if problems else None
    return out


def render(found: dict[str, str | None]) -> str:
    yes = [n for n, why in found.items() if why is None]
    built = {n: w for n, w in found.items() if w and not w.startswith("could not")}
    unbuilt = [n for n, w in found.items() if w and w.startswith("could not")]
    lines = [
        f"Recognised by the rules ({len(yes)} of {len(found)} mlx-lm families): "
        + ", ".join(yes)
        + ".",
        "",
        f"Not recognised ({len(built)}), with the first reason:",
        "",
    ]
    lines += [f"- {n}: {w}" for n, w in built.items()]
    lines += ["", f"Not built from the generic config ({len(unbuilt)}): {', '.join(unbuilt)}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(survey()), end="")
