import pytest

from cluster.modelcheck import ModelError, check_shardable, read_config

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


def test_tensor_divisibility_names_numbers_and_hints():
    check_shardable(CFG, "tensor", 3)
    with pytest.raises(ModelError) as e:
        check_shardable({**CFG, "num_key_value_heads": 2}, "tensor", 3)
    assert (
        "num_key_value_heads=2 is not divisible by 3 ranks (rank counts that divide them: 2)"
        in str(e.value)
    )


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
    from cluster.modelcheck import choose_split, weighted_split

    assert weighted_split([96, 32], 6) == [4, 2]
    assert weighted_split([192, 192, 64], 80) == [34, 34, 12]
    assert weighted_split([1000, 1], 4) == [3, 1]
    assert choose_split(CFG, 2, None, [64, 64]) is None  # equal memory: mlx-lm's even split
    assert choose_split(CFG, 2, [5, 1], [64, 16]) == [5, 1]  # explicit wins
