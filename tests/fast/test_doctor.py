"""`mlx-cluster doctor` on loopback: a local host and a host reached over SSH."""

import json
import sys

from tests.support.gpu import fake_nvidia_smi


def test_model_share_follows_launchs_split(tmp_path):
    """doctor's share per rank is split as launch splits: --split, else by memory_gb."""
    from cluster.core.hostfile import parse_hostfile
    from cluster.job.memory import model_shares

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 8,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "vocab_size": 100,
                "intermediate_size": 128,
            }
        )
    )
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)  # 8 layers + 2: 100 bytes each
    even = parse_hostfile({"hosts": ["a", "b"]})
    assert model_shares(str(tmp_path), "pipeline", even) == {0: 600, 1: 600}
    assert model_shares(str(tmp_path), "pipeline", even, [6, 2]) == {0: 800, 1: 400}
    weighted = parse_hostfile(
        {"hosts": [{"ssh": "a", "memory_gb": 48}, {"ssh": "b", "memory_gb": 16}]}
    )
    assert model_shares(str(tmp_path), "pipeline", weighted) == {0: 800, 1: 400}


def test_connections_per_ip_counts_in_the_port_check():
    """With 2 connections per address rank 1 binds the 3rd and 4th ports: a taken 4th one is
    named only then."""
    import socket

    from cluster.job.backends import free_port_run
    from tests.support.processes import invoke

    start = free_port_run("127.0.0.1", 4)  # four free in a row (any port may be busy)
    port = start + 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        p = invoke("doctor", "--starting-port", start)
        assert p.returncode == 0, p.stdout
        p = invoke("doctor", "--starting-port", start, "--connections-per-ip", 2)
    assert p.returncode == 1
    assert f"ring port 127.0.0.1:{port} (Address already in use) is in use" in p.stdout


def test_a_linux_host_on_the_reference_blas_gets_a_note_not_a_failure():
    from cluster.core.hostfile import parse_hostfile
    from cluster.rig.doctor import HostReport, _check_blas, blas_cell

    report = HostReport(parse_hostfile({"hosts": ["a"]}).hosts[0], [0])
    report.probe = {"blas": {"library": None, "gflops": 4.4}}
    _check_blas(report)
    assert report.ok and "libopenblas0-pthread" in report.notes[0]
    assert blas_cell(report.probe["blas"]) == "reference 4 GFLOP/s"
    assert blas_cell({"library": "/x.so", "gflops": 117.2}) == "openblas 117 GFLOP/s"
    assert blas_cell(None) == "-"


def test_gpus_a_hostfile_gives_must_be_there_and_mlx_on_them(tmp_path, monkeypatch):
    """A host that says gpus (or runs nccl) is probed with nvidia-smi; MLX's CPU build there
    is a failure that says how to install the CUDA one, a GPU index that is not there too;
    the ranks' memory is their GPUs'. A ring host with GPUs it does not use gets a note."""
    from cluster.core.hostfile import parse_hostfile
    from cluster.rig.doctor import diagnose, gpu_cell, render

    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path))
    host = {"ssh": "localhost", "python": sys.executable}
    hf = parse_hostfile({"backend": "nccl", "hosts": [dict(host, gpus=[0, 3])]}, "h.yaml")
    (r,) = diagnose(hf)
    gpu = r.probe["gpu"]
    assert gpu["cuda_version"] == "13.0" and [d["index"] for d in gpu["devices"]] == [0, 1]
    assert gpu["devices"][0]["name"] == "NVIDIA H100 80GB HBM3" and not gpu["mlx"]["cuda"]
    problems = [p.message for p in r.problems if p.kind == "gpu"]
    assert any("GPU(s) [3] from the hostfile are not here (nvidia-smi lists [0, 1])" in p
               for p in problems), problems  # fmt: skip
    assert any("MLX does not run on the GPU" in p and "mlx-cuda-13" in p for p in problems)
    assert r._memory() == 81559 * 2**20  # GPU 0's: the one of the two that is there
    assert gpu_cell(gpu) == "2x H100 80GB HBM3, not used by MLX"
    assert "2x H100 80GB HBM3" in render([r]) and "FAIL" in render([r])

    (ring,) = diagnose(parse_hostfile({"hosts": [host]}, "h.yaml"))
    assert not [p for p in ring.problems if p.kind == "gpu"]
    assert any("2 NVIDIA GPU(s) found" in n and "gpus:" in n for n in ring.notes), ring.notes
    assert ring._memory() == ring.probe["memory_bytes"]  # the ranks use the CPU: RAM
    (two,) = diagnose(parse_hostfile({"hosts": [dict(host, slots=2)]}, "h.yaml"))
    assert two.ok and any(
        "ranks 0 and 1 on localhost run on its CPU, though it has GPU 0 "
        "(NVIDIA H100 80GB HBM3, 80 GB)" in n
        for n in two.notes
    ), two.notes


def test_ranks_that_would_share_a_gpu_are_warned_with_the_numbers():
    """Doctor: a host whose ranks have no `gpus:` puts every rank on MLX's default GPU; with
    MLX on CUDA that is a warning with the measured slow-down and what to do instead."""
    from cluster.core.hostfile import parse_hostfile
    from cluster.rig.doctor import HostReport, _check_gpus

    hf = parse_hostfile({"hosts": [{"ssh": "gpubox", "slots": 2}]}, "h.yaml")
    r = HostReport(hf.hosts[0], [0, 1])
    device = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559.0}
    r.probe = {"gpu": {"devices": [device], "mlx": {"cuda": True}}}
    _check_gpus(r, [], "ring")
    (note,) = r.notes
    assert note.startswith("ranks 0 and 1 on gpubox share GPU 0 (NVIDIA H100 80GB HBM3, 80 GB)")
    assert "0.44x" in note and "0.06x" in note and "-n 1" in note and "gpus: [0, 1]" in note
    assert r.ok
