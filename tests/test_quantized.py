"""Quantized MLX checkpoints (4 and 8 bit) load sharded in both modes."""

import pytest
from conftest import reference, run_cli
from tiny import make_model

PROMPT = "Tell me about lists"


@pytest.fixture(scope="module", params=[4, 8])
def quantized(request, tmp_path_factory):
    return make_model(
        tmp_path_factory.mktemp(f"q{request.param}") / "m", "llama_q", seed=3, bits=request.param
    )


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_quantized_sharded_equals_single_process(quantized, mode):
    expected = reference(quantized, PROMPT, 32)
    assert len(expected) > 10
    p = run_cli("launch", "--mode", mode, "--model", quantized, "--max-tokens", 32, PROMPT)
    assert p.returncode == 0, p.stderr
    assert p.stdout == expected
