"""The commands that get a rig ready: ``sync``, ``install`` and ``hostfile``."""

from __future__ import annotations

import json
import sys
from collections import Counter

import click

from cluster.commands.options import HOST, HOSTFILE, resolve_hostfile, with_options
from cluster.core.backends import BACKENDS
from cluster.core.hostfile import HostfileError
from cluster.core.modelcheck import ModelError
from cluster.rig.discover import apply_commands, discovered_yaml, gather, read_saved, save_outputs
from cluster.rig.doctor import INSTALL_PROBLEMS, fmt_bytes
from cluster.rig.sync import FAN_OUTS, TRANSPORTS
from cluster.rig.topology import DEFAULT_SUBNETS


def stderr_progress():
    """A rich progress display on stderr: one bar per host, in bytes."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )


@click.command()
@with_options(*HOST, "model", "mode", "split")
@click.option(
    "--dest",
    metavar="DIR",
    help="Directory on every host that receives the model (as DIR/<model name>); default: "
    "each host's model_dir from the hostfile.",
)
@click.option(
    "--transport",
    type=click.Choice(TRANSPORTS),
    default="ssh",
    show_default=True,
    help="How the bytes leave this machine: ssh (OpenSSH's client, encrypted), or tcp (a plain "
    "TCP stream authorised by a one-time token sent over SSH; for a private cable only).",
)
@click.option(
    "--fan-out",
    type=click.Choice(FAN_OUTS),
    default="chain",
    show_default=True,
    help="chain: this machine sends each file once, to the first host, and each host passes it "
    "on to the next over the hostfile's ips (plain TCP with a one-time token); direct: every "
    "host gets its files from this machine.",
)
@click.option(
    "--streams",
    type=click.IntRange(1, 16),
    default=2,
    show_default=True,
    help="Files sent in parallel, each on its own stream (one SSH cipher runs on one core).",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Hash every file again, here and on the hosts, instead of trusting the manifests.",
)
@click.option(
    "--offline",
    is_flag=True,
    help="Never download: a repo not fully in the local Hugging Face cache is an error.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the report as JSON (bytes sent per host)."
)
def sync(
    hostfile,
    num_ranks,
    backend,
    accept_new_host_keys,
    model,
    mode,
    split,
    dest,
    transport,
    fan_out,
    streams,
    verify,
    offline,
    as_json,
):
    """Copy each host the model files its ranks read, each file sent once.

    Pipeline ranks get the safetensors holding their layers (with the split launch would use:
    --split, else by memory_gb, else even), plus config and tokenizer files; tensor ranks get
    every file. --model is a local directory or a Hugging Face repo: from this machine's cache,
    else only the files the ranks need are downloaded here (the hosts need no internet). Files
    go to <model_dir>/<model name> on each host, where `launch`, `chat`, `serve` and `bench`
    then load them from.

    The files travel through OpenSSH's own client (the hostfile's key and known_hosts) to the
    first host, which passes them on to the next over the rig's links (--fan-out chain), so
    this machine sends each byte once however many hosts there are. Bytes are hashed as they
    pass; a copy takes its name only once its sha256 matches the source's. Each host keeps a
    manifest (name, size, mtime, sha256) in the directory: an unchanged file is skipped without
    being read, a file whose size or mtime changed is hashed again, --verify hashes all. A
    partial copy (an interrupted sync, a truncated file) is resumed. Exits 1 if any host failed,
    130 on Ctrl-C (run again to resume).

    \b
    Examples:
      mlx-cluster sync --hostfile rig.yaml --model ~/models/Qwen3-235B-4bit
      mlx-cluster sync --hostfile rig.yaml --model mlx-community/Llama-3.3-70B-4bit --mode tensor
      mlx-cluster sync --hostfile rig.yaml --model ~/models/Kimi-K2 --transport tcp --verify
    """
    from cluster.rig.sync import SyncSettings, run_sync

    if model is None:
        raise click.UsageError("--model is required: the model directory (or repo) to copy")
    hf = resolve_hostfile(hostfile, num_ranks, backend)
    settings = SyncSettings(transport, fan_out, streams, verify, offline)
    with stderr_progress() as bars:

        def progress(host, total):
            task = bars.add_task(f"{host.label}", total=total)
            return lambda n: bars.advance(task, n)

        try:
            source, results = run_sync(
                hf, model, mode, split, dest, accept_new_host_keys, progress, settings
            )
        except (ModelError, ValueError) as e:
            raise click.UsageError(str(e)) from None
        except KeyboardInterrupt:
            click.echo("mlx-cluster: sync interrupted; run it again to resume", err=True)
            sys.exit(130)
    total = sum(r.bytes_sent for r in results)
    if as_json:
        report = {
            "model": str(source),
            "mode": mode,
            "bytes_sent": total,
            "hosts": [r.to_json() for r in results],
        }
        click.echo(json.dumps(report, indent=2))
    else:
        for r in results:
            if r.error:
                click.echo(f"{r.host.label}: FAILED: {r.error}")
                continue
            if r.same_as is not None:
                click.echo(f"{r.host.label}: the same directory as host {r.same_as}, copied there")
                continue
            kinds = Counter(f.action for f in r.files)
            counts = ", ".join(f"{n} {a}" for a, n in sorted(kinds.items()))
            via = f" from host {r.upstream}" if r.upstream is not None else ""
            click.echo(
                f"{r.host.label}: {len(r.files)} files in {r.dest} ({counts}), "
                f"{fmt_bytes(r.bytes_sent)} received over {r.transport}{via}, all verified"
            )
    if dest and not all(hf.model_dir_of(h) == dest for h in hf.hosts):
        click.echo(
            f"mlx-cluster: ranks load from each host's model_dir; add `model_dir: {dest}` to "
            "the hostfile to run the synced copy",
            err=True,
        )
    sys.exit(1 if any(r.error for r in results) else 0)


@click.group("hostfile")
def hostfile_group():
    """Check, convert and discover hostfiles (see docs/hostfile.md)."""


@hostfile_group.command("check")
@click.argument("hf", metavar="PATH", type=HOSTFILE)
def hostfile_check(hf):
    """Validate a hostfile (YAML or mlx.launch JSON) without contacting any host.

    Prints each host with its ranks and what the backend will use; exits 2 with the file,
    host and field named when something is wrong. `mlx-cluster doctor` then checks the hosts
    themselves.
    """
    from cluster.job.backends import rank_envs

    try:
        rank_envs(hf)  # the backend's own checks (rdma devices, addresses)
    except HostfileError as e:
        raise click.UsageError(str(e)) from None
    hosts, ranks = len(hf.hosts), hf.world_size
    click.echo(
        f"{hf.path}: ok: {hosts} host{'s' * (hosts != 1)}, {ranks} rank{'s' * (ranks != 1)}, "
        f"{hf.backend} backend"
    )
    rank = 0
    for h in hf.hosts:
        ranks = ", ".join(str(r) for r in range(rank, rank + h.slots))
        rank += h.slots
        parts = [f"ranks {ranks}" if h.slots > 1 else f"rank {ranks}"]
        if h.ips:
            parts.append(f"ips {', '.join(h.ips)}")
        if h.rdma:
            parts.append("rdma " + ", ".join("-" if d is None else str(d) for d in h.rdma))
        model_dir = hf.model_dir_of(h)
        if model_dir:
            parts.append(f"models in {model_dir}")
        python = h.python or hf.python
        if python:
            parts.append(f"python {python}")
        click.echo(f"  {h.label}: {'; '.join(parts)}")


@hostfile_group.command("convert")
@click.argument("hf", metavar="PATH", type=HOSTFILE)
@click.option(
    "--to",
    "fmt",
    type=click.Choice(["yaml", "json"]),
    help="Output format; default: the other one (YAML in, mlx.launch JSON out, and back).",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write here, not stdout.")
def hostfile_convert(hf, fmt, output):
    """Convert between our YAML hostfile and mlx.launch's JSON one.

    JSON has one entry per rank and no place for slots, memory_gb, python, cwd, model_dir or
    ssh options: a host with slots: N becomes N entries, and each dropped field is named on
    stderr. JSON read back becomes YAML with the same hosts, ips, rdma, backend and env.

    \b
    Examples:
      mlx-cluster hostfile convert rig.yaml -o rig.json && mlx.launch --hostfile rig.json ...
      mlx-cluster hostfile convert rig.json -o rig.yaml
    """
    from cluster.core.hostfile import dump_yaml, mlx_launch_json

    fmt = fmt or ("yaml" if str(hf.path).endswith(".json") else "json")
    if fmt == "json":
        data, dropped = mlx_launch_json(hf)
        text = json.dumps(data, indent=2) + "\n"
        if dropped:
            click.echo(
                "mlx-cluster: mlx.launch's JSON has no place for: " + "; ".join(dropped), err=True
            )
    else:
        text = dump_yaml(hf)
    if output:
        with open(output, "w") as f:
            f.write(text)
    else:
        click.echo(text, nl=False)


@hostfile_group.command("discover")
@click.option("--hosts", metavar="A,B,...", help="The Macs, as ssh targets ([user@]host[:port]).")
@click.option(
    "--hostfile",
    "from_hostfile",
    type=HOSTFILE,
    help="Take the hosts and ssh options from this hostfile instead of --hosts.",
)
@click.option(
    "--backend",
    type=click.Choice([b.name for b in BACKENDS.values() if not b.gpus]),
    help="Default: jaccl when every pair is cabled and RDMA is on everywhere, jaccl-ring when "
    "the cables make a ring and RDMA is on, else ring (TCP over the cables).",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the hostfile here.")
@click.option(
    "--apply", is_flag=True, help="Run each host's network commands there (passwordless sudo)."
)
@click.option(
    "--subnets",
    default=DEFAULT_SUBNETS,
    show_default=True,
    help="Pool the /30 subnets of the cables are taken from.",
)
@click.option(
    "--from",
    "from_dir",
    type=click.Path(file_okay=False, exists=True),
    help="Read the commands' outputs saved in DIR/<host>/ instead of asking the hosts.",
)
@click.option(
    "--save", type=click.Path(file_okay=False), help="Save the outputs read to DIR/<host>/."
)
@with_options("accept_new_host_keys")
def hostfile_discover(
    hosts, from_hostfile, backend, output, apply, subnets, from_dir, save, accept_new_host_keys
):
    """Write a hostfile from the Thunderbolt cables between the Macs.

    Over SSH, reads each host's `system_profiler SPThunderboltDataType -json`, `networksetup
    -listallhardwareports`, `ibv_devices` and en0's address; finds which port leads to which
    Mac (docks, displays and disks on the bus are ignored), picks a JACCL mesh, a JACCL ring or a
    TCP ring, gives every cable a /30 subnet, and writes the hostfile (stdout, or -o FILE). The
    network commands for each host are printed (and written on top of the hostfile); --apply
    runs them. Errors name the host, or the cables that are missing.

    \b
    Examples:
      mlx-cluster hostfile discover --hosts studio-1.local,studio-2.local -o rig.yaml
      mlx-cluster hostfile discover --hosts m1,m2,m3,m4 --backend jaccl --apply -o rig.yaml
    """
    from cluster.core.hostfile import parse_hostfile, split_target
    from cluster.rig.topology import TopologyError, parse_node, plan_rig

    if bool(hosts) == bool(from_hostfile):
        raise click.UsageError("give the Macs with either --hosts A,B,... or --hostfile FILE")
    if from_hostfile:
        hf = from_hostfile
    else:
        names = [h.strip() for h in hosts.split(",")]
        if any(not h for h in names) or len(set(names)) != len(names):
            raise click.UsageError(f"--hosts {hosts}: empty or repeated host names")
        for name in names:
            try:
                split_target(name)
            except ValueError as e:
                raise click.UsageError(f"--hosts: {name}: {e}") from None
        hf = parse_hostfile({"hosts": names}, "--hosts")
    try:
        if from_dir:
            outputs = read_saved(from_dir, [h.target for h in hf.hosts])
        else:
            outputs = gather(hf, accept_new_host_keys)
        if save:
            save_outputs(save, outputs)
        nodes = [parse_node(name, found) for name, found in outputs.items()]
        plan = plan_rig(nodes, backend, subnets)
    except TopologyError as e:
        click.echo(f"mlx-cluster: {e}", err=True)
        sys.exit(1)
    for note in plan.notes:
        click.echo(f"mlx-cluster: {note}", err=True)
    text = discovered_yaml(hf, plan)
    order = ", ".join(nodes[i].name for i in plan.order)
    click.echo(f"mlx-cluster: {plan.backend}, ranks in order {order}", err=True)
    if output:
        with open(output, "w") as f:
            f.write(text)
        for name, commands in plan.commands.items():
            click.echo(f"# {name}")
            for c in commands:
                click.echo(c)
    else:
        click.echo(text, nl=False)
    if apply:
        failures = apply_commands(hf, plan, accept_new_host_keys)
        for failure in failures:
            click.echo(f"mlx-cluster: {failure}", err=True)
        if failures:
            sys.exit(1)
        click.echo("mlx-cluster: network commands applied on every host", err=True)


@click.command()
@with_options(*HOST)
@click.option(
    "--python-base",
    default="python3",
    show_default=True,
    help="The interpreter that makes a host's venv when its hostfile python does not exist.",
)
@click.option(
    "--system-site-packages",
    is_flag=True,
    help="Let a venv that install makes see the base interpreter's packages.",
)
@click.option(
    "--index-via-here",
    is_flag=True,
    help="For hosts with no internet of their own (a Mac on a Thunderbolt cable only): their "
    "pip reaches the package index through this machine, over the install's SSH session "
    "(a proxy that opens only port 443 of pypi.org and files.pythonhosted.org).",
)
def install(
    hostfile,
    num_ranks,
    backend,
    accept_new_host_keys,
    python_base,
    system_site_packages,
    index_via_here,
):
    """Install this checkout of mlx-cluster on every host, then check versions with doctor.

    Builds a wheel here, copies it to each host over SFTP and installs it with the host's
    python (the hostfile's `python:`, per host or for all; else python3). When that python is a
    venv path that does not exist yet (e.g. /Users/me/mlx/bin/python), the venv is made first
    with --python-base. mlx and mlx-lm are pinned to this machine's versions; the hosts fetch
    dependencies from their package index (through this machine with --index-via-here). This
    machine's own python is left alone.

    Exits 1 when a host failed or doctor finds versions that differ.

    \b
    Example:
      mlx-cluster install --hostfile rig.yaml
      mlx-cluster install --hostfile rig.yaml --index-via-here   # hosts with no internet
    """
    from cluster.rig.doctor import diagnose
    from cluster.rig.install import InstallError, run_install

    hf = resolve_hostfile(hostfile, num_ranks, backend)
    click.echo("mlx-cluster: building the wheel and installing it on every host", err=True)
    try:
        results = run_install(
            hf, python_base, system_site_packages, accept_new_host_keys, index_via_here
        )
    except InstallError as e:
        click.echo(f"mlx-cluster: {e}", err=True)
        sys.exit(1)
    failed = False
    for r in results:
        if r.error:
            failed = True
            click.echo(f"{r.host.label}: FAILED: {r.error}")
        else:
            via = ""
            if r.tunnels is not None:
                via = f" (its pip opened {r.tunnels.opened} connection(s) to the index via here)"
            click.echo(f"{r.host.label}: {r.action} for {r.python}{via}")
    reports = diagnose(hf, accept_new=accept_new_host_keys)
    for report in reports:
        versions = (report.probe or {}).get("packages") or {}
        shown = ", ".join(f"{k} {v or 'missing'}" for k, v in versions.items())
        problems = [p.message for p in report.problems if p.kind in INSTALL_PROBLEMS]
        click.echo(f"{report.host.label}: doctor: {shown or 'no probe'}")
        for p in problems:
            failed = True
            click.echo(f"  problem: {p}")
    sys.exit(1 if failed else 0)
