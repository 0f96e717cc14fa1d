"""`serve --replicas R` (or a hostfile's ``groups:``): several groups of ranks, each a whole
copy of the model and a job of its own (its ring, watchdog, restarts: one
cluster.serve.service.Service each), behind one endpoint.

``plan_groups`` cuts the job's hosts (or ``-n``'s local ranks) into groups. ``Fleet`` stands
where one Service stands for the HTTP API (submit, cancel, health, cluster, metrics) and routes
each request:

1. A session (``prompt_cache_key``, ``user``, Anthropic's ``metadata.user_id``) stays on the
   group that served it while that group is ready and has room (fewer requests than its
   ``--decode-concurrency``).
2. Otherwise each ready group's cost is weighed, in prompt tokens: the tokens it would have to
   prefill (the prompt's, less the longest prefix its rank 0 reports cached:
   cluster.core.prefix; characters over the characters per token its rank 0 counted lately)
   plus the work it holds (prompt tokens still to prefill, and
   ``STREAM_TOKENS`` per answer streaming); the cheapest wins, then the one with fewer streams,
   then the first.
3. A group that is starting or restarting is never chosen while another is ready; when none is,
   the request waits on the cheapest (as one Service's requests wait for its ranks).

A group whose ranks fail hands the requests it must decode again, and those waiting for it, to
the ready groups at once (``reroute``); a stream under way ends with an error event, as with
one group. The endpoint answers while one group lives.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import IO

from cluster.core.hostfile import Host, Hostfile, HostfileError, split_weights
from cluster.core.prefix import longest_held, prefix_chain
from cluster.core.protocol import CANCELLED, Handed
from cluster.core.spec import HandoffTicket, JobSpec, LaunchSettings
from cluster.job.launcher import log
from cluster.serve.api.shared import ApiRequest, RequestError
from cluster.serve.metrics import Metrics
from cluster.serve.service import Service

STREAM_TOKENS = 32  # the router's cost of one answer streaming, in prompt tokens to prefill
MOST_SESSIONS = 65536  # sessions remembered (least recently used go first)


@dataclass
class GroupPlan:
    """One group: its hosts (indices kept from the hostfile), its job spec (its own mode) and
    launch settings (its own ports when groups share this machine)."""

    hostfile: Hostfile
    spec: JobSpec
    launch: LaunchSettings

    @property
    def label(self) -> str:
        hosts = ", ".join(h.target for h in self.hostfile.hosts)
        return f"{self.hostfile.world_size} rank(s) on {hosts}, {self.spec.mode}"


def plan_groups(
    hostfile: Hostfile, spec: JobSpec, launch: LaunchSettings, replicas: int
) -> list[GroupPlan]:
    """The groups of a serve: the hostfile's ``groups:``, else ``replicas`` groups of equal
    rank counts (``-n N``: N/R local ranks each; a hostfile: its hosts in order, N/R ranks
    each); one group of everything when ``replicas`` is 1. HostfileError says why not."""
    if hostfile.groups:
        if replicas not in (1, len(hostfile.groups)):
            raise HostfileError(
                f"--replicas {replicas}: the hostfile names {len(hostfile.groups)} groups"
            )
        by_index = {h.index: h for h in hostfile.hosts}
        members = [([by_index[i] for i in g.hosts], g.mode) for g in hostfile.groups]
    elif replicas == 1:
        if spec.serve.prefill_groups:
            raise HostfileError("--prefill-groups needs several groups (--replicas, or the "
                                "hostfile's 'groups:'): one to prefill, one to decode")  # fmt: skip
        return [GroupPlan(hostfile, spec, launch)]
    else:
        members = [(hosts, None) for hosts in split_hosts(hostfile, replicas)]
    prefill = spec.serve.prefill_groups
    if prefill and prefill >= len(members):
        raise HostfileError(f"--prefill-groups {prefill}: of {len(members)} group(s) at least one "
                            "must decode (--replicas)")  # fmt: skip
    roles = group_roles(hostfile, prefill, len(members))
    if any(roles) and spec.kv_quant.kv_bits:
        raise HostfileError("prefill groups cannot hand off a quantized KV cache yet: serve "
                            "without --kv-bits, or without prefill groups")  # fmt: skip
    if all(roles):
        raise HostfileError("every group would only prefill (--prefill-groups, the hostfile's "
                            "'role: prefill'); at least one must decode")  # fmt: skip
    key = secrets.token_hex(32)  # the fleet's: each decode rank's door takes KV from its holders
    plans: list[GroupPlan] = []
    ports = 0
    shared = blas_threads(hostfile, [hosts for hosts, _ in members])
    for hosts, mode in members:
        part = dataclasses.replace(hostfile, hosts=hosts, groups=[], env={**shared, **hostfile.env})
        own = launch
        if launch.starting_port is not None:  # groups on one machine must not share ports
            own = dataclasses.replace(launch, starting_port=launch.starting_port + ports)
            ports += sum(h.slots * max(1, len(h.ips)) for h in hosts) * launch.connections_per_ip
        split = any(roles)
        role = "both" if not split else "prefill" if roles[len(plans)] else "decode"
        handoff = dataclasses.replace(spec.handoff, role=role, key=key if split else "")
        plans.append(GroupPlan(part, dataclasses.replace(spec, mode=mode or spec.mode,
                                                         handoff=handoff), own))  # fmt: skip
    return plans


def group_roles(hostfile: Hostfile, prefill: int, groups: int) -> list[bool]:
    """Whether each group only prefills: the hostfile's ``role:`` where it says one, the first
    ``prefill`` groups (--prefill-groups) otherwise. An explicit role is never overridden: a
    --prefill-groups that contradicts one is refused, naming both."""
    explicit = [g.role for g in hostfile.groups] or [None] * groups
    if prefill:
        for i, role in enumerate(explicit):
            wants = "prefill" if i < prefill else "decode"
            if role is not None and role != wants:
                raise HostfileError(
                    f"--prefill-groups {prefill} makes group {i} {wants}, but "
                    f"{hostfile.path or 'the hostfile'} gives it 'role: {role}'; drop one"
                )
    return [role == "prefill" or (role is None and i < prefill) for i, role in enumerate(explicit)]


def blas_threads(hostfile: Hostfile, groups: list[list[Host]]) -> dict[str, str]:
    """OpenBLAS's threads for ranks on this machine when several groups put ranks here: the
    cores shared by all of them (each job alone would give its own ranks every core), unless
    the user set them."""
    here = sum(h.slots for hosts in groups for h in hosts if h.is_local)
    if here <= max(sum(h.slots for h in hosts if h.is_local) for hosts in groups):
        return {}
    if "OPENBLAS_NUM_THREADS" in os.environ or "OPENBLAS_NUM_THREADS" in hostfile.env:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"OPENBLAS_NUM_THREADS": str(max(1, (cores or 1) // here))}


def split_hosts(hostfile: Hostfile, replicas: int) -> list[list[Host]]:
    """``replicas`` lists of hosts holding equal rank counts, in the hostfile's order."""
    world = hostfile.world_size
    if world % replicas:
        raise HostfileError(
            f"--replicas {replicas}: {world} ranks do not split into {replicas} equal groups"
        )
    each = world // replicas
    if len(hostfile.hosts) == 1 and hostfile.hosts[0].is_local and hostfile.hosts[0].gpus is None:
        one = hostfile.hosts[0]  # -n N: N/R local ranks per group, each its own "host"
        return [[dataclasses.replace(one, index=g, slots=each, ips=list(one.ips))]
                for g in range(replicas)]  # fmt: skip
    groups: list[list[Host]] = [[]]
    count = 0
    for h in hostfile.hosts:
        if count == each:
            groups.append([])
            count = 0
        groups[-1].append(h)
        count += h.slots
        if count > each:
            raise HostfileError(
                f"--replicas {replicas}: {h.label} ({h.slots} slots) would span two groups of "
                f"{each} ranks; name the groups in the hostfile ('groups:')"
            )
    return groups


