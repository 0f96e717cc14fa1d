"""On an NVIDIA GPU with MLX's CUDA build (mlx-cluster[cuda]): doctor sees the GPU and MLX on
it, launch's text equals single-process mlx-lm's on the GPU (1 rank; 2 ranks over ring on one
GPU; tensor mode over nccl on two GPUs when there are two), bench runs beside mlx-lm. Skipped
where MLX has no CUDA (CI, Macs). Run on a GPU machine with ``python -m pytest -m gpu -v
tests/e2e/test_gpu.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from cluster.core.modelcheck import default_model_path
from tests.support.processes import run_cli
from tests.support.reference import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA build and a GPU"),
]
PROMPT = "Tell me about lists"


def gpu_count() -> int:
    p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return len(p.stdout.strip().splitlines()) if p.returncode == 0 else 0


def test_doctor_reports_the_gpu_and_mlx_on_it(tmp_path):
    hostfile = tmp_path / "gpu.yaml"
    hostfile.write_text(f"python: {sys.executable}\nhosts:\n  - ssh: localhost\n    gpus: [0]\n")
    p = run_cli("doctor", "--hostfile", hostfile, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    (host,) = json.loads(p.stdout)["hosts"]
    gpu = host["gpu"]
    assert gpu["devices"] and gpu["mlx"]["cuda"] and "gpu" in gpu["mlx"]["device"]
    assert gpu["mlx"]["tflops"] > 1 and gpu["mlx"]["gbps"] > 100, gpu
    print(json.dumps(gpu, indent=1))


@pytest.mark.parametrize("args", [["-n", "1"], ["-n", "2", "--mode", "pipeline"],
                                  ["-n", "2", "--mode", "tensor"]])  # fmt: skip
def test_launch_on_one_gpu_equals_mlx_lm(args):
    p = run_cli("launch", *args, "--max-tokens", 48, PROMPT, timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(default_model_path(), PROMPT, 48)


def test_tensor_mode_over_nccl_equals_mlx_lm():
    if gpu_count() < 2:
        pytest.skip("nccl across GPUs needs two of them")
    p = run_cli("launch", "-n", 2, "--backend", "nccl", "--mode", "tensor", "--max-tokens", 48,
                PROMPT, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(default_model_path(), PROMPT, 48)


def test_bench_runs_beside_mlx_lm(tmp_path):
    out = tmp_path / "bench.json"
    p = run_cli("bench", "--ranks", "1", "--baselines", "mlx-lm", "--prompt-tokens", 512,
                "--gen-tokens", 64, "--repeat", 2, "--json", out, timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["results"]
    assert {r["impl"] for r in rows} == {"mlx-cluster", "mlx-lm"}
    assert all(r["status"] == "ok" for r in rows), rows
    print(p.stdout)
