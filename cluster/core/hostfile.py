"""Hostfiles: which hosts run ranks, how to reach them, and what the collective uses.

Two formats are read: our YAML (see docs/hostfile.md) and the JSON that ``mlx.launch`` takes (a
list of ``{ssh, ips, rdma}`` or ``{backend, envs, hosts}``). Every error names the file, the host
(index and name) and the field, so a typo on the fifth Mac is found without guessing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.core.backends import BACKENDS

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
TOP_KEYS = ("backend", "python", "model_dir", "env", "ssh", "hosts", "groups")
GROUP_KEYS = ("hosts", "mode", "role")
ROLES = ("prefill", "decode")
MODES = ("pipeline", "tensor")
HOST_KEYS = (
    "ssh", "ips", "rdma", "slots", "gpus", "device", "memory_gb", "python", "cwd", "model_dir"
)  # fmt: skip
SSH_KEYS = ("user", "port", "identity_file", "known_hosts")


class HostfileError(ValueError):
    """A hostfile that cannot be used; the message says where and why."""


@dataclass
class SSHOptions:
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    known_hosts: str | None = None


@dataclass
class Host:
    index: int
    target: str  # the ssh target as written
    hostname: str
    user: str | None = None
    port: int | None = None
    ips: list[str] = field(default_factory=list)
    rdma: list[Any] = field(default_factory=list)
    slots: int = 1
    gpus: list[int] | None = None  # the CUDA devices of its ranks, one each (slots = len(gpus))
    device: str | None = None  # "cpu": its ranks compute on the CPU even where MLX has a GPU
    memory_gb: float | None = None
    python: str | None = None
    cwd: str | None = None
    model_dir: str | None = None  # where `sync` puts models on this host, and ranks load them

    @property
    def is_local(self) -> bool:
        """This machine, reached without SSH (an explicit port means: go through sshd)."""
        return self.hostname in LOCAL_NAMES and self.port is None and self.user is None

    @property
    def label(self) -> str:
        return f"host {self.index} ({self.target})"

    @property
    def address(self) -> str:
        """Where the other hosts reach it: its first ``ips`` address (the ring's), else its
        name (a serve's handoff door listens there)."""
        return self.ips[0] if self.ips else self.hostname


@dataclass
class HostGroup:
    """``serve``: hosts that hold one whole copy of the model (a group of ranks; the
    hostfile's ``groups:``), in its own mode if it names one."""

    hosts: list[int]  # host indices, in rank order
    mode: str | None = None
    role: str | None = None  # "prefill": it only prefills, for the decode groups (issue 53)


@dataclass
class Hostfile:
    hosts: list[Host]
    backend: str = "ring"
    python: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    ssh: SSHOptions = field(default_factory=SSHOptions)
    path: str | None = None
    model_dir: str | None = None
    groups: list[HostGroup] = field(default_factory=list)  # serve's groups; none: one

    def model_dir_of(self, host: Host) -> str | None:
        """The directory that holds this host's synced models (its own, else the file's)."""
        return host.model_dir or self.model_dir

    @property
    def world_size(self) -> int:
        return sum(h.slots for h in self.hosts)

    def rank_hosts(self) -> list[Host]:
        """The host of each rank, in rank order (a host with slots=k holds k consecutive ranks)."""
        return [h for h in self.hosts for _ in range(h.slots)]


def local_hostfile(num_ranks: int, backend: str = "ring") -> Hostfile:
    """``-n N`` without a hostfile: N ranks on this machine (the same as hostfiles/local.yaml)."""
    if num_ranks < 1:
        raise HostfileError(f"--num-ranks must be at least 1, got {num_ranks}")
    host = Host(0, "localhost", "localhost", ips=["127.0.0.1"], slots=num_ranks)
    return Hostfile([host], backend=backend, path=None)


def split_target(target: str) -> tuple[str | None, str, int | None]:
    """``user@host:port`` -> (user, host, port); ``[::1]:22`` works for IPv6."""
    user = None
    if "@" in target:
        user, target = target.rsplit("@", 1)
        if not user:
            raise ValueError("empty user before '@'")
    port = None
    if target.startswith("["):
        host, _, rest = target[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"unexpected text after ']': {rest!r}")
            port = _port(rest[1:])
    elif target.count(":") == 1:
        host, p = target.split(":")
        port = _port(p)
    else:
        host = target
    if not host:
        raise ValueError("empty host name")
    return user, host, port


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"port must be a number from 1 to 65535, got {text!r}")
    return int(text)


def load_hostfile(path: str | os.PathLike) -> Hostfile:
    """Read and validate a YAML or mlx.launch JSON hostfile."""
    path = Path(path)
    if not path.exists():
        raise HostfileError(f"{path}: hostfile not found")
    if path.is_dir():
        raise HostfileError(f"{path}: is a directory, not a hostfile")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise HostfileError(
            f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}"
        ) from None
    return parse_hostfile(data, str(path))


