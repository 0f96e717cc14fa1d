"""Hostfile parsing and validation: every error names the file, the host and the field."""

import json

import pytest

from cluster.core.hostfile import HostfileError, load_hostfile, local_hostfile, split_target
from tests.support.processes import ROOT


def write(tmp_path, text, name="h.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_local_yaml_equals_the_default():
    local = load_hostfile(ROOT / "hostfiles" / "local.yaml")
    default = local_hostfile(2)
    assert local.backend == default.backend == "ring"
    assert [(h.hostname, h.ips, h.slots, h.is_local) for h in local.hosts] == [
        (h.hostname, h.ips, h.slots, h.is_local) for h in default.hosts
    ]
    assert local.world_size == 2


@pytest.mark.parametrize("name", ["local.yaml", "thunderbolt-ring.yaml", "jaccl-mesh.yaml"])
def test_example_hostfiles_parse(name):
    hf = load_hostfile(ROOT / "hostfiles" / name)
    assert hf.world_size >= 2


def test_full_yaml(tmp_path):
    hf = load_hostfile(
        write(
            tmp_path,
            """
backend: jaccl
python: /usr/bin/python3
env: {HF_HUB_OFFLINE: 1}
ssh: {user: me, port: 2222, identity_file: ~/.ssh/id, known_hosts: ~/.ssh/kh}
hosts:
  - ssh: studio-1.local
    ips: [10.0.0.1]
    rdma: [null, rdma_en3]
    memory_gb: 192
    python: /opt/venv/bin/python
  - ssh: bob@studio-2.local:2200
    ips: [10.0.0.2]
    rdma: [[rdma_en3, rdma_en4], null]
""",
        )
    )
    assert hf.backend == "jaccl" and hf.env == {"HF_HUB_OFFLINE": "1"}
    assert hf.ssh.port == 2222 and hf.ssh.user == "me"
    a, b = hf.hosts
    assert (a.hostname, a.user, a.port, a.python, a.memory_gb) == (
        "studio-1.local",
        None,
        None,
        "/opt/venv/bin/python",
        192,
    )
    assert (b.hostname, b.user, b.port, b.rdma) == (
        "studio-2.local",
        "bob",
        2200,
        [["rdma_en3", "rdma_en4"], None],
    )
    assert not a.is_local and not b.is_local


def test_mlx_launch_json_list_and_dict(tmp_path):
    hosts = [
        {"ssh": "m1", "ips": ["10.0.0.1"], "rdma": []},
        {"ssh": "m2", "ips": ["10.0.0.2"], "rdma": []},
    ]
    hf = load_hostfile(write(tmp_path, json.dumps(hosts), "a.json"))
    assert [h.hostname for h in hf.hosts] == ["m1", "m2"] and hf.backend == "ring"
    hf = load_hostfile(
        write(
            tmp_path,
            json.dumps({"backend": "jaccl-ring", "envs": ["A=1", "B=x=y"], "hosts": hosts}),
            "b.json",
        )
    )
    assert hf.backend == "jaccl-ring" and hf.env == {"A": "1", "B": "x=y"}


def test_localhost_is_local_only_without_port():
    assert split_target("me@[::1]:22") == ("me", "::1", 22)
    assert split_target("studio.local") == (None, "studio.local", None)
    hf = local_hostfile(3)
    assert hf.hosts[0].is_local and hf.world_size == 3


@pytest.mark.parametrize(
    "text, message",
    [
        ("hosts: []", "h.yaml: field 'hosts' must be a non-empty list"),
        ("hostz: [a]", "h.yaml: unknown field(s) hostz"),
        ("backend: mpi\nhosts: [a]", "h.yaml: field 'backend': unknown backend 'mpi'"),
        (
            "hosts:\n  - ips: [1.2.3.4]",
            "h.yaml: host 0 (?): field 'ssh' (the host to reach) is missing",
        ),
        ("hosts:\n  - a\n  - ssh: b:99999", "h.yaml: host 1 (b:99999): field 'ssh': port must be"),
        (
            "hosts:\n  - ssh: a\n    slots: 0",
            "h.yaml: host 0 (a): field 'slots' must be a whole number",
        ),
        ("hosts:\n  - ssh: a\n    memroy_gb: 3", "h.yaml: host 0 (a): unknown field(s) memroy_gb"),
        ("hosts:\n  - ssh: a\n    ips: 3", "h.yaml: host 0 (a): field 'ips' must be a list"),
        ("ssh: {prot: 22}\nhosts: [a]", "h.yaml: field 'ssh': unknown key(s) prot"),
        (
            "hosts:\n  - {ssh: a, rdma: [null, x]}\n  - {ssh: b, rdma: [x]}",
            "h.yaml: host 1 (b): field 'rdma' has 1 entries; it needs one per host (2)",
        ),
        (
            "hosts:\n  - {ssh: a, rdma: [null, 3]}\n  - {ssh: b, rdma: [x, null]}",
            "h.yaml: host 0 (a): field 'rdma[1]' must be a device name",
        ),
        ("- [not, a, mapping]", "h.yaml: host 0 (?): must be a mapping"),
        ("hosts:\n  - {ssh: a, device: tpu}", "h.yaml: host 0 (a): field 'device' must be cpu or"),
        ("hosts:\n  - {ssh: a, device: cpu, gpus: 1}", "fields 'gpus' and 'device: cpu' disagree"),
        (
            "backend: nccl\nhosts:\n  - {ssh: a, device: cpu}",
            "h.yaml: host 0 (a) has 'device: cpu', but the nccl backend's collectives run only",
        ),
    ],
)
def test_errors_name_file_host_and_field(tmp_path, text, message):
    with pytest.raises(HostfileError) as e:
        load_hostfile(write(tmp_path, text))
    assert message in str(e.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(HostfileError, match="hostfile not found"):
        load_hostfile(tmp_path / "none.yaml")
    with pytest.raises(HostfileError, match="not valid JSON"):
        load_hostfile(write(tmp_path, "{", "x.json"))
    with pytest.raises(HostfileError, match="is a directory"):
        load_hostfile(tmp_path)


def test_a_cpu_host_reaches_its_ranks_spec_and_the_yaml_form():
    """``device: cpu`` goes to each of that host's ranks (node.rank.gpu.use_device) and survives
    the YAML form (serve's groups are written that way)."""
    from cluster.core.hostfile import hostfile_data, parse_hostfile
    from cluster.core.spec import JobSpec, LaunchSettings
    from cluster.job.launcher import rank_launches

    raw = {"hosts": [{"ssh": "127.0.0.1", "gpus": [0]}, {"ssh": "localhost", "device": "cpu"}]}
    hostfile = parse_hostfile(raw)
    assert [h.device for h in hostfile.hosts] == [None, "cpu"]
    assert hostfile_data(hostfile)["hosts"][1]["device"] == "cpu"
    launches = rank_launches(hostfile, JobSpec(model=""), LaunchSettings())
    specs = [JobSpec.from_json(x.spec) for x in launches]
    assert [s.device for s in specs] == ["", "cpu"]
    assert [x.env.get("CUDA_VISIBLE_DEVICES") for x in launches] == ["0", None]


def test_node_imports_no_mlx_before_the_rank_picks_its_device():
    """mlx-lm makes its generation stream on the default device when it is imported:
    ``device: cpu`` (node.rank.gpu.use_device) must come first, so node's entry point may
    not import MLX at its top."""
    import subprocess
    import sys

    code = "import sys, node.__main__; print(sorted(m for m in sys.modules if m.startswith('mlx')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
