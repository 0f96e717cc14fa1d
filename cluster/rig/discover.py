"""`hostfile discover` over SSH: each host's outputs of the discovery commands (gathered, or
saved and read back), the hostfile written from cluster.rig.topology's plan, and the plan's
network commands run on each host. The logic of the cabling itself is in topology."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cluster.core.hostfile import dump_yaml, parse_hostfile
from cluster.rig.topology import COMMANDS, TopologyError


def gather(hf, accept_new: bool) -> dict[str, dict[str, str | None]]:
    """Each host's outputs of the discovery commands, over SSH (in parallel)."""
    from cluster.job.ssh import SSHError, host_shell

    def one(host):
        outputs: dict[str, str | None] = {}
        try:
            with host_shell(host, hf, accept_new) as shell:
                for key, (command, _) in COMMANDS.items():
                    status, out, err = shell.run(command, timeout=120)
                    if status != 0 and key in ("thunderbolt", "ports"):
                        raise TopologyError(
                            f"{host.label}: `{command}` failed "
                            f"({err.strip() or f'exit {status}'}); discover reads the "
                            "Thunderbolt setup of macOS hosts"
                        )
                    outputs[key] = out if status == 0 else None
        except SSHError as e:
            raise TopologyError(str(e)) from None
        return outputs

    with ThreadPoolExecutor(max_workers=min(8, len(hf.hosts))) as pool:
        return dict(zip([h.target for h in hf.hosts], pool.map(one, hf.hosts), strict=True))


def read_saved(directory: str, names: list[str]) -> dict[str, dict[str, str | None]]:
    """Outputs saved as DIR/<host>/<file> (see COMMANDS); a missing optional one is None."""
    outputs = {}
    for name in names:
        d = Path(directory) / name
        if not d.is_dir():
            raise TopologyError(f"{d}: no saved outputs for host {name}")
        outputs[name] = {
            key: (d / file).read_text() if (d / file).exists() else None
            for key, (_, file) in COMMANDS.items()
        }
    return outputs


def save_outputs(directory: str, outputs: dict[str, dict[str, str | None]]) -> None:
    for name, found in outputs.items():
        d = Path(directory) / name
        d.mkdir(parents=True, exist_ok=True)
        for key, (_, file) in COMMANDS.items():
            if found.get(key) is not None:
                (d / file).write_text(found[key])


def discovered_yaml(hf, plan) -> str:
    """The hostfile, checked by our own parser, with each host's setup commands on top."""
    found = parse_hostfile({"backend": plan.backend, "hosts": plan.hosts}, "<discovered>")
    found.ssh = hf.ssh  # how to reach the hosts stays as it was given
    lines = [
        "# Written by `mlx-cluster hostfile discover`. Each host's Thunderbolt addresses (run",
        "# them there, or pass --apply; macOS forgets them at reboot):",
    ]
    for name, commands in plan.commands.items():
        lines += [f"#   {name}: {c}" for c in commands]
    return "\n".join(lines) + "\n" + dump_yaml(found)


def apply_commands(hf, plan, accept_new: bool) -> list[str]:
    """Run each host's commands with passwordless sudo; the failures, host named."""
    from cluster.job.ssh import SSHError, host_shell

    failures = []
    for host in hf.hosts:
        commands = plan.commands.get(host.target) or []
        if not commands:
            continue
        script = " && ".join(c.replace("sudo ", "sudo -n ", 1) for c in commands)
        try:
            with host_shell(host, hf, accept_new) as shell:
                status, _, err = shell.run(script, timeout=60)
        except SSHError as e:
            failures.append(str(e))
            continue
        if status != 0:
            failures.append(
                f"{host.label}: the network commands failed ({err.strip() or f'exit {status}'}); "
                "--apply needs passwordless sudo there, or run them by hand"
            )
    return failures
