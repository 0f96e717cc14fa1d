"""Ranks on other hosts, over SSH with paramiko, behind the same interface as LocalRank.

Host keys are verified against known_hosts; an unknown key is refused unless the user passes
--accept-new-host-keys (OpenSSH's accept-new), a changed key always. A rank's files (job spec,
ring hostfile or IBV matrix, environment) are written over SFTP into a per-job directory only
the user can read, so no secret appears in argv or logs. The remote shell ``exec``s python,
which then leads its own process group: teardown signals that group over a fresh channel
instead of trusting the channel's close.
"""

from __future__ import annotations

import os
import posixpath
import queue
import secrets
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko

from cluster.core.hostfile import Host, Hostfile
from cluster.job.process import STOP_GRACE_S, RankLaunch, node_command, pump_lines, shell_command

CONNECT_TIMEOUT_S = 10.0
SIGNAL_TIMEOUT_S = 3.0  # for a host to answer a kill over an open connection; past it: lost
FORWARDED_SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


class SSHError(RuntimeError):
    """Could not reach or log into a host; the message names it and says what to do."""


@dataclass
class SSHTarget:
    hostname: str
    port: int
    user: str | None
    identity_file: str | None
    known_hosts: str


def ssh_target(host: Host, hostfile: Hostfile) -> SSHTarget:
    """Host entry, then the hostfile's ssh block, then ~/.ssh/config, then OpenSSH defaults."""
    config: dict[str, Any] = {}
    config_path = Path("~/.ssh/config").expanduser()
    if config_path.exists():
        config = paramiko.SSHConfig.from_path(str(config_path)).lookup(host.hostname)
    identity = hostfile.ssh.identity_file or (config.get("identityfile") or [None])[0]
    return SSHTarget(
        hostname=config.get("hostname", host.hostname),
        port=host.port or hostfile.ssh.port or int(config.get("port", 22)),
        user=host.user or hostfile.ssh.user or config.get("user"),
        identity_file=str(Path(identity).expanduser()) if identity else None,
        known_hosts=str(Path(hostfile.ssh.known_hosts or "~/.ssh/known_hosts").expanduser()),
    )


# AES-GCM first: the Macs' (and most x86's) AES instructions make it the fastest cipher
CIPHERS = "aes128-gcm@openssh.com,chacha20-poly1305@openssh.com,aes128-ctr"


def openssh_argv(
    host: Host, hostfile: Hostfile, command: str, accept_new: bool = False
) -> list[str]:
    """OpenSSH's own client for a bulk stream, with the hostfile's key, user, port and
    known_hosts, never asking anything; connect() then explains a failure."""
    target = ssh_target(host, hostfile)
    argv = ["ssh", "-T", "-x", "-p", str(target.port), "-c", CIPHERS]
    for option in (
        "BatchMode=yes",
        f"StrictHostKeyChecking={'accept-new' if accept_new else 'yes'}",
        f"UserKnownHostsFile={target.known_hosts}",
        "Compression=no",
        "ServerAliveInterval=15",
        "ServerAliveCountMax=4",
    ):
        argv += ["-o", option]
    if target.identity_file:
        argv += ["-i", target.identity_file]
    if target.user:
        argv += ["-l", target.user]
    return [*argv, target.hostname, command]


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """OpenSSH's accept-new: trust an unknown host's key and append it to known_hosts (the
    rest of the file is left exactly as it was); a changed key is still refused by paramiko."""

    def __init__(self, known_hosts: Path):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.known_hosts, "a") as f:
            if f.tell() == 0:  # a new file: private, like OpenSSH makes it
                os.fchmod(f.fileno(), 0o600)
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


