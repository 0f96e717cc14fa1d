import pytest

from cluster.core.modelcheck import ModelError, check_shardable, read_config
from cluster.core.tensorplan import check_mode, spans

CFG = {
    "model_type": "llama",
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "intermediate_size": 192,
}


def test_pipeline_rank_limit():
    check_shardable(CFG, "pipeline", 6)
    with pytest.raises(ModelError, match="the model has 6 layers but 7 ranks"):
        check_shardable(CFG, "pipeline", 7)


def test_tensor_plan_uneven_heads_replicated_kv_and_its_cost():
    plan = check_mode({**CFG, "num_key_value_heads": 2}, "tensor", 4)
    assert plan.heads == [(0, 2), (2, 4), (4, 5), (5, 6)]  # 6 heads over 4: 2/2/1/1
    # a KV head serves 3 query heads: rank 1's heads 2 and 3 use KV heads 0 and 1
    assert plan.kv == [[0], [0, 1], [1], [1]]
    assert plan.mlp == [(0, 48), (48, 96), (96, 144), (144, 192)]
    assert not plan.even()
    assert plan.kv_note() == (
        "KV heads replicated: the ranks hold 1, 2, 1, 1 of the model's 2 KV heads "
        "(2.50x the KV cache and k/v projections of an even split)"
    )
    even = check_mode(CFG, "tensor", 3)
    assert even.even() and even.kv == [[0, 1], [2, 3], [4, 5]] and even.kv_note() is None


def test_tensor_plan_splits_on_kv_groups_when_that_is_less_work():
    """9 heads and 3 KV heads over 2 ranks: 5/4 would hold 5 and 4 KV heads (one per query
    head); 6/3 on the groups holds 2 and 1, less for the busiest rank."""
    nine = {**CFG, "num_attention_heads": 9, "num_key_value_heads": 3}
    plan = check_mode(nine, "tensor", 2)
    assert plan.heads == [(0, 6), (6, 9)] and plan.kv == [[0, 1], [2]]
    assert plan.mlp == [(0, 96), (96, 192)]  # sizes unknown: columns as the weights say
    # with the sizes, the MLP evens out the work: rank 0's 6+2 heads of 2*576*64 multiply-adds
    # against rank 1's 3+1, an MLP column 3*576
    sized = check_mode({**nine, "hidden_size": 576, "intermediate_size": 1536}, "tensor", 2)
    assert sized.mlp == [(0, 683), (683, 1536)]
    # a tie keeps the even query split: 12 heads and 6 KV heads over 4 ranks (3+3 each way)
    tie = check_mode({**CFG, "num_attention_heads": 12, "num_key_value_heads": 6}, "tensor", 4)
    assert tie.heads == [(0, 3), (3, 6), (6, 9), (9, 12)]