def parse_hostfile(data: Any, where: str = "<hostfile>") -> Hostfile:
    """Validate already-parsed YAML/JSON. ``where`` is the file name used in errors."""

    def fail(msg: str) -> HostfileError:
        return HostfileError(f"{where}: {msg}")

    if isinstance(data, list):  # mlx.launch: a bare list of hosts
        data = {"hosts": data}
    if not isinstance(data, dict):
        raise fail("expected a mapping with 'hosts:' (or a list of hosts)")
    if "envs" in data:  # mlx.launch JSON: envs is a list of NAME=value
        envs = data.pop("envs")
        if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
            raise fail("field 'envs' must be a list of 'NAME=value' strings")
        data.setdefault("env", dict(e.split("=", 1) for e in envs))
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise fail(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(TOP_KEYS)}")

    backend = data.get("backend") or "ring"
    if backend not in BACKENDS:
        raise fail(
            f"field 'backend': unknown backend {backend!r}; use one of {', '.join(BACKENDS)}"
        )
    python = _opt_str(data.get("python"), "python", fail)
    env = data.get("env") or {}
    if not isinstance(env, dict):
        raise fail("field 'env' must be a mapping of NAME: value")
    env = {str(k): str(v) for k, v in env.items()}
    ssh = _ssh_options(data.get("ssh") or {}, fail)

    raw_hosts = data.get("hosts")
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise fail("field 'hosts' must be a non-empty list")
    hosts = [_host(i, h, where) for i, h in enumerate(raw_hosts)]
    model_dir = _opt_str(data.get("model_dir"), "model_dir", fail)
    hostfile = Hostfile(hosts, backend, python, env, ssh, where, model_dir)
    _check_rdma(hostfile, where)
    on_cpu = [h for h in hosts if h.device == "cpu"]
    if on_cpu and BACKENDS[backend].collectives_on_gpu:
        raise fail(
            f"host {on_cpu[0].index} ({on_cpu[0].target}) has 'device: cpu', but the {backend} "
            "backend's collectives run only on GPUs; use backend: ring"
        )
    if data.get("groups") is not None:
        hostfile.groups = _groups(data["groups"], hosts, fail)
        if any(h.rdma for h in hosts):
            raise fail(
                "field 'groups': a JACCL hostfile's rdma matrix spans all its hosts; give each "
                "group a hostfile of its own (one serve per group) or use the ring backend"
            )
    return hostfile


