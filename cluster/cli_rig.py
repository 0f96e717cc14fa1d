"""The commands that get a rig ready: ``sync``, ``install`` and ``hostfile``.

Registered on the ``mlx-cluster`` group by cluster.cli (imported at its end).
"""

from __future__ import annotations

import json
import sys

import click

from .cli import HOST_OPTIONS, cli, resolve_hostfile, with_options
from .hostfile import HostfileError
from .modelcheck import ModelError


def fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


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


@cli.command()
@with_options(*HOST_OPTIONS[:3], "accept_new_host_keys", "model", "mode", "split")
@click.option(
    "--dest",
    metavar="DIR",
    help="Directory on every host that receives the model (as DIR/<model name>); default: "
    "each host's model_dir from the hostfile.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the report as JSON (bytes sent per host)."
)
def sync(hostfile, num_ranks, backend, accept_new_host_keys, model, mode, split, dest, as_json):
    """Copy each host the model files its ranks read, over SFTP.

    Pipeline ranks get the safetensors holding their layers (with the split launch would use:
    --split, else by memory_gb, else even), plus config and tokenizer files; tensor ranks get
    every file. --model is a local directory or a repo already in this machine's Hugging Face
    cache; the hosts need no internet. Files go to <model_dir>/<model name> on each host, where
    `launch`, `chat`, `serve` and `bench` then load them from.

    A file already there with the same size and sha256 is skipped; a partial copy (from an
    interrupted sync, or a truncated file) is resumed; every copy is verified by sha256 before
    it takes its final name. Exits 1 if any host failed, 130 on Ctrl-C (run again to resume).

    \b
    Examples:
      mlx-cluster sync --hostfile rig.yaml --model ~/models/Qwen3-235B-4bit
      mlx-cluster sync --hostfile rig.yaml --model mlx-community/Llama-3.3-70B-4bit --mode tensor
    """
    from .sync import run_sync

    if model is None:
        raise click.UsageError("--model is required: the model directory (or cached repo) to copy")
    try:
        hf = resolve_hostfile(hostfile, num_ranks, backend)
    except HostfileError as e:
        raise click.UsageError(str(e)) from None
    with stderr_progress() as bars:

        def progress(host, total):
            task = bars.add_task(f"{host.label}", total=total)
            return lambda n: bars.advance(task, n)

        try:
            source, results = run_sync(hf, model, mode, split, dest, accept_new_host_keys, progress)
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
            kinds = {}
            for f in r.files:
                kinds[f.action] = kinds.get(f.action, 0) + 1
            counts = ", ".join(f"{n} {a}" for a, n in sorted(kinds.items()))
            click.echo(
                f"{r.host.label}: {len(r.files)} files in {r.dest} ({counts}), "
                f"{fmt_bytes(r.bytes_sent)} sent, all verified"
            )
    if dest and not all(hf.model_dir_of(h) == dest for h in hf.hosts):
        click.echo(
            f"mlx-cluster: ranks load from each host's model_dir; add `model_dir: {dest}` to "
            "the hostfile to run the synced copy",
            err=True,
        )
    sys.exit(1 if any(r.error for r in results) else 0)
