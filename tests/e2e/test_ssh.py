"""Ranks reached over SSH (a real sshd on 127.0.0.1), host keys, and teardown on failures."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import marked_job_dirs, rank_pid, rank_pids, run_cli, start_streaming
from tests.support.reference import reference
from tests.support.sshd import SSHD, keygen

pytestmark = pytest.mark.skipif(not Path(SSHD).exists(), reason="needs openssh-server")

PROMPT = "Tell me about lists"


def hostfile(sshd, tmp_path, hosts, **kw):
    path = tmp_path / "hosts.yaml"
    path.write_text(marked(sshd, sshd.hostfile(hosts, sys.executable, **kw)))
    return path


MARK = "MLX_CLUSTER_TEST_SSHD"  # in each rank's environment: whose sshd started it


def marked(sshd, text: str) -> str:
    """A hostfile whose ranks' environment names this worker's sshd, so that the job
    directories they leave are told from another pytest-xdist worker's (job_dirs)."""
    return f"env: {{{MARK}: '{sshd.port}'}}\n" + text


def over_ssh(sshd, slots):
    return f"  - ssh: 127.0.0.1:{sshd.port}\n    ips: [127.0.0.1]\n    slots: {slots}\n"


LOCAL = "  - ssh: localhost\n"


def job_dirs(sshd) -> set[Path]:
    """The job directories of ranks this worker's sshd started (their env.sh names it)."""
    return marked_job_dirs(MARK, str(sshd.port))


@pytest.fixture(autouse=True)
def no_job_dir_left(sshd):
    """Every job removes the per-job directories it made on the (ssh) hosts."""
    before = job_dirs(sshd)
    yield
    assert job_dirs(sshd) - before == set()


@pytest.mark.parametrize("hosts", ["ssh2", "local+ssh2"])
def test_ranks_over_ssh_match_single_process(sshd, models, tmp_path, hosts):
    layout = over_ssh(sshd, 2) if hosts == "ssh2" else LOCAL + over_ssh(sshd, 2)
    hf = hostfile(sshd, tmp_path, layout)
    for mode in ("pipeline", "tensor"):
        p = run_cli(
            "launch",
            "--hostfile",
            hf,
            "--mode",
            mode,
            "--model",
            models["llama"],
            "--max-tokens",
            40,
            PROMPT,
        )
        assert p.returncode == 0, p.stderr
        assert p.stdout == reference(models["llama"], PROMPT, 40)


def test_unknown_host_key_is_refused_then_accepted_on_request(sshd, models, tmp_path):
    known = tmp_path / "known_hosts"
    hf = hostfile(sshd, tmp_path, over_ssh(sshd, 2), known_hosts=known)
    p = run_cli("launch", "--hostfile", hf, "--model", models["llama"], PROMPT)
    assert p.returncode == 1
    assert f"host 0 (127.0.0.1:{sshd.port}): 127.0.0.1:{sshd.port} is not in {known}" in p.stderr
    assert "--accept-new-host-keys" in p.stderr
    p = run_cli(
        "launch",
        "--hostfile",
        hf,
        "--accept-new-host-keys",
        "--model",
        models["llama"],
        "--max-tokens",
        8,
        PROMPT,
    )
    assert p.returncode == 0, p.stderr
    assert sshd.known_hosts.read_text().split()[2] in known.read_text()


def test_changed_host_key_is_refused(sshd, models, tmp_path):
    keygen(tmp_path / "other")
    other = (tmp_path / "other.pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {other[0]} {other[1]}\n")
    hf = hostfile(sshd, tmp_path, over_ssh(sshd, 2), known_hosts=known)
    p = run_cli(
        "launch", "--hostfile", hf, "--accept-new-host-keys", "--model", models["llama"], PROMPT
    )
    assert p.returncode == 1
    assert "does not match the one in" in p.stderr and "ssh-keygen -R" in p.stderr


def test_wrong_key_file(sshd, models, tmp_path):
    keygen(tmp_path / "stranger")
    text = marked(sshd, sshd.hostfile(over_ssh(sshd, 2), sys.executable)).replace(
        str(sshd.user_key), str(tmp_path / "stranger")
    )
    hf = tmp_path / "h.yaml"
    hf.write_text(text)
    p = run_cli("launch", "--hostfile", hf, "--model", models["llama"], PROMPT)
    assert p.returncode == 1
    assert f"SSH login as root to 127.0.0.1:{sshd.port} failed with key" in p.stderr