class GroupLog:
    """A group's stderr: each line says which group it is of ("mlx-cluster: group 1: ...";
    a failure report's lines "[group 1] ...")."""

    def __init__(self, stream: IO[str], group: int):
        self.stream, self.group = stream, group
        self.lock = threading.Lock()
        self.partial = ""

    def write(self, text: str) -> int:
        with self.lock:
            lines = (self.partial + text).split("\n")
            self.partial = lines.pop()
            out = []
            for line in lines:
                if line.startswith(LOG_PREFIX):
                    out.append(f"{LOG_PREFIX}group {self.group}: {line[len(LOG_PREFIX) :]}\n")
                else:
                    out.append(f"[group {self.group}] {line}\n" if line else "\n")
            self.stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


LOG_PREFIX = "mlx-cluster: "


class Fleet:
    """The groups behind one endpoint, as the HTTP API sees one Service; serve always has
    one, of one group without --replicas (``alone``)."""

    def __init__(self, groups: list[Service], metrics: Metrics, routing: str = "prefix"):
        self.groups = groups
        self.metrics = metrics
        self.routing = routing
        first = groups[0]
        self.model_id, self.spec, self.door = first.model_id, first.spec, first.door
        self.lock = threading.Lock()  # the sessions and the round-robin turn
        self.sessions: OrderedDict[str, int] = OrderedDict()  # session -> its group
        self.turn = 0
        for g in groups[1:]:  # a grammar that failed on one group is refused on all
            g.bad_grammars = first.bad_grammars
        for g in groups:
            g.reroute = self.reroute
        # --prefill-groups (issue 53): groups that only prefill, and those that decode
        self.prefillers = [g for g in groups if g.spec.handoff.role == "prefill"]
        self.decoders = [g for g in groups if g.spec.handoff.role != "prefill"]
        self.min_handoff = first.settings.disaggregate_min_tokens
        self.barred: set[tuple[int, int]] = set()  # (prefill, decode) groups that cannot hand off

    @property
    def url(self) -> str:
        return self.groups[0].url

    @url.setter
    def url(self, url: str) -> None:
        for g in self.groups:
            g.url = url

    def refused_grammar(self, request):
        return self.groups[0].refused_grammar(request)

    @property
    def alone(self) -> bool:
        """A fleet of one group (serve without --replicas): no routing, and the group's own
        /health, /v1/cluster and /metrics, as a lone group's."""
        return len(self.groups) == 1

    def submit(self, req: ApiRequest) -> None:
        if self.alone:
            self.groups[0].submit(req)
            return
        g, reason = self.route(req)
        if self.prefillers and req.request.kind != "count":
            self.hand_off(req, self.groups[g])
        self.send(req, g, reason)

    def hand_off(self, req: ApiRequest, decoder: Service) -> None:
        """A long prompt to a ready prefill group (the least loaded), which sends its KV to
        ``decoder``'s ranks; ``decoder`` holds the request until its ranks have it, or
        prefills it itself when the handoff fails."""
        doors = decoder.handoff_doors()
        ready = [g for g in self.prefillers if g.ready and not g.closed and not g.draining_now
                 and (g.group, decoder.group) not in self.barred]  # fmt: skip
        if doors is None or not ready or self.to_prefill(req, decoder) < self.min_handoff:
            return
        prefiller = min(ready, key=lambda g: (g.load.prompt_tokens + g.load.requests, g.group))
        ticket = HandoffTicket(secrets.token_hex(8))
        req.request = dataclasses.replace(req.request, handoff=ticket)
        req.handed = {"handoff_group": prefiller.group}
        plan = dataclasses.replace(ticket, doors=doors, mode=decoder.spec.mode,
                                   world=len(doors), split=decoder.spec.split,
                                   weights=split_weights(decoder.hostfile))  # fmt: skip
        inner = ApiRequest(req.endpoint, dataclasses.replace(req.request, handoff=plan),
                           stream=False, model=req.model)  # fmt: skip
        inner.group = prefiller.group

        def handed(event: Handed) -> None:  # on the prefill group's loop
            if event.error == CANCELLED:  # its client left; the decode group forgot it too
                return
            if event.error is not None and event.lasting:  # the model's cache, not the prompt
                if (prefiller.group, decoder.group) not in self.barred:
                    self.barred.add((prefiller.group, decoder.group))
                    pair = f"group {prefiller.group} cannot hand prompts to group {decoder.group}"
                    log(prefiller.stderr, f"{pair} ({event.error}); group {decoder.group} "
                                          "prefills its prompts itself")  # fmt: skip
            elif event.error is not None:
                log(prefiller.stderr, f"a handoff failed ({event.error}); group "
                                      f"{decoder.group} prefills the prompt itself")  # fmt: skip
            if event.error is not None:
                decoder.post(decoder.write, {"op": "handoff_failed", "ticket": ticket.ticket})
                return
            self.metrics.handoffs.labels(group=str(prefiller.group)).inc()
            self.metrics.handoff_bytes.inc(event.nbytes)

        inner.on_handed = handed
        req.drop_copy = lambda: prefiller.cancel(inner, counted=False)
        self.count_in(inner, prefiller)
        prefiller.submit(inner)

    def send(self, req: ApiRequest, g: int, reason: str) -> None:
        req.group = g
        req.to_prefill = self.to_prefill(req, self.groups[g])
        self.metrics.routed.labels(group=str(g), reason=reason).inc()
        self.groups[g].submit(req)

    def cancel(self, req: ApiRequest) -> None:
        """The client went away: its group drops it, and a prefill group its copy (not yet
        begun: skipped; under way: its ranks stop at the end of the chunk they are on), as
        whenever the request ends (``ApiRequest.let_go``)."""
        self.groups[req.group].cancel(req)

    def route(self, req: ApiRequest, leaving: Service | None = None) -> tuple[int, str]:
        """The group for ``req`` and why (module docstring)."""
        open_ = [g for g in self.decoders if g is not leaving and not g.closed
                 and not g.draining_now]  # fmt: skip
        ready = [g for g in open_ if g.ready] or open_ or [self.decoders[0]]
        with self.lock:
            if req.session is not None:
                g = self.sessions.get(req.session)
                if g is not None and self.groups[g] in ready and self.has_room(self.groups[g]):
                    self.sessions.move_to_end(req.session)
                    self.count_in(req, self.groups[g])
                    return g, "session"
            if not req.chain:
                req.chain = prefix_chain(req.request)
            if self.routing == "round-robin":
                self.turn += 1
                chosen, reason = ready[self.turn % len(ready)], "round_robin"
            else:
                chosen, reason = min(ready, key=lambda g: self.cost(req, g)), "load"
                if self.routing == "prefix" and longest_held(req.chain, chosen.cached):
                    reason = "prefix"
            if req.session is not None:
                self.sessions[req.session] = chosen.group
                self.sessions.move_to_end(req.session)
                while len(self.sessions) > MOST_SESSIONS:
                    self.sessions.popitem(last=False)
            self.count_in(req, chosen)
        return chosen.group, reason

    def count_in(self, req: ApiRequest, g: Service) -> None:
        """The group's load with ``req`` in it now, before its loop takes it: requests that
        arrive together would otherwise all see the same loads and go to one group. (The
        loop measures its load again once it has taken it.)"""
        load, more = g.load, self.to_prefill(req, g)
        g.load = dataclasses.replace(
            load, prompt_tokens=load.prompt_tokens + more, requests=load.requests + 1
        )

    def to_prefill(self, req: ApiRequest, g: Service) -> int:
        """The prompt tokens ``g`` would prefill for ``req``: all but its cached prefix."""
        if not req.chain:
            req.chain = prefix_chain(req.request)
        held = longest_held(req.chain, g.cached) if self.routing == "prefix" else 0
        return int((req.chain[-1].chars - held) / g.chars_per_token)

    def cost(self, req: ApiRequest, g: Service) -> tuple[int, int, int]:
        load = g.load
        tokens = self.to_prefill(req, g) + load.prompt_tokens
        return tokens + STREAM_TOKENS * load.streams, load.streams, g.group

    def has_room(self, g: Service) -> bool:
        return g.load.requests < g.settings.decode_concurrency

    def reroute(self, leaving: Service, reqs: list[ApiRequest]) -> list[ApiRequest]:
        """A group's requests that it cannot answer now, to the ready groups (on the leaving
        group's loop); those no other group can take stay with it."""
        if not any(g.ready and g is not leaving and not g.closed and not g.draining_now
                   for g in self.groups):  # fmt: skip
            return reqs
        for req in reqs:
            if req.is_prefill_copy:  # its decode group is told, and prefills it itself
                leaving.refuse(req, RequestError(503, "its prefill group cannot prefill now",
                                                 "server_error"))  # fmt: skip
                continue
            if req.request.handoff is not None:  # its KV was to go to the leaving group
                req.let_go()
                req.request = dataclasses.replace(req.request, handoff=None)
                req.handed = None
            g, _ = self.route(req, leaving)
            self.send(req, g, "rerouted")
        return []

    # what /health, /v1/cluster and /metrics say: each group, and the fleet

    def health(self) -> dict:
        if self.alone:
            return self.groups[0].health()
        groups = [{"group": g.group, **g.health(), **self.figures(g)} for g in self.groups]
        return {**self.summary(groups), "groups": groups}

    def cluster(self) -> dict:
        from cluster.serve.overview import handoffs, percentiles, rates

        if self.alone:
            return self.groups[0].cluster()
        groups = [{"group": g.group, **g.cluster(), **self.figures(g)} for g in self.groups]
        answers = [a for g in self.groups for a in g.ask(lambda g=g: list(g.answers))]
        now = time.time()
        recent = [a for a in answers if now - a.at <= groups[0]["window_s"]]
        out = {**groups[0], **self.summary(groups)}
        out.pop("group")
        out.update(
            hosts=[{**h, "group": g["group"]} for g in groups for h in g["hosts"]],
            links=None,
            failures=sorted((f for g in groups for f in g["failures"]), key=lambda f: f["at"]),
            rates=rates(recent, now),
            ttft_s=percentiles([a.ttft_s for a in recent if a.ttft_s is not None]),
            handoffs=handoffs(recent),
            answered=len(recent),
            groups=groups,
        )
        return out

    def figures(self, g: Service) -> dict:
        load = g.load
        return {"queued_prompt_tokens": load.prompt_tokens, "streams": load.streams,
                "cached_prefixes": len(g.cached), "answered": g.answered}  # fmt: skip

    def summary(self, groups: list[dict]) -> dict:
        """The fleet's figures: sums of the groups', and its status: ok when every group is,
        degraded while at least one serves, else the first group's (starting, restarting,
        draining)."""
        statuses = [g["status"] for g in groups]
        if all(s == "ok" for s in statuses):
            status = "ok"
        elif "draining" in statuses:
            status = "draining"
        elif any(s in ("ok", "degraded") for s in statuses):
            status = "degraded"
        else:
            status = "restarting" if any(s == "restarting" for s in statuses) else statuses[0]
        keys = ("ranks", "ranks_up", "waiting", "in_flight", "restarts", "hosts",
                "hosts_in_hostfile")  # fmt: skip
        total = {k: sum(g[k] for g in groups if isinstance(g.get(k), int)) for k in keys}
        modes = sorted({g["mode"] for g in groups})
        return {
            "status": status,
            "model": groups[0]["model"],
            "mode": modes[0] if len(modes) == 1 else ",".join(modes),
            **total,
            "groups_ready": sum(1 for s in statuses if s in ("ok", "degraded")),
            "prefilling": [p for g in groups for p in g["prefilling"]],
            "dropped_after_failures": [i for g in groups for i in g["dropped_after_failures"]],
        }

    def rank_figures(self) -> list:
        """/metrics: each group's index, RankStates, readiness and load."""
        return [
            (g.group, list(g.state.ranks) if g.state else [], g.ready, g.load) for g in self.groups
        ]