def _groups(raw: Any, hosts: list[Host], fail) -> list[HostGroup]:
    """``groups:`` a list of {hosts: [ssh target or index, ...], mode: pipeline|tensor}; every
    host in exactly one group."""
    if not isinstance(raw, list) or not raw:
        raise fail("field 'groups' must be a non-empty list of {hosts: [...], mode: ...}")
    by_name = {h.target: h.index for h in hosts}
    twice = {h.target for h in hosts if sum(o.target == h.target for o in hosts) > 1}
    owner: dict[int, int] = {}
    groups = []
    for g, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise fail(f"group {g}: must be a mapping with 'hosts:' (and optionally 'mode:')")
        unknown = sorted(set(entry) - set(GROUP_KEYS))
        if unknown:
            raise fail(f"group {g}: unknown field(s) {', '.join(unknown)}; known: "
                       f"{', '.join(GROUP_KEYS)}")  # fmt: skip
        names = entry.get("hosts")
        if not isinstance(names, list) or not names:
            raise fail(f"group {g}: field 'hosts' must be a non-empty list of the hosts' ssh "
                       "targets (or their indices)")  # fmt: skip
        members = []
        for name in names:
            if isinstance(name, str) and name in twice:
                same = ", ".join(str(h.index) for h in hosts if h.target == name)
                raise fail(f"group {g}: {name!r} names hosts {same}; name them by index")
            index = name if isinstance(name, int) and not isinstance(name, bool) else None
            index = by_name.get(name) if index is None and isinstance(name, str) else index
            if index is None or not 0 <= index < len(hosts):
                raise fail(f"group {g}: host {name!r} is not in 'hosts' (known: "
                           f"{', '.join(by_name)})")  # fmt: skip
            if index in owner:
                raise fail(f"group {g}: {hosts[index].label} is already in group {owner[index]}")
            owner[index] = g
            members.append(index)
        mode = entry.get("mode")
        if mode is not None and mode not in MODES:
            raise fail(f"group {g}: field 'mode' must be one of {', '.join(MODES)}, got {mode!r}")
        role = entry.get("role")
        if role is not None and role not in ROLES:
            raise fail(f"group {g}: field 'role' must be one of {', '.join(ROLES)}, got {role!r}")
        groups.append(HostGroup(members, mode, role))
    if groups and all(g.role == "prefill" for g in groups):
        raise fail("field 'groups': every group has role prefill; at least one must decode")
    left = [h.label for h in hosts if h.index not in owner]
    if left:
        raise fail(f"field 'groups': {', '.join(left)} in no group (every host serves in one)")
    return groups


def _opt_str(value: Any, name: str, fail) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise fail(f"field '{name}' must be a non-empty string")
    return value


def _ssh_options(raw: Any, fail) -> SSHOptions:
    if not isinstance(raw, dict):
        raise fail("field 'ssh' must be a mapping (user, port, identity_file, known_hosts)")
    unknown = sorted(set(raw) - set(SSH_KEYS))
    if unknown:
        raise fail(
            f"field 'ssh': unknown key(s) {', '.join(unknown)}; known: {', '.join(SSH_KEYS)}"
        )
    port = raw.get("port")
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        raise fail(f"field 'ssh.port' must be a number from 1 to 65535, got {port!r}")
    return SSHOptions(
        user=_opt_str(raw.get("user"), "ssh.user", fail),
        port=port,
        identity_file=_opt_str(raw.get("identity_file"), "ssh.identity_file", fail),
        known_hosts=_opt_str(raw.get("known_hosts"), "ssh.known_hosts", fail),
    )