def test_unreachable_port(sshd, models, tmp_path):
    from tests.support.sshd import free_port

    port = free_port()
    hf = tmp_path / "h.yaml"
    hf.write_text(marked(sshd, sshd.hostfile(f"  - ssh: 127.0.0.1:{port}\n", sys.executable)))
    started = time.monotonic()
    p = run_cli("launch", "--hostfile", hf, "--model", models["llama"], PROMPT)
    assert p.returncode == 1
    assert f"host 0 (127.0.0.1:{port}): cannot reach 127.0.0.1:{port}" in p.stderr
    assert time.monotonic() - started < 30


def test_kill_9_of_a_remote_rank_ends_the_job(sshd, models, tmp_path):
    hf = hostfile(sshd, tmp_path, LOCAL + over_ssh(sshd, 2))
    proc = start_streaming(
        "--hostfile", hf, "--model", models["endless"], "--max-tokens", 1000000, PROMPT
    )
    victim = rank_pid(2)
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - killed < 10
    assert proc.returncode == 1
    assert f"error: rank 2 of 3 on 127.0.0.1:{sshd.port}" in err.decode()
    assert rank_pids() == []


def test_sigint_with_remote_ranks(sshd, models, tmp_path):
    hf = hostfile(sshd, tmp_path, LOCAL + over_ssh(sshd, 1))
    proc = start_streaming(
        "--hostfile", hf, "--model", models["endless"], "--max-tokens", 1000000, PROMPT
    )
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert rank_pids() == []


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_sigstopped_rank_is_named_after_heartbeat_timeout(sshd, models, tmp_path, where):
    hosts = "  - ssh: localhost\n    slots: 2\n" if where == "local" else LOCAL + over_ssh(sshd, 1)
    hf = hostfile(sshd, tmp_path, hosts)
    proc = start_streaming(
        "--hostfile",
        hf,
        "--heartbeat-timeout",
        3,
        "--model",
        models["endless"],
        "--max-tokens",
        1000000,
        PROMPT,
    )
    victim = rank_pid(1)
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 1
    assert time.monotonic() - stopped < 3 + 15
    assert "error: rank 1 of 2 on" in err and "stopped responding" in err, err
    assert "sent nothing for" in err and "heartbeat timeout 3 s" in err
    assert rank_pids() == []


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_stdin_reaches_rank_0(sshd, models, tmp_path, where):
    """Rank 0 gets our stdin as it is typed (chat needs it). The "python" here echoes exactly
    the bytes we type, less the launcher's keepalives, up to END_OF_INPUT (the launcher keeps
    the pipe open after our EOF and sends END_OF_INPUT, so `cat` would never end); the other
    rank exits."""
    import io

    from cluster.core.hostfile import load_hostfile
    from cluster.core.protocol import END_OF_INPUT, KEEPALIVE
    from cluster.core.spec import JobSpec
    from cluster.job.launcher import run_job

    typed = "first line\nzweite Zeile é\n".encode()
    fake = tmp_path / "python-echoes"
    fake.write_text(
        f"#!{sys.executable}\nimport os, sys\n"
        "if os.environ['MLX_RANK'] != '0':\n    sys.exit(0)\n"
        "got = b''\n"
        f"while not got.endswith({END_OF_INPUT!r}) and (data := os.read(0, 65536)):\n"
        f"    got += data.replace({KEEPALIVE!r}, b'')\n"
        "os.write(1, got)\n"
    )
    fake.chmod(0o755)
    layout = "  - ssh: localhost\n    slots: 2\n" if where == "local" else over_ssh(sshd, 2)
    path = tmp_path / "hosts.yaml"
    path.write_text(marked(sshd, sshd.hostfile(layout, str(fake))))
    read_end, write_end = os.pipe()
    os.write(write_end, typed)
    os.close(write_end)
    out = io.BytesIO()
    with open(read_end, "rb") as stdin:
        run_job(
            load_hostfile(path),
            JobSpec(model=str(models["llama"]), command="chat"),
            stdout=out,
            stderr=io.StringIO(),
            stdin=stdin,
        )
    assert out.getvalue() == typed + END_OF_INPUT  # our EOF, as the launcher says it