def connect(host: Host, hostfile: Hostfile, accept_new: bool = False) -> paramiko.SSHClient:
    target = ssh_target(host, hostfile)
    where = f"{host.label}"
    client = paramiko.SSHClient()
    known = Path(target.known_hosts)
    if known.exists():
        client.load_host_keys(str(known))
    if accept_new:
        client.set_missing_host_key_policy(AcceptNewPolicy(known))
    else:
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(
            target.hostname,
            port=target.port,
            username=target.user,
            key_filename=target.identity_file,
            timeout=CONNECT_TIMEOUT_S,
            banner_timeout=CONNECT_TIMEOUT_S,
            auth_timeout=CONNECT_TIMEOUT_S,
        )
    except paramiko.BadHostKeyException as e:
        raise SSHError(
            f"{where}: the host key of {target.hostname}:{target.port} does not match the one "
            f"in {known} (got {e.key.get_name()} {e.key.get_fingerprint().hex()}); if the host "
            f"was reinstalled, remove the old entry with `ssh-keygen -R "
            f"'[{target.hostname}]:{target.port}' -f {known}` and connect again"
        ) from None
    except paramiko.AuthenticationException as e:
        key = f" with key {target.identity_file}" if target.identity_file else ""
        raise SSHError(
            f"{where}: SSH login as {target.user or 'the current user'} to "
            f"{target.hostname}:{target.port} failed{key} ({e}); check ssh.identity_file and "
            "that the public key is in the host's ~/.ssh/authorized_keys"
        ) from None
    except paramiko.SSHException as e:
        if "not found in known_hosts" in str(e):
            raise SSHError(
                f"{where}: {target.hostname}:{target.port} is not in {known}, so its identity "
                "cannot be verified; check the key (e.g. `ssh-keyscan`) and add it, or pass "
                "--accept-new-host-keys to trust it on first use"
            ) from None
        if "private key file" in str(e) or "not a valid" in str(e):
            raise SSHError(f"{where}: cannot use key {target.identity_file}: {e}") from None
        raise SSHError(f"{where}: SSH to {target.hostname}:{target.port} failed: {e}") from None
    except (TimeoutError, OSError) as e:
        raise SSHError(
            f"{where}: cannot reach {target.hostname}:{target.port} ({e}); is the host up, "
            "Remote Login (sshd) enabled and the port right?"
        ) from None
    return client


def run(client: paramiko.SSHClient, command: str, timeout: float = 30.0) -> tuple[int, str, str]:
    """Run a short command; (exit status, stdout, stderr). TimeoutError when the host does
    not answer within ``timeout`` (a cut link leaves the connection open but silent)."""
    _, out, err = client.exec_command(command, timeout=timeout)
    if not out.channel.status_event.wait(timeout):
        out.channel.close()
        raise TimeoutError(f"{command!r} got no answer within {timeout:g} s")
    status = out.channel.recv_exit_status()
    return status, out.read().decode(), err.read().decode()


def answers(run_command) -> bool:
    """Whether a host runs a trivial command (``run_command(command, timeout)``, as ``run``
    and ``Shell.run`` take it) within SIGNAL_TIMEOUT_S: the one probe of a host's life."""
    try:
        return run_command("true", timeout=SIGNAL_TIMEOUT_S)[0] == 0
    except (paramiko.SSHException, SSHError, TimeoutError, OSError, EOFError):
        return False


def host_answers(hostfile: Hostfile, host: Host, accept_new: bool) -> bool:
    """Whether ``host`` answers over a fresh connection (serve: a host left out of the job)."""
    try:
        with host_shell(host, hostfile, accept_new) as shell:
            return answers(shell.run)
    except (SSHError, TimeoutError, OSError, EOFError):
        return False


class Shell:
    """Short shell commands and file copies on one host: this machine directly, any other
    over one SSH connection (``host_shell`` opens and closes it)."""

    def __init__(self, client: paramiko.SSHClient | None):
        self.client = client

    def run(self, command: str, timeout: float = 30.0) -> tuple[int, str, str]:
        if self.client is not None:
            return run(self.client, command, timeout)
        p = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr

    def put(self, local: Path, remote: str) -> None:
        """Copy ``local`` to ``remote`` whole or not at all: under a name of its own, then
        renamed, so two hosts that share a disk (and a home) never write into one file."""
        part = f"{remote}.{secrets.token_hex(4)}.part"
        if self.client is None:
            shutil.copyfile(local, part)
            os.replace(part, remote)
            return
        sftp = self.client.open_sftp()
        try:
            sftp.put(str(local), part)
            sftp.posix_rename(part, remote)
        finally:
            sftp.close()