def test_tensor_plan_in_proportion_to_memory():
    big = {**CFG, "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 1024}
    # 22/21/21 would cut KV groups of 8 (one KV head held per query head): whole groups
    three = check_mode(big, "tensor", 3)
    assert [b - a for a, b in three.heads] == [24, 24, 16]
    assert three.kv == [[0, 1, 2], [3, 4, 5], [6, 7]] and three.kv_note() is None
    plan = check_mode(big, "tensor", 2, [192, 64])  # a 192 GB and a 64 GB Mac
    assert [b - a for a, b in plan.heads] == [48, 16]
    assert [b - a for a, b in plan.mlp] == [768, 256]
    assert plan.kv == [[0, 1, 2, 3, 4, 5], [6, 7]]


def test_tensor_plan_refusals_name_the_numbers():
    with pytest.raises(ModelError, match=r"split \[3, 1, 1\] needs one positive share per rank"):
        check_mode(CFG, "tensor", 2, [3, 1, 1])
    with pytest.raises(ModelError, match="num_attention_heads=6 is fewer than 8 ranks"):
        check_mode(CFG, "tensor", 8)
    quantized = {**CFG, "hidden_size": 96, "quantization": {"group_size": 64, "bits": 4}}
    # head_dim 16: a span of query heads must be a multiple of 4 heads (64 features)
    with pytest.raises(ModelError, match="cut on quantization groups of 64: num_attention_heads=6"):
        check_mode(quantized, "tensor", 2)
    ok = {**quantized, "hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 8}
    ok["intermediate_size"] = 256
    plan = check_mode(ok, "tensor", 2)
    assert plan.heads == [(0, 4), (4, 8)] and plan.mlp == [(0, 128), (128, 256)]


def test_spans():
    assert spans(10, [1, 1, 1]) == [(0, 4), (4, 7), (7, 10)]
    assert spans(8, [100, 1]) == [(0, 7), (7, 8)]  # never an empty span
    assert spans(256, [3, 1], unit=64) == [(0, 192), (192, 256)]
    with pytest.raises(ValueError):
        spans(2, [1, 1, 1])


def test_gguf_and_empty_dirs(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelError, match="GGUF files are not supported"):
        read_config(gguf)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelError, match="no .safetensors weights"):
        read_config(tmp_path)


def test_lora_adapter_is_named_with_the_fuse_command(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapters.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match="is a LoRA adapter, not a model.*mlx_lm.fuse"):
        read_config(tmp_path)


def test_weighted_split_gives_every_rank_a_layer_and_sums():
    from cluster.core.modelcheck import choose_split, weighted_split

    assert weighted_split([96, 32], 6) == [4, 2]
    assert weighted_split([192, 192, 64], 80) == [34, 34, 12]
    assert weighted_split([1000, 1], 4) == [3, 1]
    assert choose_split(CFG, 2, None, [64, 64]) is None  # equal memory: mlx-lm's even split
    assert choose_split(CFG, 2, [5, 1], [64, 16]) == [5, 1]  # explicit wins


def test_gemma4_kv_sharing_layers_stay_on_the_stage_that_makes_their_keys():
    """Gemma 4's last num_kv_shared_layers layers reuse the keys and values of the last earlier
    layer of their kind: the last stage (rank 0) holds those source layers and all after."""
    from cluster.core.modelcheck import choose_split, kv_shared_tail

    # E2B's shape: 35 layers, 20 sharing, sliding x4 then full; sources are layers 13 and 14
    e2b = {"model_type": "gemma4_text", "num_hidden_layers": 35, "num_kv_shared_layers": 20,
           "sliding_window_pattern": 5}  # fmt: skip
    assert kv_shared_tail(e2b) == 13
    assert choose_split(e2b, 2, None, None) == [22, 13]
    assert choose_split(e2b, 3, None, None) == [22, 7, 6]
    assert choose_split(e2b, 2, None, [64, 16])[0] >= 22  # memory weights keep the rule
    assert choose_split(e2b, 2, [28, 7], None) == [28, 7]
    with pytest.raises(ModelError, match="must hold layers 13-34: give it at least 22"):
        choose_split(e2b, 2, [18, 17], None)
    tiny = {
        "model_type": "gemma4_text",
        "num_hidden_layers": 6,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    }
    assert kv_shared_tail(tiny) == 2
    assert choose_split(tiny, 3, None, None) == [4, 1, 1]
    with pytest.raises(ModelError, match="use at most 3 ranks, or --mode tensor"):
        choose_split(tiny, 4, None, None)
    # no sharing (the 26B and 31B checkpoints): the usual even split
    assert kv_shared_tail({**e2b, "num_kv_shared_layers": 0}) is None
    assert choose_split({**e2b, "num_kv_shared_layers": 0}, 2, None, None) is None


def test_a_vision_conversion_of_a_family_mlx_lm_knows_is_served_as_text():
    """mlx-community's vision-language conversions (vision_config kept) of families mlx-lm
    has a text model for go to chat, serve and bench as text; others are refused, named."""
    from cluster.core.modelcheck import check_request, text_family_known

    qwen = {"model_type": "qwen3_5", "vision_config": {}, "text_config": {}}
    assert text_family_known(qwen)
    for command in ("chat", "serve", "bench", "logits", "generate"):
        check_request(qwen, command, False, "q")
    pali = {"model_type": "paligemma", "vision_config": {}}
    assert not text_family_known(pali)
    assert not text_family_known({"model_type": "../../etc/x", "vision_config": {}})
    with pytest.raises(ModelError, match="serve is for text models.*'paligemma'.*cannot load"):
        check_request(pali, "serve", False, "p")
