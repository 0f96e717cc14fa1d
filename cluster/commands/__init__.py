"""The ``mlx-cluster`` command: one module per command group, shared options in ``options``."""

from __future__ import annotations

import click

from cluster import __version__
from cluster.commands.bench import bench
from cluster.commands.doctor import doctor
from cluster.commands.rig import hostfile_group, install, sync
from cluster.commands.run import chat, launch, serve
from cluster.commands.status import status


@click.group()
@click.version_option(__version__, prog_name="mlx-cluster")
def cli():
    """Run one language model across several Apple Silicon Macs (or ranks of this machine)."""


for command in (launch, chat, serve, status, bench, doctor, sync, install, hostfile_group):
    cli.add_command(command)


def main():
    cli()
