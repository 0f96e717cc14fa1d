"""`mlx-cluster install`'s refusals over the loopback sshd. The install itself, into fresh
venvs on two hosts that reach the package index only through this machine, then a job from
those venvs, is tested on the rig (test_rig.py)."""


def test_a_gpu_host_gets_mlxs_cuda_build_installed_last():
    """mlx-cluster[cuda], then the CUDA build alone at this machine's MLX version: mlx-cpu and
    mlx-cuda-13 ship the same library file, and the CUDA one must be the one left."""
    from importlib import metadata

    from cluster.core.hostfile import parse_hostfile
    from cluster.rig.install import steps, wants_cuda

    plain = steps("/v/bin/python", "/w/mlx_cluster-1.whl", "python3", False, False)
    cuda = steps("/v/bin/python", "/w/mlx_cluster-1.whl", "python3", False, False, cuda=True)
    assert "/w/mlx_cluster-1.whl[cuda]" in cuda[0] and "[cuda]" not in plain[0]
    assert cuda[1] == plain[1] and len(plain) == 2
    assert cuda[2].endswith(f"--no-deps --force-reinstall mlx-cuda-13=={metadata.version('mlx')}")
    hf = parse_hostfile({"hosts": [{"ssh": "mac"}, {"ssh": "box", "gpus": 2}]}, "h.yaml")
    assert [wants_cuda(hf, h) for h in hf.hosts] == [False, True]
    nccl = parse_hostfile({"backend": "nccl", "hosts": [{"ssh": "box", "ips": ["10.0.0.1"]}]})
    assert wants_cuda(nccl, nccl.hosts[0])
