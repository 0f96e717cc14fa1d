"""A real OpenSSH server on 127.0.0.1 for the tests, with generated host and user keys."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


@dataclass
class SSHServer:
    port: int
    dir: Path
    user_key: Path
    known_hosts: Path  # holds this server's real host key
    proc: subprocess.Popen

    def hostfile(self, hosts: str, python: str, known_hosts: Path | None = None) -> str:
        return (
            f"python: {python}\n"
            f"ssh: {{user: root, identity_file: {self.user_key}, "
            f"known_hosts: {known_hosts or self.known_hosts}}}\n"
            f"hosts:\n{hosts}"
        )


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sshd(base: Path) -> SSHServer:
    base.mkdir(parents=True, exist_ok=True)
    keygen(base / "host_key")
    keygen(base / "user_key")
    shutil.copy(base / "user_key.pub", base / "authorized_keys")
    port = free_port()
    (base / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {base}/host_key\n"
        f"AuthorizedKeysFile {base}/authorized_keys\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nStrictModes no\n"
        f"UsePAM no\nPidFile {base}/sshd.pid\nSubsystem sftp internal-sftp\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    proc = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(base / "sshd_config")],
        stdout=subprocess.DEVNULL,
        stderr=open(base / "sshd.log", "w"),
    )
    deadline = time.monotonic() + 15
    while True:  # until sshd accepts connections
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (base / "sshd.log").read_text()
                raise RuntimeError(f"sshd did not start: {log}") from None
            time.sleep(0.05)
    host_pub = (base / "host_key.pub").read_text().split()
    (base / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    return SSHServer(port, base, base / "user_key", base / "known_hosts", proc)