def _host(index: int, raw: Any, where: str) -> Host:
    if isinstance(raw, str):
        raw = {"ssh": raw}
    name = raw.get("ssh") if isinstance(raw, dict) else None

    def fail(msg: str) -> HostfileError:
        return HostfileError(f"{where}: host {index} ({name or '?'}): {msg}")

    if not isinstance(raw, dict):
        raise fail("must be a mapping with at least 'ssh:'")
    unknown = sorted(set(raw) - set(HOST_KEYS))
    if unknown:
        raise fail(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(HOST_KEYS)}")
    if not isinstance(name, str) or not name:
        raise fail("field 'ssh' (the host to reach) is missing or empty")
    try:
        user, hostname, port = split_target(name)
    except ValueError as e:
        raise fail(f"field 'ssh': {e}") from None

    ips = raw.get("ips") or []
    if isinstance(ips, str):
        ips = [ips]
    if not isinstance(ips, list) or not all(isinstance(ip, str) and ip for ip in ips):
        raise fail("field 'ips' must be a list of addresses")
    if not ips and hostname in LOCAL_NAMES:
        ips = ["127.0.0.1" if hostname != "::1" else "::1"]

    slots = raw.get("slots", 1)
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise fail(f"field 'slots' must be a whole number >= 1, got {slots!r}")
    gpus = _gpus(raw.get("gpus"), fail)
    if gpus is not None:
        if "slots" in raw and slots != len(gpus):
            raise fail(
                f"fields 'slots' ({slots}) and 'gpus' ({len(gpus)} GPUs) disagree: a host with "
                "gpus runs one rank per GPU; give gpus alone"
            )
        slots = len(gpus)
    device = raw.get("device")
    if device not in (None, "cpu", "gpu"):
        raise fail(f"field 'device' must be cpu or gpu (MLX's default), got {device!r}")
    if device == "cpu" and gpus is not None:
        raise fail("fields 'gpus' and 'device: cpu' disagree: a rank on the CPU has no GPU")
    memory_gb = raw.get("memory_gb")
    if memory_gb is not None and (not isinstance(memory_gb, (int, float)) or memory_gb <= 0):
        raise fail(f"field 'memory_gb' must be a positive number, got {memory_gb!r}")
    rdma = raw.get("rdma") or []
    if not isinstance(rdma, list):
        raise fail("field 'rdma' must be a list with one device (or null) per rank")

    return Host(
        index=index,
        target=name,
        hostname=hostname,
        user=user,
        port=port,
        ips=list(ips),
        rdma=rdma,
        slots=slots,
        gpus=gpus,
        device="cpu" if device == "cpu" else None,
        memory_gb=memory_gb,
        python=_opt_str(raw.get("python"), "python", fail),
        cwd=_opt_str(raw.get("cwd"), "cwd", fail),
        model_dir=_opt_str(raw.get("model_dir"), "model_dir", fail),
    )


def _gpus(raw: Any, fail) -> list[int] | None:
    """``gpus: N`` (GPUs 0 to N-1) or ``gpus: [0, 2]`` (those devices): one rank on each."""
    if raw is None:
        return None
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < 1:
            raise fail(f"field 'gpus' must be at least 1 (or a list of GPU indices), got {raw}")
        return list(range(raw))
    ok = isinstance(raw, list) and raw and all(
        isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in raw
    )  # fmt: skip
    if not ok or len(set(raw)) != len(raw):
        raise fail(
            "field 'gpus' must be a number of GPUs or a list of distinct GPU indices "
            f"(as nvidia-smi numbers them), got {raw!r}"
        )
    return list(raw)


def _check_rdma(hostfile: Hostfile, where: str) -> None:
    """The rdma matrix must be N x N; the pair-by-pair checks live with the jaccl backend."""
    if not any(h.rdma for h in hostfile.hosts):
        return
    n = len(hostfile.hosts)
    for h in hostfile.hosts:
        if h.slots != 1:
            raise HostfileError(f"{where}: {h.label}: field 'slots': rdma hosts run one rank each")
        if len(h.rdma) != n:
            raise HostfileError(
                f"{where}: {h.label}: field 'rdma' has {len(h.rdma)} entries; "
                f"it needs one per host ({n}), null for itself"
            )
        for j, dev in enumerate(h.rdma):
            ok = (
                dev is None
                or isinstance(dev, str)
                or (isinstance(dev, list) and all(isinstance(d, str) for d in dev))
            )
            if not ok:
                raise HostfileError(
                    f"{where}: {h.label}: field 'rdma[{j}]' must be a device name, "
                    f"a list of names, or null; got {dev!r}"
                )


def model_name(model: str) -> str:
    """The directory name a model gets under a host's model_dir: a local directory's own name,
    or a Hugging Face repo's name without its owner."""
    return Path(model.rstrip("/")).name


def rank_model_path(hostfile: Hostfile, host: Host, model: str) -> str:
    """Where the ranks on ``host`` load ``model`` from: under its model_dir when it has one."""
    model_dir = hostfile.model_dir_of(host)
    if model_dir is None:
        return model
    return f"{model_dir.rstrip('/')}/{model_name(model)}"


