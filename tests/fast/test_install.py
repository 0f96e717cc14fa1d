"""`mlx-cluster install`'s steps. The install itself, into a fresh venv on a host that
reaches the package index only through this machine, then a job from that venv, is tested on
the rig (test_rig.py)."""


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


def test_a_pip_step_that_fails_runs_once_more_without_pip_s_cache():
    """A download cut short reaches pip as a hash mismatch (seen once in CI through
    --index-via-here): install runs that pip command again, fetching afresh, and goes on; a
    step that fails twice, or a step that is not pip, stops the install and is named."""
    from cluster.rig.install import run_steps

    ran: list[str] = []

    def run(failures: dict[str, int]):
        def one(command: str) -> tuple[int, str, str]:
            ran.append(command)
            left = failures.get(command.removesuffix(" --no-cache-dir"), 0)
            failures[command.removesuffix(" --no-cache-dir")] = left - 1
            return (1, "", "THESE PACKAGES DO NOT MATCH THE HASHES") if left > 0 else (0, "", "")

        return one

    venv, pip = "python3 -m venv /v", "/v/bin/python -m pip install -q w.whl"
    assert run_steps(run({pip: 1}), [venv, pip, pip + " x"]) is None
    assert ran == [venv, pip, pip + " --no-cache-dir", pip + " x"]
    ran.clear()
    assert run_steps(run({pip: 2}), [pip, venv]) == (
        pip + " --no-cache-dir",
        "THESE PACKAGES DO NOT MATCH THE HASHES",
    )
    assert ran == [pip, pip + " --no-cache-dir"]  # stops there
    ran.clear()
    assert run_steps(run({venv: 1}), [venv, pip]) == (
        venv,
        "THESE PACKAGES DO NOT MATCH THE HASHES",
    )
    assert ran == [venv]  # not pip: not run again


def test_a_venv_path_gets_the_venv_made_then_its_own_pip():
    """The rig's e2e test installs into a venv under ~ (expanded by the host's $HOME); any
    other venv path takes the same steps: the venv, then its own pip, quoted for the shell."""
    from cluster.rig.install import steps

    made = steps("/opt/my env/bin/python3.12", "/w/m.whl", "python3", True, True, 8123)
    assert made[0] == "python3 -m venv --system-site-packages '/opt/my env'"
    pip = "'/opt/my env/bin/python3.12' -m pip install -q --disable-pip-version-check"
    assert all(c.startswith(pip) and "--proxy http://127.0.0.1:8123" in c for c in made[1:])
    assert steps("/opt/v/bin/python", "/w/m.whl", "python3", False, False)[0].startswith(
        "/opt/v/bin/python -m pip install"
    )  # the venv there already: nothing made
