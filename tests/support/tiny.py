"""Tiny random models laid out exactly as a converted MLX checkpoint: config.json, tokenizer,
sharded safetensors with model.safetensors.index.json. float32, so sharded and single-process
greedy decoding agree token for token."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

FAMILIES = {
    "llama_q": {  # sizes that divide into 64-wide quantization groups, also when sharded by 2
        "model_type": "llama",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5,
        "vocab_size": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "llama": {  # 12 heads: tensor mode at 2, 3 and 4 ranks
        "model_type": "llama",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 192,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "rms_norm_eps": 1e-5,
        "vocab_size": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 240,
        "num_attention_heads": 12,
        "num_key_value_heads": 6,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 192,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": 512,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 192,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 192,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "gemma2": {
        "model_type": "gemma2",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 192,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "query_pre_attn_scalar": 16,
    },
    "gemma3_text": {  # a window shorter than the test prompts, so sliding layers really slide
        "model_type": "gemma3_text",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 192,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
    },
    "phi3": {
        "model_type": "phi3",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 192,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
        "rms_norm_eps": 1e-5,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
    },
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 96,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 512,
    },
    "deepseek_v3": {  # multi-head latent attention; layer 0 dense, the rest MoE
        "model_type": "deepseek_v3",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 192,
        "moe_intermediate_size": 48,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
    },
    "qwen3_5": {  # linear attention (ArraysCache) + full attention every 3rd layer
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "hidden_size": 96,
            "num_hidden_layers": 6,
            "intermediate_size": 192,
            "num_attention_heads": 12,
            "num_key_value_heads": 12,
            "head_dim": 8,
            "linear_num_value_heads": 12,
            "linear_num_key_heads": 12,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 3,
            "rms_norm_eps": 1e-6,
            "vocab_size": 512,
            "tie_word_embeddings": False,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "type": "default",
                "mrope_section": [2, 1, 1],
                "rope_theta": 100000,
                "partial_rotary_factor": 0.5,
            },
        },
        "tie_word_embeddings": False,
        "vocab_size": 512,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 6,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 512,
        "rms_norm_eps": 1e-5,
        "hidden_size": 96,
        "intermediate_size": 48,
        "head_dim": 8,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "sliding_window": 8,
        "rope_theta": 150000,
        "layer_types": ["sliding_attention", "full_attention"] * 3,
    },
    "gemma4_text": {
        "model_type": "gemma4_text",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 192,
        "num_attention_heads": 6,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,
        "vocab_size": 512,
        "vocab_size_per_layer_input": 512,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
        "use_double_wide_mlp": False,
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
    },
    "gemma4_moe": {
        "model_type": "gemma4_text",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 192,
        "num_attention_heads": 6,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "vocab_size": 512,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
        "use_double_wide_mlp": False,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 48,
        "attention_k_eq_v": True,
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
    },
    "longcat_flash": {
        "model_type": "longcat_flash",
        "attention_method": "MLA",
        "zero_expert_type": "identity",
        "hidden_size": 96,
        "ffn_hidden_size": 192,
        "moe_topk": 2,
        "expert_ffn_hidden_size": 48,
        "n_routed_experts": 4,
        "zero_expert_num": 2,
        "num_layers": 4,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "num_attention_heads": 12,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "attention_bias": False,
    },
    "mimo_v2_flash": {
        "model_type": "mimo_v2_flash",
        "num_experts_per_tok": 2,
        "hybrid_layer_pattern": [0, 1, 1, 0, 1, 1],
        "moe_layer_freq": [0, 1, 1, 1, 1, 1],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "sliding_window_size": 8,
        "vocab_size": 512,
        "hidden_size": 96,
        "intermediate_size": 192,
        "moe_intermediate_size": 48,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "n_shared_experts": None,
        "n_routed_experts": 4,
        "routed_scaling_factor": None,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "max_position_embeddings": 4096,
        "layernorm_epsilon": 1e-6,
        "rope_theta": 1000000.0,
        "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": 6,
        "swa_num_key_value_heads": 3,
        "head_dim": 16,
        "v_head_dim": 8,
        "swa_head_dim": 16,
        "swa_v_head_dim": 8,
        "partial_rotary_factor": 1,
    },
    "glm4_moe": {
        "model_type": "glm4_moe",
        "vocab_size": 512,
        "hidden_size": 96,
        "intermediate_size": 192,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "num_attention_heads": 6,
        "n_group": 1,
        "head_dim": 16,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 6,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "use_qk_norm": True,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
    },
    "qwen3_next": {  # linear attention (a gated delta net) with full attention every 3rd layer
        "model_type": "qwen3_next",
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "intermediate_size": 192,
        "num_attention_heads": 12,
        "num_key_value_heads": 6,
        "head_dim": 8,
        "linear_num_value_heads": 12,
        "linear_num_key_heads": 6,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [0],
        "moe_intermediate_size": 48,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": 4096,
        "full_attention_interval": 3,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    "kimi_linear": {  # Kimi delta attention (ArraysCache) with latent attention (MLA) every 3rd
        "model_type": "kimi_linear",
        "vocab_size": 512,
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "intermediate_size": 192,
        "head_dim": 8,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "kv_lora_rank": 32,
        "mla_use_nope": True,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "linear_attn_config": {
            "num_heads": 12,
            "head_dim": 8,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 4, 5],
        },
        "model_max_length": 4096,
        "bos_token_id": 1,
        "pad_token_id": 0,
        "max_position_embeddings": 4096,
        "num_experts": 4,
        "moe_intermediate_size": 48,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "tie_word_embeddings": False,
    },
    "deepseek_v41": {  # DeepSeek V4: hyper-connections, compressed KV and indexers (LayerCache)
        "model_type": "deepseek_v41",
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 12,
        "head_dim": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "o_groups": 12,
        "o_lora_rank": 16,
        "moe_intermediate_size": 48,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "compress_ratios": [0, 4, 4, 0],
        "kv_source_layer_ids": [1],
        "index_source_layer_ids": [1, 2],
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 8,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 3,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    "deepseek_v32": {  # DeepSeek V3.2: latent attention with a sparse indexer (CacheList)
        "model_type": "deepseek_v32",
        "vocab_size": 512,
        "hidden_size": 96,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 8,
        "intermediate_size": 192,
        "moe_intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "minimax": {  # MiniMax M2: experts, partial rotary, per-layer qk norm
        "model_type": "minimax",
        "hidden_size": 96,
        "intermediate_size": 48,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "max_position_embeddings": 4096,
        "num_experts_per_tok": 2,
        "num_local_experts": 4,
        "shared_intermediate_size": 0,
        "num_hidden_layers": 4,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rotary_dim": 8,
        "vocab_size": 512,
        "head_dim": 8,
        "use_qk_norm": True,
        "tie_word_embeddings": False,
    },
    "step3p5": {  # Step-3.5: sliding windows (RotatingKVCache), head-wise gates, experts
        "model_type": "step3p5",
        "hidden_size": 96,
        "num_hidden_layers": 4,
        "vocab_size": 512,
        "num_attention_heads": 12,
        "num_attention_groups": 12,
        "head_dim": 8,
        "intermediate_size": 192,
        "max_position_embeddings": 4096,
        "sliding_window": 8,
        "layer_types": [
            "full_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_intermediate_size": 48,
        "share_expert_dim": 48,
        "moe_layers_enum": "1,2,3",
        "tie_word_embeddings": False,
    },
    "nemotron_h": {  # Mamba-2 mixers (ArraysCache), attention, MLP and MoE blocks, under backbone
        "model_type": "nemotron_h",
        "vocab_size": 512,
        "hidden_size": 96,
        "intermediate_size": 192,
        "max_position_embeddings": 4096,
        "num_attention_heads": 12,
        "num_key_value_heads": 6,
        "head_dim": 8,
        "attention_bias": False,
        "mamba_num_heads": 12,
        "mamba_head_dim": 8,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 6,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": ["M", "-", "*", "M", "E", "M", "*", "-"],
        "num_hidden_layers": 8,
        "moe_intermediate_size": 48,
        "moe_shared_expert_intermediate_size": 48,
        "n_group": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "time_step_limit": [0.0, 1e9],
        "tie_word_embeddings": False,
    },
}
# GLM-5: DeepSeek V3.2's sparse attention (CacheList), GLM's router and rope parameters
FAMILIES["glm_moe_dsa"] = {
    **FAMILIES["deepseek_v32"],
    "model_type": "glm_moe_dsa",
    "routed_scaling_factor": 1.0,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "moe_layer_freq": 1,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rope_theta": 10000.0,
    "attention_bias": False,
}
# Qwen3.5/3.6 MoE (35B-A3B): Qwen3.5's linear attention, with experts and a shared expert
FAMILIES["qwen3_5_moe"] = {
    "model_type": "qwen3_5_moe",
    "text_config": {
        **FAMILIES["qwen3_5"]["text_config"],
        "model_type": "qwen3_5_moe_text",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "tie_word_embeddings": False,
    "vocab_size": 512,
}

# gemma2's and gemma4's tied, sqrt(hidden)-scaled embeddings saturate at the usual x8: one token
# repeated (gemma4, with its per-layer inputs and softcap, down to x0.6)
INIT_SCALE = {"gemma2": 2.0, "gemma4_text": 0.3, "gemma4_moe": 0.3}

# 4-bit conversions of this year's families, as users download them: the family, wider where
# it must be (every quantized width a whole number of 64-wide groups, also when split by 2)
QUANTIZED = {
    "qwen3_5_moe_q4": ("qwen3_5_moe", {"text_config": {
        **FAMILIES["qwen3_5_moe"]["text_config"], "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16,
        "linear_num_value_heads": 8, "linear_num_key_heads": 8, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128}}),
    "gpt_oss_q4": ("gpt_oss", {"hidden_size": 128, "intermediate_size": 128, "head_dim": 16,
                               "num_attention_heads": 8, "num_key_value_heads": 8}),
    "deepseek_v32_q4": ("deepseek_v32", {
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
        "num_attention_heads": 8, "num_key_value_heads": 8, "kv_lora_rank": 64,
        "q_lora_rank": 64, "qk_rope_head_dim": 16, "v_head_dim": 16, "qk_nope_head_dim": 16,
        "index_head_dim": 32, "index_n_heads": 2}),
}  # fmt: skip
QUANTIZED["glm_moe_dsa_q4"] = ("glm_moe_dsa", QUANTIZED["deepseek_v32_q4"][1])


def train_tokenizer(
    out: Path,
    vocab_size: int = 512,
    chat_template: str | None = None,
    extra_special=(),
    corpus: list[str] | None = None,
    **special_tokens,
):
    """A byte-level BPE tokenizer trained on ``corpus`` (by default some of pydoc's topics)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or list(topics.values())[:20], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, **special_tokens)
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    if "layers" in parts:
        return int(parts[parts.index("layers") + 1])
    return None


def save_sharded(weights: dict[str, mx.array], out: Path, layers_per_file: int = 2) -> None:
    """Embeddings in the first file, ``layers_per_file`` layers per file, norm and head last."""
    groups: dict[int, dict] = {}
    for name, w in weights.items():
        layer = layer_of(name)
        if layer is None:
            key = -1 if "embed" in name else 10**6
        else:
            key = layer // layers_per_file
        groups.setdefault(key, {})[name] = w
    ordered = [groups[k] for k in sorted(groups)]
    total = len(ordered)
    weight_map = {}
    for i, group in enumerate(ordered, start=1):
        fname = f"model-{i:05d}-of-{total:05d}.safetensors"
        mx.save_safetensors(str(out / fname), group, metadata={"format": "mlx"})
        weight_map.update({name: fname for name in group})
    size = sum(w.nbytes for w in weights.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2)
    )


