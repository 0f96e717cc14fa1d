"""``doctor``: is every host of a hostfile ready to run a job?"""

from __future__ import annotations

import json
import sys

import click

from ..doctor import diagnose, render
from ..modelcheck import ModelError
from .options import HOST, resolve_hostfile, with_options


@click.command()
@with_options(*HOST, "starting_port", "connections_per_ip", "model", "mode", "split")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(
    hostfile, num_ranks, backend, accept_new_host_keys, starting_port, connections_per_ip,
    model, mode, split, as_json,
):  # fmt: skip
    """Check that every host is ready: SSH, python, versions, ports, RDMA, BLAS, memory.

    One row per host on stdout; every problem named on a line below the table (notes, such as
    a Linux host on the reference BLAS, do not fail). Exits 1 when any host has a problem
    (versions that differ across hosts count), 0 when all are ready. With --model, also checks
    that each host's share of the model fits in its memory (memory_gb from the hostfile, else
    the host's physical memory), split as launch would split it (--split, else memory_gb).
    """
    hf = resolve_hostfile(hostfile, num_ranks, backend)
    try:
        reports = diagnose(
            hf, model, mode, starting_port, accept_new_host_keys, connections_per_ip, split
        )
    except (ModelError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    ok = all(r.ok for r in reports)
    if as_json:
        click.echo(json.dumps({"ok": ok, "hosts": [r.to_json() for r in reports]}, indent=2))
    else:
        click.echo(render(reports), nl=False)
    sys.exit(0 if ok else 1)
