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
import threading
import time
from collections.abc import Callable
from typing import IO, cast

from cluster.core.hostfile import Host, Hostfile, HostfileError
from cluster.core.spec import JobSpec, LaunchSettings
from cluster.job.launcher import LaunchError, log, run_job
from cluster.job.memory import fits
from cluster.job.signals import Interrupted, drain, restore_signals
from cluster.serve.api.stored import ResponseStore
from cluster.serve.fleet import Fleet, GroupLog, GroupPlan, plan_groups
from cluster.serve.http import Api, raise_open_files
from cluster.serve.metrics import Metrics
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
    """The API up until the user stops it; the ranks (re)started under it, as one group or as
    a fleet of groups (cluster.serve.fleet). The exit code."""
    stderr = stderr or sys.stderr
    settings = spec.serve
    try:
        plans = plan_groups(hostfile, spec, launch, settings.replicas)
    except HostfileError as e:
        log(stderr, f"error: {e}")
        return 2
    if len(plans) == 1:  # a fleet of one: its log lines and /metrics as a lone group's
        services = [Service(plans[0].hostfile, plans[0].spec, stderr)]
        metrics = services[0].metrics
    else:
        fleet_of: list[Fleet] = []
        metrics = Metrics(lambda: [], groups=lambda: fleet_of[0].rank_figures() if fleet_of else [])
        logs = [cast(IO[str], GroupLog(stderr, i)) for i in range(len(plans))]
        services = [Service(p.hostfile, p.spec, logs[i], metrics=metrics, group=i)
                    for i, p in enumerate(plans)]  # fmt: skip
    fleet = Fleet(services, metrics, settings.routing)
    if len(plans) > 1:
        fleet_of.append(fleet)
    try:
        api = Api(
            settings.host,
            settings.port,
            settings.api_key,
            fleet,
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
    fleet.url = f"http://{host}:{port}/v1"
    log(stderr, f"API on {fleet.url} (requests wait until the ranks are ready)")
    try:
        if len(plans) > 1:
            for i, plan in enumerate(plans):
                log(stderr, f"group {i}: {plan.label}")
            log(stderr, f"{len(plans)} groups; requests routed by {settings.routing}")
        return serve_groups(services, plans, started, stderr)
    finally:
        api.stop()


def serve_groups(
    services: list[Service], plans: list[GroupPlan], started: float | None, stderr: IO[str]
) -> int:
    """Every group (one alone too) on a thread of its own; this thread takes the signals: the
    first SIGINT or SIGTERM drains every group (when none has ranks to drain: stops them),
    the next one (or SIGHUP) stops them all."""
    stop = threading.Event()
    wake = threading.Event()  # a signal came: a group in backoff ends its wait
    stopped_by: list[int] = []
    codes: dict[int, int] = {}

    def run(i: int) -> None:
        why = "the server is shutting down"
        try:
            codes[i], why = supervise(services[i], plans[i], started, services[i].stderr, stop,
                                      wake)  # fmt: skip
        except Interrupted as e:
            codes[i] = 128 + e.signum
        finally:
            services[i].close(why)

    def on_signal(signum, frame) -> None:
        wake.set()  # a group waiting for a lost host looks again now
        if not stopped_by and signum in (signal.SIGINT, signal.SIGTERM) and not draining[0]:
            draining[0] = True
            drained = False
            for s in services:
                if s.running is not None and drain(s.running):
                    drained = True
                    continue
                s.draining()
                if s.running is not None:
                    s.running.interrupt(signum)
            if drained:
                return
        stopped_by.append(signum)  # nothing to drain (no ranks ready), or a second signal
        stop.set()
        for s in services:
            if s.running is not None:
                s.running.interrupt(signum)

    draining = [False]
    previous = {sig: signal.signal(sig, on_signal)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}  # fmt: skip
    threads = [threading.Thread(target=run, args=(i,), name=f"group-{i}", daemon=True)
               for i in range(len(services))]  # fmt: skip
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    finally:
        restore_signals(previous)
    if stopped_by:
        log(stderr, f"stopped by {signal.Signals(stopped_by[0]).name}; no ranks are running")
        return 128 + stopped_by[0]
    return next((c for c in codes.values() if c != 0), 0)


def supervise(
    service: Service,
    plan: GroupPlan,
    started: float | None,
    stderr: IO[str],
    stop: threading.Event | None = None,
    wake: threading.Event | None = None,
) -> tuple[int, str]:
    """One group's jobs, restarted after a failure; (exit code, why its requests end).
    ``stop`` (a fleet's): this group runs on a thread of its own, its jobs trap no signal;
    ``wake``: set by any signal (a group waiting for a lost host then looks whether it was
    told to drain or stop)."""
    hostfile, spec, launch = plan.hostfile, plan.spec, plan.launch
    settings = spec.serve
    restarts = Restarts(settings.max_restarts, settings.restart_window_s)
    window = f"{settings.restart_window_s / 60:g} min"
    current = hostfile
    while True:
        if stop is not None and (stop.is_set() or service.draining_now):  # came between jobs
            return 0 if not stop.is_set() else 128 + signal.SIGTERM, "the server is shutting down"
        service.hostfile = current
        try:
            run_job(current, spec, launch, started=started, stderr=stderr, link=service,
                    trap=stop is None)  # fmt: skip
            error = None
            if not service.draining_now:
                error = LaunchError("error: rank 0 ended the job without being asked to")
        except LaunchError as e:
            error = e
        service.running = None  # a signal now finds no job to drain or stop
        service.job_ended(error)
        started = None
        if error is None:
            return 0, "the server is shutting down"
        if error.exit_code >= 128 or not service.served or (stop and stop.is_set()):
            # stopped, or never started: a job that fails before it ever served is a setup
            # problem, not a fault
            if str(error):
                stderr.write(f"{error}\n")
            return error.exit_code, "the server is shutting down"
        if service.draining_now:
            return 0, "the server is shutting down"
        service.metrics.restarts.inc()
        stderr.write(f"{error}\n")
        if not restarts.allow(time.monotonic()):
            log(stderr, f"{len(restarts.times)} failures within {window} (--max-restarts "
                        f"{settings.max_restarts}); giving up. The failures:")  # fmt: skip
            for i, f in enumerate(service.failures, 1):
                at = time.strftime("%H:%M:%S", time.localtime(f.at))
                log(stderr, f"  {i}. {at} {f.message}")
            return 1, "serve gave up after too many failures of the ranks"
        current = next_hosts(hostfile, current, error, spec, launch, stderr, stop, wake,
                             lambda: service.draining_now)  # fmt: skip
        log(stderr, f"restarting the ranks (failure {len(restarts.times)} of at most "
                    f"{settings.max_restarts} within {window})")  # fmt: skip


def next_hosts(
    full: Hostfile,
    current: Hostfile,
    error: LaunchError,
    spec: JobSpec,
    launch: LaunchSettings,
    stderr: IO[str],
    stop: threading.Event | None = None,
    wake: threading.Event | None = None,
    draining: Callable[[], bool] = lambda: False,
) -> Hostfile:
    """The hosts of the next job: without the lost ones when the model fits the rest, else
    with them once they answer again (waiting with backoff). A host left out earlier comes
    back only once it answers (a failure with no host lost is a time to look). A fleet's
    group (``stop``) waiting so ends its wait on a signal: told to stop, Interrupted; told
    to drain (``draining``), the hosts it has (its loop then ends)."""

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
        wait = BACKOFF_S[min(i, len(BACKOFF_S) - 1)]
        if stop is None:
            time.sleep(wait)
            continue
        (wake or stop).wait(wait)
        if stop.is_set():
            raise Interrupted(signal.SIGTERM)
        if draining():
            log(stderr, f"not waiting for {names} any longer: the server is draining")
            return current
    raise AssertionError("unreachable")
