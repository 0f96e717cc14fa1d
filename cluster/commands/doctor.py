"""``doctor``: is every host of a hostfile ready to run a job, and (--links) every link?"""

from __future__ import annotations

import json
import sys

import click

from cluster.commands.options import HOST, resolve_hostfile, run_or_exit, with_options
from cluster.core.links import link_problems
from cluster.core.modelcheck import ModelError
from cluster.core.spec import JobSpec, LaunchSettings, to_dict
from cluster.rig.doctor import diagnose, render, render_links


@click.command()
@with_options(*HOST, "starting_port", "connections_per_ip", "model", "mode", "split")
@click.option(
    "--links",
    is_flag=True,
    help="Then start one rank per slot and measure every link the backend uses, through "
    "the backend itself: round trip at 4 B and 8 KB, bandwidth at 64 MB, a bit-exact "
    "pattern check, and all_sum over every rank. Names a slow, lossy or corrupting link.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(
    hostfile, num_ranks, backend, accept_new_host_keys, starting_port, connections_per_ip,
    model, mode, split, links, as_json,
):  # fmt: skip
    """Check that every host is ready: SSH, python, versions, ports, RDMA, BLAS, memory.

    One row per host on stdout; every problem named on a line below the table (notes, such as
    a Linux host on the reference BLAS, do not fail). Exits 1 when any host has a problem
    (versions that differ across hosts count), 0 when all are ready. With --model, also checks
    that each host's share of the model fits in its memory (memory_gb from the hostfile, else
    the host's physical memory), split as launch would split it (--split, else memory_gb).
    With --links (once the hosts are ready), a table of the links follows, and a corrupting,
    lossy or slow link fails the check too.
    """
    hf = resolve_hostfile(hostfile, num_ranks, backend)
    try:
        reports = diagnose(
            hf, model, mode, starting_port, accept_new_host_keys, connections_per_ip, split
        )
    except (ModelError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    ok = all(r.ok for r in reports)
    report = None
    if links and ok and hf.world_size > 1:
        launch = LaunchSettings(
            starting_port=starting_port,
            connections_per_ip=connections_per_ip,
            accept_new_host_keys=accept_new_host_keys,
        )
        spec = JobSpec(model="", command="links", world_size=hf.world_size)
        report = run_or_exit(hf, spec, launch).links
    labels = [h.target for h in hf.rank_hosts()]
    if report is not None:
        ok = ok and not link_problems(report, labels)
    if as_json:
        out = {"ok": ok, "hosts": [r.to_json() for r in reports]}
        if report is not None:
            out["links"] = {**to_dict(report), "problems": link_problems(report, labels)}
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(render(reports), nl=False)
        if report is not None:
            click.echo()
            click.echo(render_links(report, labels), nl=False)
        elif links and not all(r.ok for r in reports):
            click.echo("links not measured: the hosts above are not ready", err=True)
        elif links:
            click.echo("links not measured: one rank has no link", err=True)
    sys.exit(0 if ok else 1)