@contextmanager
def host_shell(host: Host, hostfile: Hostfile, accept_new: bool = False) -> Iterator[Shell]:
    if host.is_local:
        yield Shell(None)
        return
    client = connect(host, hostfile, accept_new)
    try:
        yield Shell(client)
    finally:
        client.close()


def env_script(env: dict[str, str]) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


class RemoteRank:
    """A rank on another host, started over an SSH channel (no pty: tokens are not held back)."""

    def __init__(
        self,
        launch: RankLaunch,
        client: paramiko.SSHClient,
        job_id: str,
        reconnect: Callable[[], paramiko.SSHClient] | None = None,
    ):
        self.reconnect = reconnect
        self._exited = False  # an exit status came back: the process is surely gone
        self.lost = False  # its host did not answer within SIGNAL_TIMEOUT_S: let go
        self.launch = launch
        self.rank = launch.rank
        self.host = launch.host
        self.client = client
        self.job_id = job_id
        self.dir: str | None = None
        self.channel: paramiko.Channel | None = None
        self.exit_code: int | None = None
        self._done = threading.Event()

    def start(self, events: queue.Queue) -> None:
        try:
            self._start(events)
        except Exception:
            self.exit_code = 255  # never ran: nothing to wait for or to signal
            self._done.set()
            raise

    def _start(self, events: queue.Queue) -> None:
        status, home, err = run(self.client, 'printf %s "$HOME"')
        if status != 0:
            raise SSHError(f"{self.host.label}: cannot run commands: {err.strip()}")
        self.dir = f"{home}/.cache/mlx-cluster/jobs/{self.job_id}/rank{self.rank}"
        status, _, err = run(self.client, f"mkdir -p -m 700 {shlex.quote(self.dir)}")
        if status != 0:
            raise SSHError(f"{self.host.label}: cannot create {self.dir}: {err.strip()}")
        env = dict(self.launch.extra_env)
        env.update({k: os.environ[k] for k in FORWARDED_SECRETS if k in os.environ})
        env.update(self.launch.env)
        env["PYTHONUNBUFFERED"] = "1"
        try:
            sftp = self.client.open_sftp()
        except paramiko.SSHException as e:
            raise SSHError(
                f"{self.host.label}: cannot open SFTP to write the rank's files ({e}); enable "
                "the sftp subsystem in the host's sshd_config"
            ) from None
        try:
            for var, text in self.launch.files.items():
                path = f"{self.dir}/{var.lower()}.json"
                self._write(sftp, path, text)
                env[var] = path
            self._write(sftp, f"{self.dir}/env.sh", env_script(env))
            self._write(sftp, f"{self.dir}/job.json", self.launch.spec)
        finally:
            sftp.close()
        assert self.dir is not None  # made above
        d = shlex.quote(self.dir)
        cwd = shlex.quote(self.launch.cwd) if self.launch.cwd else d
        command = shell_command(node_command(self.launch.python, f"{self.dir}/job.json"))
        script = f"cd {cwd} && . {d}/env.sh && echo $$ > {d}/pid && exec {command}"
        transport = self.client.get_transport()
        if transport is None:
            raise SSHError(f"{self.host.label}: the SSH connection closed")
        self.channel = transport.open_session()
        self.channel.exec_command(script)
        threading.Thread(target=self._pump, args=(events,), daemon=True).start()

    @staticmethod
    def _write(sftp, path: str, text: str) -> None:
        with sftp.open(path, "w") as f:
            f.chmod(0o600)
            f.write(text.encode())

    def _pump(self, events: queue.Queue) -> None:
        """stdout chunks and stderr lines until the channel closes, then the exit status."""
        chan = self.channel
        assert chan is not None  # started
        readers = [
            threading.Thread(target=_read_stdout, args=(chan, self.rank, events), daemon=True),
            threading.Thread(target=_read_stderr, args=(chan, self.rank, events), daemon=True),
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        status = chan.recv_exit_status()  # returns once the channel is closed, even if dropped
        # -1: no status came: the process died by a signal, or the connection dropped.
        self._exited = status != -1
        self.exit_code = 255 if status == -1 else status
        events.put(("exit", self.rank, self.exit_code))
        self._done.set()

    def write_stdin(self, data: bytes) -> None:
        if self.channel is None:
            raise OSError(f"rank {self.rank} has not started")
        self.channel.sendall(data)

    def poll(self) -> int | None:
        return self.exit_code

    def host_answers(self) -> bool:
        """Whether the host answers over our connection (a silent rank on a host that
        answers is hung, not cut off)."""
        if answers(lambda command, timeout: run(self.client, command, timeout)):
            return True
        self.lost = True  # nothing more is tried or waited for
        return False

    def send_signal(self, sig: int) -> None:
        """Signal the remote process group itself, over a new connection if the old one
        dropped (a dropped channel does not end a process that is not writing)."""
        if self.channel is None or self._exited or self.dir is None:
            return
        pid = f"$(cat {shlex.quote(self.dir)}/pid 2>/dev/null)"

        def kill(s: int) -> str:  # the process group first, the process if that fails
            return f"kill -{int(s)} -- -{pid} 2>/dev/null || kill -{int(s)} {pid} 2>/dev/null"

        if self.lost:  # its host did not answer once already: nothing more is tried
            return
        client = self._live_client()
        try:
            run(client, kill(sig), timeout=SIGNAL_TIMEOUT_S)
        except (paramiko.SSHException, OSError, EOFError):  # TimeoutError is an OSError
            # The host does not answer (a cut link, a host that went away after the job
            # failed elsewhere): nothing more is tried or waited for; the rank hears no
            # keepalive from us and ends itself (node.watchdog).
            self.lost = True
            return
        try:
            if self._done.is_set() and sig == signal.SIGTERM:
                # No channel to wait on: poll the process until it is gone, then insist.
                deadline = time.monotonic() + STOP_GRACE_S
                while time.monotonic() < deadline:
                    if run(client, f"kill -0 {pid} 2>/dev/null", SIGNAL_TIMEOUT_S)[0] != 0:
                        return
                    time.sleep(0.2)
                run(client, kill(signal.SIGKILL), timeout=SIGNAL_TIMEOUT_S)
        except (paramiko.SSHException, OSError, EOFError):
            self.lost = True

    def _live_client(self) -> paramiko.SSHClient:
        transport = self.client.get_transport()
        if (transport is None or not transport.is_active()) and self.reconnect is not None:
            try:
                self.client = self.reconnect()
            except SSHError:
                pass
        return self.client

    def wait(self, timeout: float | None = None) -> int | None:
        self._done.wait(0 if self.lost else timeout)
        return self.exit_code

    def cleanup(self) -> None:
        if self.dir is None or self.lost:  # a job directory left on a lost host is harmless
            return
        try:
            d, parent = shlex.quote(self.dir), shlex.quote(posixpath.dirname(self.dir))
            run(
                self._live_client(),
                f"rm -rf {d}; rmdir {parent} 2>/dev/null",
                timeout=CONNECT_TIMEOUT_S,
            )
        except (paramiko.SSHException, OSError, EOFError):
            pass


def _read_stdout(chan: paramiko.Channel, rank: int, events: queue.Queue) -> None:
    while data := chan.recv(65536):
        events.put(("out", rank, data))


def _read_stderr(chan: paramiko.Channel, rank: int, events: queue.Queue) -> None:
    pump_lines(lambda: chan.recv_stderr(65536), rank, events)
