"""A decode group's door under 2,200 silent connections (issue 62): a long prompt's time and
whether it was handed off, before and while the connections are held open.

    python -m tests.bench.door_flood --connections 2200

serve -n 2 --replicas 2 --prefill-groups 1 (a prefill rank, a decode rank) of a tiny qwen2;
the connections go to the decode rank's door (its listening port that sends a challenge) and
never send a byte. Before issue 62 the door's accepting thread ended on EMFILE and every later
long prompt was prefilled by the decode group after a 30 s connect timeout (0.5 s before,
31.9 s after, no handoff).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.support.processes import _children, _cmdline, descendant_ranks
from tests.support.serving import Served, get, wait_for

LONG = "Summarize this: " + " ".join(f"item {i} is a list of things" for i in range(60))


def role_of(pid: int) -> str:
    path = re.search(r"(\S+/rank\d+/job\.json)", _cmdline(pid))
    return json.loads(Path(path[1]).read_text())["handoff"]["role"] if path else ""


def door_port(pid: int) -> int:
    """The decode rank's listening port that greets a connection with a 32-byte challenge."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if f"pid={pid}," not in line:
            continue
        port = int(line.split()[3].rsplit(":", 1)[1])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.settimeout(2)
                if len(s.recv(32)) == 32:
                    return port
        except OSError:
            continue
    raise RuntimeError(f"no door among rank {pid}'s listening ports")


def ask(served: Served, prompt: str) -> tuple[float, int]:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    req = urllib.request.Request(f"http://127.0.0.1:{served.port}/v1/chat/completions",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    began = time.monotonic()
    answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
    return time.monotonic() - began, answer["timings"].get("handoff_n", 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=2200)
    args = ap.parse_args()
    from tests.support.tiny import make_model

    model = make_model(Path(tempfile.mkdtemp()) / "m", "qwen2", seed=3, chat_template=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # mlx-lm's import set 2048
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, args.connections + 200), hard))
    served = Served(model, "-n", "2", "--replicas", "2", "--prefill-groups", "1",
                    "--disaggregate-min-tokens", "64")  # fmt: skip
    silent: list[socket.socket] = []
    try:
        wait_for(lambda: get(served, "/health")[1]["groups_ready"] == 2)
        (decode,) = [p for p in descendant_ranks(served.proc.pid, _children(), _cmdline)
                     if role_of(p) == "decode"]  # fmt: skip
        port = door_port(decode)
        rows = [("before", *ask(served, LONG))]
        for _ in range(args.connections):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            silent.append(s)
        rows.append((f"{args.connections} silent connections held", *ask(served, "2 " + LONG)))
        time.sleep(6)  # past the door's proof deadline: what it held of them is closed
        rows.append(("6 s later, still held", *ask(served, "3 " + LONG)))
    finally:
        for s in silent:
            s.close()
        served.stop()
    print("| when | long prompt answered in s | tokens handed off |")
    print("|---|---|---|")
    for when, seconds, handed in rows:
        print(f"| {when} | {seconds:.2f} | {handed} |")


if __name__ == "__main__":
    main()
