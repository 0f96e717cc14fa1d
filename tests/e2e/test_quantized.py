"""Quantized MLX checkpoints (4 and 8 bit) load sharded in both modes."""

import pytest

from tests.support.processes import run_cli
from tests.support.reference import reference
from tests.support.tiny import make_model

PROMPT = "Tell me about lists"


@pytest.fixture(scope="module", params=[4, 8])
def quantized(request, tmp_path_factory):
    return make_model(
        tmp_path_factory.mktemp(f"q{request.param}") / "m", "llama_q", seed=3, bits=request.param
    )


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_quantized_sharded_equals_single_process(quantized, mode):
    expected = reference(quantized, PROMPT, 32)
    assert len(expected) > 10
    p = run_cli("launch", "--mode", mode, "--model", quantized, "--max-tokens", 32, PROMPT)
    assert p.returncode == 0, p.stderr
    assert p.stdout == expected


def test_quantized_tensor_split_unevenly_on_group_boundaries(quantized):
    """--split 3,1: rank 0 gets 3 of the 4 64-wide MLP groups; the 4 heads of 32 go 2/2
    (a span of heads must cover whole groups of 64 features)."""
    p = run_cli(
        "launch", "--mode", "tensor", "--split", "3,1", "--model", quantized, "--max-tokens", 32,
        PROMPT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(quantized, PROMPT, 32)
    assert "tensor split in proportion [3, 1]: query heads per rank 2,2" in p.stderr


def test_quantized_tensor_split_that_cuts_a_group_is_refused_before_loading(quantized):
    p = run_cli("launch", "-n", 3, "--mode", "tensor", "--model", quantized, PROMPT)
    assert p.returncode == 2
    assert "cut on quantization groups of 64: num_attention_heads=4 cannot give 3 ranks" in p.stderr
    assert "starting" not in p.stderr  # before any rank