def hostfile_data(hostfile: Hostfile) -> dict[str, Any]:
    """Our YAML form of a hostfile: what it says, without the defaults."""
    data: dict[str, Any] = {"backend": hostfile.backend}
    for key in ("python", "model_dir"):
        if getattr(hostfile, key):
            data[key] = getattr(hostfile, key)
    if hostfile.env:
        data["env"] = dict(hostfile.env)
    ssh = {k: v for k, v in vars(hostfile.ssh).items() if v is not None}
    if ssh:
        data["ssh"] = ssh
    hosts = []
    for h in hostfile.hosts:
        entry: dict[str, Any] = {"ssh": h.target}
        if h.ips:
            entry["ips"] = list(h.ips)
        if h.rdma:
            entry["rdma"] = list(h.rdma)
        if h.gpus is not None:
            entry["gpus"] = list(h.gpus)
        elif h.slots != 1:
            entry["slots"] = h.slots
        for key in ("device", "memory_gb", "python", "cwd", "model_dir"):
            if getattr(h, key) is not None:
                entry[key] = getattr(h, key)
        hosts.append(entry)
    data["hosts"] = hosts
    if hostfile.groups:
        by_index = {h.index: h for h in hostfile.hosts}
        data["groups"] = [
            {
                "hosts": [by_index[i].target for i in g.hosts],
                **({"mode": g.mode} if g.mode else {}),
                **({"role": g.role} if g.role else {}),
            }
            for g in hostfile.groups
        ]
    return data


def dump_yaml(hostfile: Hostfile) -> str:
    return yaml.safe_dump(hostfile_data(hostfile), sort_keys=False, default_flow_style=None)


def mlx_launch_json(hostfile: Hostfile) -> tuple[dict[str, Any], list[str]]:
    """The hostfile as ``mlx.launch --hostfile`` takes it (one entry per rank), and what that
    format cannot say (dropped fields, named for the user)."""
    dropped = [f"{key} (top level)" for key in ("python", "model_dir") if getattr(hostfile, key)]
    if any(v is not None for v in vars(hostfile.ssh).values()):
        dropped.append("ssh (top level: put user/port in ~/.ssh/config for mlx.launch)")
    hosts = []
    for h in hostfile.hosts:
        extra = [key for key in ("memory_gb", "python", "cwd", "model_dir") if getattr(h, key)]
        if extra:
            dropped.append(f"{h.label}: {', '.join(extra)}")
        if h.is_local:
            ssh = "127.0.0.1"  # the one name mlx.launch runs here without SSH
        else:  # mlx.launch hands this to ssh as a host name: no room for a port
            ssh = f"{h.user}@{h.hostname}" if h.user else h.hostname
        if h.port is not None and not h.is_local:
            dropped.append(
                f"{h.label}: port {h.port} (mlx.launch runs `ssh {ssh}`; put it in "
                f"~/.ssh/config: Host {h.hostname} / Port {h.port})"
            )
        if h.gpus is not None and h.gpus != [0]:
            dropped.append(
                f"{h.label}: gpus {h.gpus} (mlx.launch gives each rank of a hostfile "
                "CUDA_VISIBLE_DEVICES=0; use `mlx.launch --hosts IP -n N` for N GPUs of one host)"
            )
        for _ in range(h.slots):  # mlx.launch: one entry per rank
            hosts.append({"ssh": ssh, "ips": list(h.ips), "rdma": list(h.rdma)})
    data = {
        "backend": hostfile.backend,
        "envs": [f"{k}={v}" for k, v in hostfile.env.items()],
        "hosts": hosts,
    }
    return data, dropped


def split_weights(hostfile: Hostfile) -> list[float] | None:
    """Per-rank memory (a host's memory_gb shared by its slots) when every host gives it: the
    weights of a pipeline split (launch, sync and doctor alike)."""
    hosts = hostfile.rank_hosts()
    memory = [h.memory_gb for h in hosts]
    if not all(memory):
        return None
    return [(m or 0) / h.slots for m, h in zip(memory, hosts, strict=True)]
