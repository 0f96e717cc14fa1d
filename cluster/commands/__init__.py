"""The ``mlx-cluster`` command: one module per command group, shared options in ``options``."""

from __future__ import annotations

import click

from .. import __version__
from .bench import bench
from .doctor import doctor
from .rig import hostfile_group, install, sync
from .run import chat, launch, serve


@click.group()
@click.version_option(__version__, prog_name="mlx-cluster")
def cli():
    """Run one language model across several Apple Silicon Macs (or ranks of this machine)."""


for command in (launch, chat, serve, bench, doctor, sync, install, hostfile_group):
    cli.add_command(command)


def main():
    cli()
