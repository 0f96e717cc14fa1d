"""`serve` that outlives its ranks: the HTTP API and the Service run in this process, the ranks
run as a job (cluster/job/launcher.py) under them, and a failed job is started again, without a
lost host when the model fits the others, at most ``--max-restarts`` times within
``--restart-window``.
"""

from __future__ import annotations

import dataclasses
import itertools
import signal
import sys
import time
from typing import IO

from cluster.core.hostfile import Host, Hostfile
from cluster.core.spec import JobSpec, LaunchSettings
from cluster.job.launcher import LaunchError, log, run_job
from cluster.job.memory import fits
from cluster.job.signals import Interrupted, restore_signals, trap_signals
from cluster.serve.api.stored import ResponseStore
from cluster.serve.http import Api, raise_open_files
from cluster.serve.service import Service

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # waits for a lost host to answer again


def without_hosts(hostfile: Hostfile, lost: list[int]) -> Hostfile:
    """The hostfile minus the lost hosts (each keeps its index, so logs still name it)."""
    return dataclasses.replace(hostfile, hosts=[h for h in hostfile.hosts if h.index not in lost])


class Restarts:
    """How many failures the window still allows."""

    def __init__(self, most: int, window_s: float):
        self.most, self.window_s = most, window_s
        self.times: list[float] = []

    def allow(self, now: float) -> bool:
        self.times = [t for t in self.times if now - t < self.window_s] + [now]
        return len(self.times) <= self.most


def serve_until_done(
    hostfile: Hostfile,
    spec: JobSpec,
    launch: LaunchSettings,
    started: float | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """The API up until the user stops it; the ranks (re)started under it. The exit code."""
    stderr = stderr or sys.stderr
    settings = spec.serve
    service = Service(hostfile, spec, stderr)
    try:
        api = Api(
            settings.host,
            settings.port,
            settings.api_key,
            service,
            max_body_bytes=int(settings.max_body_mb * (1 << 20)),
            read_timeout=settings.read_timeout,
            max_connections=settings.max_connections,
            allowed_hosts=settings.allowed_hosts,
            cors_origins=settings.cors_origins,
            log=lambda line: log(stderr, line),
            responses=ResponseStore(
                int(settings.responses_store_mb * (1 << 20)),
                settings.responses_store_hours * 3600,
            ),
        )
    except OSError as e:
        log(stderr, f"cannot listen on {settings.host}:{settings.port} ({e.strerror}); "
                    "pass another --port")  # fmt: skip
        return 2
    if warning := raise_open_files(settings.max_connections):
        log(stderr, f"warning: {warning}")
    api.start()
    host, port = api.address
    service.url = f"http://{host}:{port}/v1"
    log(stderr, f"API on {service.url} (requests wait until the ranks are ready)")
    restarts = Restarts(settings.max_restarts, settings.restart_window_s)
    window = f"{settings.restart_window_s / 60:g} min"
    previous = trap_signals()  # between jobs a signal ends serve; a job traps its own
    current = hostfile
    code = 0
    why = "the server is shutting down"
    try:
        while True:
            service.hostfile = current
            try:
                run_job(current, spec, launch, started=started, stderr=stderr, link=service)
                error = None
                if not service.draining_now:
                    error = LaunchError("error: rank 0 ended the job without being asked to")
            except LaunchError as e:
                error = e
            service.job_ended(error)
            started = None
            if error is None:
                return 0
            if error.exit_code >= 128 or not service.served:  # stopped, or never started:
                # a job that fails before it ever served is a setup problem, not a fault
                if str(error):
                    stderr.write(f"{error}\n")
                code = error.exit_code
                return code
            service.metrics.restarts.inc()
            stderr.write(f"{error}\n")
            if not restarts.allow(time.monotonic()):
                code = 1
                why = "serve gave up after too many failures of the ranks"
                log(stderr, f"{len(restarts.times)} failures within {window} (--max-restarts "
                            f"{settings.max_restarts}); giving up. The failures:")  # fmt: skip
                for i, f in enumerate(service.failures, 1):
                    at = time.strftime("%H:%M:%S", time.localtime(f.at))
                    log(stderr, f"  {i}. {at} {f.message}")
                return code
            current = next_hosts(hostfile, current, error, spec, launch, stderr)
            log(stderr, f"restarting the ranks (failure {len(restarts.times)} of at most "
                        f"{settings.max_restarts} within {window})")  # fmt: skip
    except Interrupted as e:
        code = 128 + e.signum
        log(stderr, f"stopped by {signal.Signals(e.signum).name}; no ranks are running")
        return code
    finally:
        restore_signals(previous)
        service.close(why)
        api.stop()


def next_hosts(
    full: Hostfile,
    current: Hostfile,
    error: LaunchError,
    spec: JobSpec,
    launch: LaunchSettings,
    stderr: IO[str],
) -> Hostfile:
    """The hosts of the next job: without the lost ones when the model fits the rest, else
    with them once they answer again (waiting with backoff). A host left out earlier comes
    back only once it answers (a failure with no host lost is a time to look)."""

    def answering(hosts: list[Host]) -> list[Host]:
        from cluster.job.ssh import host_answers  # paramiko: only when a host is probed

        return [h for h in hosts if host_answers(full, h, launch.accept_new_host_keys)]

    def with_hosts(hosts: list[Host]) -> Hostfile:
        keep = {h.index for h in current.hosts} | {h.index for h in hosts}
        return dataclasses.replace(full, hosts=[h for h in full.hosts if h.index in keep])

    if not error.lost_hosts:
        back = answering([h for h in full.hosts if h not in current.hosts])
        if back:
            log(stderr, f"{', '.join(h.label for h in back)} answers again: back in the job")
            return with_hosts(back)
        return current
    lost = [h for h in full.hosts if h.index in error.lost_hosts]
    names = ", ".join(h.label for h in lost)
    rest = without_hosts(current, error.lost_hosts)
    why_not = fits(rest, spec)
    if why_not is None:
        log(stderr, f"leaving out {names}: the model fits on the {len(rest.hosts)} host(s) left")
        return rest
    log(stderr, f"waiting for {names} to answer again (cannot leave it out: {why_not})")
    for i in itertools.count():
        if len(answering(lost)) == len(lost):
            log(stderr, f"{names} answers again")
            return with_hosts(lost)
        time.sleep(BACKOFF_S[min(i, len(BACKOFF_S) - 1)])
    raise AssertionError("unreachable")
