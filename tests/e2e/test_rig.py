"""Every multi-host path and the faults of a real rig, on separate hosts made of network
namespaces (tests/support/netrig.py): each with its own address, sshd and link, and a ring of
point-to-point cables. Each fault test ends with no rank process on any host."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time

import pytest
import yaml

from cluster.job.launcher import PEER_REPORT_S
from cluster.job.process import STOP_GRACE_S
from cluster.rig.transfer import MANIFEST
from tests.support.netrig import Shape, available, down, up
from tests.support.processes import marked_job_dirs, run_cli, start_streaming
from tests.support.reference import reference

MISSING = available()
if MISSING and os.environ.get("MLX_CLUSTER_REQUIRE_RIG"):  # CI: never a silent skip
    raise RuntimeError(f"MLX_CLUSTER_REQUIRE_RIG is set and {MISSING}")
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]

PROMPT = "Tell me about lists"
TOKENS = 16
HEARTBEAT_S = 5  # --heartbeat-timeout of the fault tests
PREFIX, LAN = "mct", "10.232.0"  # not the addresses and names of a rig made by hand


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    base = tmp_path_factory.mktemp("rig") / "state"
    rig = up(4, cables=True, base=base, prefix=PREFIX, lan=LAN)
    yield rig
    down(base, PREFIX)


def write_hostfile(rig, tmp_path, name="rig.yaml", **kwargs) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(rig.hostfile(**kwargs), sort_keys=False))
    return str(path)


def wait_until_no_ranks(rig, timeout: float) -> float:
    """Seconds until no `python -m node` process is left on any host; fails past timeout."""
    start = time.monotonic()
    while any(rig.rank_pids().values()):
        if time.monotonic() - start > timeout:
            pytest.fail(f"rank processes left on the hosts: {rig.rank_pids()}")
        time.sleep(0.1)
    return time.monotonic() - start


def launch_as_reference(hostfile: str, model, *args) -> subprocess.CompletedProcess:
    """`launch` across the hosts; asserts exit 0 and single-process mlx-lm's text."""
    p = run_cli(
        "launch", "--hostfile", hostfile, "--model", model, "--max-tokens", TOKENS, *args,
        PROMPT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(model, PROMPT, TOKENS)
    return p


@pytest.mark.parametrize("mode,hosts", [("pipeline", 3), ("tensor", 2)])
def test_launch_across_hosts_over_the_lan(rig, models, tmp_path, mode, hosts):
    """Each mode once across hosts (every rank count and family is the matrix's, on one
    host; the ring over 4 hosts' cables is below)."""
    hostfile = write_hostfile(rig, tmp_path, hosts=list(range(1, hosts + 1)), over_cables=False)
    p = launch_as_reference(hostfile, models["llama"], "--mode", mode)
    assert f"starting {hosts} rank(s)" in p.stderr
    assert not any(rig.rank_pids().values())


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_a_ring_over_point_to_point_cables(rig, models, tmp_path, mode):
    """4 hosts, each rank's ips its cable addresses (as `hostfile discover` plans them)."""
    hostfile = write_hostfile(rig, tmp_path, over_cables=True)
    ips = [h["ips"][0] for h in yaml.safe_load(open(hostfile))["hosts"]]
    assert all(a.startswith("10.232.128.") for a in ips), ips
    launch_as_reference(hostfile, models["llama"], "--mode", mode)


def test_lossy_jittery_links_give_the_same_text(rig, models, tmp_path):
    hostfile = write_hostfile(rig, tmp_path, hosts=[1, 2], over_cables=False)
    for i in (1, 2):
        rig.shape(i, Shape(delay_s=0.001, jitter_s=0.002, loss=5))
    try:
        launch_as_reference(hostfile, models["llama"])
    finally:
        for i in (1, 2):
            rig.shape(i, Shape())


def test_chat_across_three_hosts(rig, models, tmp_path):
    from tests.support.reference import TURNS, reference_chat

    hostfile = write_hostfile(rig, tmp_path, hosts=[1, 2, 3], over_cables=False)
    answers, _ = reference_chat(models["qwen2"], TURNS, 12)
    p = run_cli(
        "chat", "--hostfile", hostfile, "--model", models["qwen2"], "--max-tokens", 12,
        input="\n".join(TURNS) + "\n",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout == "".join(a + "\n" for a in answers)
    assert not any(rig.rank_pids().values())


def test_serve_across_hosts_reached_at_this_machines_lan_address(rig, models, tmp_path):
    """The API runs in the launcher's process: --host is an address of this machine (its LAN
    address in the rig), the ranks on two other hosts."""
    from tests.support.serving import Served, ask, chat_reference

    hostfile = write_hostfile(rig, tmp_path, hosts=[1, 2], over_cables=False)
    address = f"{LAN}.254"
    served = Served(models["qwen2"], "--hostfile", hostfile, "--host", address, address=address)
    try:
        r = ask(served.client, model="qwen2")
        assert r.choices[0].message.content == chat_reference(models["qwen2"], 16)
    finally:
        assert served.stop() == 0, "".join(served.log)
    wait_until_no_ranks(rig, 10)


def serve_on_rig(rig, models, tmp_path, hosts, memory_gb=None):
    from tests.support.serving import Served

    data = rig.hostfile(hosts=hosts, over_cables=False)
    for entry in data["hosts"]:
        if memory_gb:
            entry["memory_gb"] = memory_gb
    hostfile = tmp_path / "rig.yaml"
    hostfile.write_text(yaml.safe_dump(data, sort_keys=False))
    args = ("--hostfile", hostfile, "--heartbeat-timeout", str(HEARTBEAT_S))
    return Served(models["qwen2"], *args)


def test_serve_leaves_out_a_lost_host_when_the_model_fits(rig, models, tmp_path):
    """3 hosts with memory_gb, 4 clients in a loop; host 3's link goes down: the ranks
    restart on hosts 1 and 2 (degraded) and no request is refused, hung or wrong."""
    from tests.support.serving import Load, chat_reference, get, wait_for

    served = serve_on_rig(rig, models, tmp_path, [1, 2, 3], memory_gb=8)
    load = Load(served, 4, chat_reference(models["qwen2"], 16), 16, "qwen2")
    try:
        wait_for(lambda: load.ok() >= 4)
        rig.link(3, up=False)
        health = wait_for(lambda: (h := get(served, "/health")[1])["status"] == "degraded" and h)
        assert health["hosts"] == 2 and health["hosts_in_hostfile"] == 3, health
        assert [r["host"] for r in health["rank_states"]] == [f"{LAN}.1", f"{LAN}.2"], health
        assert f"rank 2 of 3 on {LAN}.3" in health["last_failure"]["message"], health
        before = load.ok()
        wait_for(lambda: load.ok() >= before + 4)
        outcomes = load.finish()
    finally:
        load.stop.set()
        rig.link(3, up=True)
        code = served.stop()
    log = "".join(served.log)
    back = re.findall(r"back ([\d.]+) s after the failure", log)
    print(f"outcomes: {dict(outcomes)}; serving again {back} s after the failure was seen")
    assert code == 0, log
    assert f"leaving out host 2 ({LAN}.3): the model fits on the 2 host(s) left" in log, log
    assert set(outcomes) <= {"ok", "ok stream", "cut"}, outcomes
    wait_until_no_ranks(rig, HEARTBEAT_S + 10)  # the cut-off rank ended itself


def test_serve_waits_for_a_lost_host_it_cannot_leave_out(rig, models, tmp_path):
    """No memory_gb: the restart waits for the host; a request sent meanwhile is answered
    once its link is back and the ranks are up again on both hosts."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.serving import ask, chat_reference, get, wait_for

    served = serve_on_rig(rig, models, tmp_path, [1, 2])
    try:
        rig.link(2, up=False)
        wait_for(lambda: any("waiting for host 1" in line for line in served.log), 60)
        status, health, _ = get(served, "/health")
        assert status == 503 and health["status"] == "restarting", health
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(ask, served.client, 8, "qwen2")
            wait_for(lambda: get(served, "/health")[1]["waiting"] == 1)
            rig.link(2, up=True)
            text = answer.result(timeout=120).choices[0].message.content
        assert text == chat_reference(models["qwen2"], 8)
        status, health, _ = get(served, "/health")
        assert status == 200 and health["status"] == "ok" and health["hosts"] == 2, health
    finally:
        rig.link(2, up=True)
        code = served.stop()
    log = "".join(served.log)
    back = re.findall(r"back ([\d.]+) s after the failure", log)
    print(f"serving again {back} s after the failure was seen (the link was down meanwhile)")
    assert code == 0, log
    assert "cannot leave it out: the hostfile gives no memory_gb for host 0" in log, log
    assert f"host 1 ({LAN}.2) answers again" in log, log
    wait_until_no_ranks(rig, HEARTBEAT_S + 10)


def test_bench_across_hosts(rig, models, tmp_path):
    hostfile = write_hostfile(rig, tmp_path, hosts=[1, 2], over_cables=False)
    out = tmp_path / "bench.json"
    p = run_cli(
        "bench", "--hostfile", hostfile, "--model", models["llama"], "--ranks", "2",
        "--prompt-tokens", 16, "--gen-tokens", 8, "--repeat", 1, "--warmup", 0,
        "--baselines", "single", "--json", out,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["results"]
    sharded = [r for r in rows if r.get("ranks") == 2 and r.get("impl") == "mlx-cluster"]
    assert {r["mode"] for r in sharded} == {"pipeline", "tensor"}, rows
    assert all(r["same_tokens_as_single"] for r in sharded), rows
    assert not any(rig.rank_pids().values())


def test_sync_into_each_hosts_own_model_dir_then_launch_from_the_copies(rig, models, tmp_path):
    """3 hosts, each with its own model_dir: each gets its pipeline stage's files, passed on
    from host to host, a second sync sends nothing, and the ranks load the copies."""
    data = rig.hostfile(hosts=[1, 2, 3], over_cables=False)
    for i, entry in enumerate(data["hosts"]):
        entry["model_dir"] = str(tmp_path / f"host{i + 1}")
    hostfile = tmp_path / "rig.yaml"
    hostfile.write_text(yaml.safe_dump(data, sort_keys=False))
    model = models["llama"]
    p = run_cli("sync", "--hostfile", hostfile, "--model", model, "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert [h["host"] for h in report["hosts"]] == [f"{LAN}.{i}" for i in (1, 2, 3)], report
    for i, host in enumerate(report["hosts"]):
        assert host["error"] is None and host["bytes_sent"] > 0, host
        copied = {f.name for f in (tmp_path / f"host{i + 1}" / "llama").iterdir()}
        assert copied - {MANIFEST} == {f["name"] for f in host["files"]}, (copied, host)
        assert MANIFEST in copied
    # the files passed from host to host, each reached at its own address
    chain = [(h["upstream"], h["address"]) for h in report["hosts"]]
    assert chain == [(None, None), (0, f"{LAN}.2"), (1, f"{LAN}.3")], chain
    p = run_cli("sync", "--hostfile", hostfile, "--model", model, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["bytes_sent"] == 0, p.stderr
    launch_as_reference(str(hostfile), model)


def test_install_through_this_machine_then_launch_from_the_venv(rig, models, tmp_path, request):
    """A host with no route to the package index gets a fresh venv under ~ (which the host's
    shell expands) whose pip reaches the index through this machine: the same versions as
    here, this checkout's code; then a job whose rank there runs from that venv, beside a
    rank on another host. (Several hosts install in parallel, an absolute venv path is the
    same steps: tests/fast/test_install.py.)"""
    import hashlib
    import shutil
    import sys
    from importlib.metadata import version
    from pathlib import Path

    home_venv = f".cache/mlx-cluster-test-venv-{tmp_path.name}"
    venv = Path.home() / home_venv
    request.addfinalizer(lambda: shutil.rmtree(venv, ignore_errors=True))
    python = f"~/{home_venv}/bin/python"
    data = rig.hostfile(hosts=[1], over_cables=False)
    data["hosts"][0]["python"] = python
    hostfile = tmp_path / "rig.yaml"
    hostfile.write_text(yaml.safe_dump(data, sort_keys=False))
    base = sys._base_executable  # a python that can make a venv, on every host (one disk)

    p = run_cli(
        "install", "--hostfile", hostfile, "--python-base", base, "--index-via-here",
        timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    said = rf"host 0 \({LAN}.1\): created venv, installed for (\S+) \(its pip opened (\d+)"
    line = re.search(said, p.stdout)
    assert line and line[1] == python, p.stdout
    assert int(line[2]) > 0, p.stdout  # the index was reached, through here
    ours = ", ".join(f"{n} {version(n)}" for n in ("mlx", "mlx-lm", "mlx-cluster"))
    assert p.stdout.count(f"doctor: {ours}") == 1, p.stdout  # the same versions as here
    assert "problem" not in p.stdout
    installed = subprocess.run(
        [venv / "bin" / "python", "-c", "import cluster.rig.install as m; print(m.__file__)"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    path = Path(installed.stdout.strip())
    assert str(path).startswith(str(venv)), installed  # the venv's copy, not this checkout
    here = Path(__file__).parent.parent.parent / "cluster" / "rig" / "install.py"
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(here.read_bytes()).digest()

    both = rig.hostfile(hosts=[1, 2], over_cables=False)  # host 2: this checkout's venv
    both["hosts"][0]["python"] = python
    pair = tmp_path / "pair.yaml"
    pair.write_text(yaml.safe_dump(both, sort_keys=False))
    launch_as_reference(str(pair), models["llama"])
    assert not any(rig.rank_pids().values())

    p = run_cli("install", "--hostfile", hostfile, "--index-via-here", timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr  # again: the venv is there now
    assert p.stdout.count("installed for") == 1 and "created" not in p.stdout, p.stdout


def test_doctor_links_names_the_slow_link(rig, tmp_path):
    """Over the LAN, host 3 five ms away: both of rank 2's links are named slow; every
    transfer and all_sum exact. (At two ms one of them once measured under 3x the best link,
    whose round trip the 3 ranks on this machine's 2 cores had slowed.)"""
    hostfile = write_hostfile(rig, tmp_path, hosts=[1, 2, 3], over_cables=False)
    rig.shape(3, Shape(delay_s=0.0025))
    try:
        p = run_cli("doctor", "--hostfile", hostfile, "--links", "--json")
    finally:
        rig.shape(3, Shape())
    assert p.returncode == 1, p.stdout + p.stderr
    links = json.loads(p.stdout)["links"]
    assert {(x["a"], x["b"]) for x in links["links"]} == {(0, 1), (0, 2), (1, 2)}
    assert all(x["bad_words"] == 0 for x in links["links"]) and links["allsum_bad_words"] == 0
    slow = [x for x in links["problems"] if "round trip" in x and "the best link's" in x]
    assert len(slow) == 2 and all(f"rank 2 ({LAN}.3)" in x for x in slow), links["problems"]
    assert not any(rig.rank_pids().values())


def test_doctor_links_measures_every_cable(rig, tmp_path):
    """4 hosts in a ring of cables: one row per cable, every transfer and all_sum exact.
    Timings are not judged here: the 4 hosts share this machine's 2 cores and a rank waiting
    in a collective spins, so a round trip between 4 ranks measures the scheduler."""
    hostfile = write_hostfile(rig, tmp_path, over_cables=True)
    p = run_cli("doctor", "--hostfile", hostfile, "--links", "--json")
    assert p.returncode in (0, 1), p.stdout + p.stderr
    links = json.loads(p.stdout)["links"]
    assert {(x["a"], x["b"]) for x in links["links"]} == {(0, 1), (1, 2), (2, 3), (0, 3)}
    assert all(x["bad_words"] == 0 and x["gbps"] > 0 for x in links["links"]), links
    assert links["allsum_bad_words"] == 0
    assert (p.returncode == 1) == bool(links["problems"]), links["problems"]
    assert not any("arrived changed" in x or "wrong words" in x for x in links["problems"]), links[
        "problems"
    ]
    assert not any(rig.rank_pids().values())


# Faults. Each: what the launcher says and when it exits, and no rank left on any host.


def test_a_host_whose_link_goes_down(rig, models, tmp_path):
    """The launcher names the host within the heartbeat timeout and exits a few seconds
    later; the rank on the cut-off host ends itself; a new job starts once the link is back."""
    hostfile = write_hostfile(rig, tmp_path, hosts=[1, 2, 3], over_cables=False)
    args = ("--heartbeat-timeout", HEARTBEAT_S, "--model", models["endless"], PROMPT)
    proc = start_streaming("--hostfile", hostfile, *args)
    rig.link(3, up=False)
    cut = time.monotonic()
    try:
        _, err = proc.communicate(timeout=HEARTBEAT_S + 30)
        exited = time.monotonic() - cut
        err = err.decode()
        assert proc.returncode == 1, err
        assert f"rank 2 of 3 on {LAN}.3 stopped responding" in err, err
        assert exited < HEARTBEAT_S + 8, f"{exited:.1f} s after the cut: {err}"
        # the cut-off rank hears nothing from the launcher and ends itself
        wait_until_no_ranks(rig, HEARTBEAT_S + 10)
    finally:
        rig.link(3, up=True)
    launch_as_reference(hostfile, models["llama"])


def test_a_host_that_powers_off(rig, models, tmp_path):
    hostfile = write_hostfile(rig, tmp_path, hosts=[1, 2, 3], over_cables=False)
    proc = start_streaming("--hostfile", hostfile, "--model", models["endless"], PROMPT)
    rig.power_off(2)
    off = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
        err = err.decode()
        assert proc.returncode == 1, err
        assert f"{LAN}.2" in err, err
        assert time.monotonic() - off < 15, err
        wait_until_no_ranks(rig, 10)
    finally:
        rig.power_on(2)


@pytest.mark.parametrize("silent", [False, True], ids=["pulled", "dropping"])
def test_a_cut_cable_between_two_ranks(rig, models, tmp_path, silent):
    """A pulled cable (ports down) or one that drops every frame (ports up). The launcher
    still reaches every host. What the ranks see varies from run to run: the ring fails at
    once ("connection to a peer was lost"), or the ranks wait; a rank waiting with the GIL
    held (mx.clear_cache) cannot beat and is silent on a host that answers, the others beat
    without progress (a stall). Each is reported, naming a rank and its host, within the
    timeouts, and every rank is stopped."""
    hostfile = write_hostfile(rig, tmp_path, over_cables=True)
    args = ("--stall-timeout", HEARTBEAT_S, "--heartbeat-timeout", HEARTBEAT_S)
    proc = start_streaming("--hostfile", hostfile, *args, "--model", models["endless"], PROMPT)
    rig.cable(2, 3, up=False, silent=silent)
    cut = time.monotonic()
    try:
        _, err = proc.communicate(timeout=HEARTBEAT_S + 40)
        err = err.decode()
        assert proc.returncode == 1, err
        first = err.splitlines()[2]
        assert re.match(rf"error: rank \d of 4 on {LAN}\.\d ", first), err
        seen = ("connection to a peer was lost", "its host answers", "no rank made progress")
        assert any(s in err for s in seen), err
        # the launcher's own bounds: the silence or stall (HEARTBEAT_S), a peer's report
        # (PEER_REPORT_S), stopping every rank (2 x STOP_GRACE_S + 1) and their last lines
        # (STOP_GRACE_S); on a loaded 2-core machine the report took 22.4 s once
        bound = HEARTBEAT_S + PEER_REPORT_S + 3 * STOP_GRACE_S + 1
        assert time.monotonic() - cut < bound, err
        wait_until_no_ranks(rig, 10)
    finally:
        rig.cable(2, 3, up=True, silent=silent)


def test_a_killed_launcher_leaves_no_rank(rig, models, tmp_path):
    """SIGKILL of the launcher (a laptop that closes): every rank on every host ends itself,
    its watcher removes the rank's job folder (no launcher is left to), and a later job on
    the same hosts starts cleanly."""
    mark = ("MLX_CLUSTER_TEST_JOB", secrets.token_hex(8))  # tells this job's folders apart
    hostfile = write_hostfile(rig, tmp_path, hosts=[1, 2, 3], over_cables=False,
                              env={mark[0]: mark[1]})  # fmt: skip
    proc = start_streaming("--hostfile", hostfile, "--model", models["endless"], PROMPT)
    assert len(marked_job_dirs(*mark)) == 1  # the job's folder, its 3 ranks' in it
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_until_no_ranks(rig, 10)
    deadline = time.monotonic() + 10  # each watcher removes its rank's once the rank is gone
    while left := marked_job_dirs(*mark):
        assert time.monotonic() < deadline, f"job folders left: {left}"
        time.sleep(0.1)
    launch_as_reference(hostfile, models["llama"])


def test_sshd_killed_after_the_ranks_started(rig, models, tmp_path):
    """The sessions it opened live on: the job finishes and leaves nothing."""
    hostfile = write_hostfile(rig, tmp_path, hosts=[1, 2], over_cables=False)
    args = ("--model", models["llama"], "--max-tokens", 200, PROMPT)
    proc = start_streaming("--hostfile", hostfile, *args)
    rig.kill_sshd(2)
    try:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        wait_until_no_ranks(rig, 10)
    finally:
        rig.power_on(2)