def test_dropped_ssh_connection_stops_the_orphaned_ranks(sshd, models, tmp_path):
    """Kill sshd's process for our connection: the remote ranks live on, unseen; the launcher
    reports the drop and stops them over a new connection."""
    hf = hostfile(sshd, tmp_path, LOCAL + over_ssh(sshd, 2))
    proc = start_streaming(
        "--hostfile", hf, "--model", models["endless"], "--max-tokens", 1000000, PROMPT
    )
    sessions = subprocess.run(
        ["pgrep", "-P", str(sshd.proc.pid)], capture_output=True, text=True
    ).stdout.split()
    assert sessions
    dropped = time.monotonic()
    for pid in sessions:
        os.kill(int(pid), signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert time.monotonic() - dropped < 15
    assert "was killed by a signal or lost its SSH connection" in err.decode()
    assert rank_pids() == []


def test_secrets_travel_in_a_private_file_not_argv(sshd, models, tmp_path):
    """HF_TOKEN reaches the remote rank through its 0600 env file; no process has it in argv."""
    fake = tmp_path / "python-shows-env"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "token=$HF_TOKEN"\n'
        'echo "in argv: $(ps -eo args | grep -v grep | grep -c s3cret-token)"\n'
        'spec_dir=$(dirname "$5"); echo "env file: $(stat -c %a "$spec_dir/env.sh")"\n'
    )
    fake.chmod(0o755)
    path = tmp_path / "hosts.yaml"
    path.write_text(marked(sshd, sshd.hostfile(over_ssh(sshd, 1), str(fake))))
    p = run_cli(
        "launch",
        "--verbose",
        "--hostfile",
        path,
        "--model",
        models["llama"],
        PROMPT,
        env={"HF_TOKEN": "s3cret-token"},
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == "token=s3cret-token\nin argv: 0\nenv file: 600\n"
    assert "s3cret" not in p.stderr


def test_start_timeout_names_the_rank(models, tmp_path):
    """A rank that never gets ready (its python hangs before saying anything; a real rank of
    the test model is ready in under a second) is named after the start timeout, and
    stopped."""
    hang = tmp_path / "python-that-hangs"
    hang.write_text("#!/bin/sh\nsleep 120\n")
    hang.chmod(0o755)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"python: {hang}\nhosts:\n  - ssh: localhost\n    ips: [127.0.0.1]\n"
                     "    slots: 2\n")  # fmt: skip
    p = run_cli("launch", "--hostfile", hosts, "--start-timeout", 1, "--model", models["llama"],
                PROMPT)  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert "stopped responding while" in p.stderr
    assert "not ready after the start timeout of 1 s (--start-timeout)" in p.stderr
    assert rank_pids() == []


def test_bench_over_ssh(sshd, models, tmp_path):
    """bench with a hostfile: --ranks N takes its first N ranks; the remote ranks run over
    SSH; the mlx-lm baseline, which runs only here, says so in its row."""

    hf = hostfile(sshd, tmp_path, LOCAL + over_ssh(sshd, 1))
    out = tmp_path / "bench.json"
    p = run_cli(
        "bench", "--hostfile", hf, "--model", models["llama"], "--modes", "pipeline",
        "--ranks", "1,2", "--prompt-tokens", 8, "--gen-tokens", 4, "--repeat", 1,
        "--warmup", 0, "--json", out,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    rows = {(r["impl"], r["ranks"]): r for r in json.loads(out.read_text())["results"]}
    assert rows[("mlx-cluster", 1)]["status"] == "ok"  # the first host: this machine
    assert rows[("mlx-lm", 1)]["status"] == "ok"
    two = rows[("mlx-cluster", 2)]
    assert two["status"] == "ok" and two["same_tokens_as_single"] is True
    assert len(two["peak_memory_gb"]) == 2 and two["collectives_per_token"] == 2
    assert rows[("mlx-lm", 2)]["status"] == "skipped"
    assert "this machine's ranks only" in rows[("mlx-lm", 2)]["reason"]
    assert not rank_pids()