def make_model(
    out: Path,
    family: str = "llama",
    seed: int = 0,
    chat_template: bool | str = False,
    bits: int | None = None,
    extra_special=(),
    init_scale: float | None = None,
    **overrides,
) -> Path:
    """Write a random float32 ``family`` model to ``out`` and return ``out``.

    With ``bits``, the linear layers and embeddings are quantized (group size 64) and the
    config records it, as ``mlx_lm.convert -q`` does."""
    from mlx_lm.utils import _get_classes

    out.mkdir(parents=True, exist_ok=True)
    if family in QUANTIZED:  # a 4-bit conversion of a family
        family, wider = QUANTIZED[family]
        overrides, bits = {**wider, **overrides}, bits or 4
    config = {**FAMILIES[family], **overrides}
    template = chat_template if isinstance(chat_template, str) else None
    template = template or (CHAT_TEMPLATE if chat_template else None)
    tokenizer = train_tokenizer(out, config["vocab_size"], template, extra_special)
    config.setdefault("eos_token_id", tokenizer.eos_token_id)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Wider than the usual init (init_scale) so logits have clear winners (no near-ties).
    init_scale = init_scale or INIT_SCALE.get(family, 8.0)
    params = tree_map(lambda p: p * init_scale if p.ndim == 2 else p, model.parameters())
    model.update(params)
    if bits is not None:
        from mlx_lm.utils import quantize_model

        model, config = quantize_model(model, config, 64, bits)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    save_sharded(weights, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def as_vision_conversion(text_model: Path, out: Path) -> Path:
    """``text_model`` laid out as mlx-community's vision-language conversions of Qwen3.5/3.6,
    Gemma 4 or Kimi K2.5 are: the same language-model weights (under ``language_model.``), a
    ``vision_config`` in config.json and vision-tower weights beside them (one, here: serve
    answers text with such a checkpoint through mlx-lm, which leaves the tower out)."""
    import shutil

    shutil.copytree(text_model, out)
    config = json.loads((out / "config.json").read_text())
    config["vision_config"] = {"model_type": config["model_type"], "depth": 1, "hidden_size": 32}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    if not all(k.startswith("language_model.") for k in index["weight_map"]):
        raise ValueError(f"{text_model}: its weights are not under language_model.")
    tower = {"vision_tower.blocks.0.attn.qkv.weight": mx.zeros((96, 32))}
    mx.save_safetensors(str(out / "model-vision.safetensors"), tower, metadata={"format": "mlx"})
    index["weight_map"].update(dict.fromkeys(tower, "model-vision.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


IMAGE_TOKEN = "<image>"
BOS = "<bos>"
VLM_FAMILIES = {
    # SigLIP vision tower + gemma text model; 28 px images in 14 px patches: 4 image tokens.
    # (llava would be the classic choice, but mlx-vlm 0.7's LlavaProcessor passes `padding`
    # to the image processor, which transformers 5 rejects: Blaizzy/mlx-vlm#870.)
    "paligemma": {
        "model_type": "paligemma",
        "text_config": {
            "model_type": "gemma",
            "hidden_size": 96,
            "num_hidden_layers": 6,
            "intermediate_size": 192,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "vocab_size": 512,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "projection_dim": 96,
            "layer_norm_eps": 1e-6,
        },
        "hidden_size": 96,
        "projection_dim": 96,
        "vocab_size": 512,
    },
}


def make_vlm(out: Path, family: str = "paligemma", seed: int = 0) -> Path:
    """A random float32 mlx-vlm checkpoint: config, tokenizer with image and bos tokens,
    image processor and processor configs, sharded safetensors."""
    from mlx_vlm.utils import get_model_and_args

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(VLM_FAMILIES[family]))
    tokenizer = train_tokenizer(
        out, config["vocab_size"], extra_special=[IMAGE_TOKEN, BOS], bos_token=BOS
    )
    config["image_token_index"] = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    config["eos_token_id"] = tokenizer.eos_token_id
    config["pad_token_id"] = tokenizer.eos_token_id
    vision = config["vision_config"]
    size = vision["image_size"]
    image_tokens = (size // vision["patch_size"]) ** 2
    processor = {
        "image_processor_type": "SiglipImageProcessor",
        "processor_class": "PaliGemmaProcessor",
        "image_seq_length": image_tokens,
        "size": {"height": size, "width": size},
        "do_resize": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 3,
        "rescale_factor": 1 / 255,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    (out / "processor_config.json").write_text(
        json.dumps(
            {"processor_class": "PaliGemmaProcessor", "image_seq_length": image_tokens},
            indent=2,
        )
    )
    arch, _ = get_model_and_args(config)
    mx.random.seed(seed)
    model = arch.Model(arch.ModelConfig.from_dict(json.loads(json.dumps(config))))
    params = tree_map(lambda p: p * 2.0 if p.ndim == 2 else p, model.parameters())
    model.update(params)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    save_sharded(weights, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.support.tiny OUT --family qwen2 --set hidden_size=960 ...``: a random model
    for benchmarks (docs/benchmarks.md), laid out like a converted checkpoint."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", default="qwen2", choices=sorted(FAMILIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=INT", help="a config override"
    )
    args = parser.parse_args(argv)
    overrides = {k: int(v) for k, v in (item.split("=", 1) for item in args.set)}
    make_model(args.out, args.family, seed=args.seed, **overrides)
    config = json.loads((args.out / "config.json").read_text())
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"{args.out}: {config['model_type']}, {size / 4e6:.0f}M float32 parameters")


if __name__ == "__main__":
    main()
