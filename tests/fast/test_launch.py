"""`mlx-cluster launch` end to end: real rank processes over the ring backend on loopback."""

import io
import socket

import pytest

from tests.support.processes import invoke, run_cli

PROMPT = "Tell me about lists"


def test_missing_hostfile(tmp_path):
    p = invoke("launch", "--hostfile", tmp_path / "nope.yaml", PROMPT)
    assert p.returncode == 2
    assert "nope.yaml: hostfile not found" in p.stderr


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts: [ {ssh: a\n")
    p = invoke("launch", "--hostfile", bad, PROMPT)
    assert p.returncode == 2
    assert "bad.yaml: not valid YAML" in p.stderr


def test_bad_host_field_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts:\n  - ssh: localhost\n  - ssh: studio-2.local\n    slots: zero\n")
    p = invoke("launch", "--hostfile", bad, PROMPT)
    assert p.returncode == 2
    assert "bad.yaml: host 1 (studio-2.local): field 'slots'" in p.stderr


def test_unknown_backend(tmp_path):
    p = invoke("launch", "--backend", "mpi", PROMPT)
    assert p.returncode == 2
    assert "'mpi' is not one of 'ring', 'jaccl', 'jaccl-ring', 'nccl'" in p.stderr
    hf = tmp_path / "h.yaml"
    hf.write_text("backend: mpi\nhosts: [localhost]\n")
    p = invoke("launch", "--hostfile", hf, PROMPT)
    assert p.returncode == 2
    assert "field 'backend': unknown backend 'mpi'; use one of ring, jaccl, jaccl-ring, nccl" in (
        p.stderr
    )


def test_jaccl_needs_one_rank_per_host_and_rdma(tmp_path):
    p = invoke("launch", "--backend", "jaccl", PROMPT)
    assert p.returncode == 2
    assert "field 'slots': jaccl runs one rank per host" in p.stderr
    hf = tmp_path / "h.yaml"
    hf.write_text("backend: jaccl-ring\nhosts: [localhost, 127.0.0.1]\n")
    p = invoke("launch", "--hostfile", hf, PROMPT)
    assert p.returncode == 2
    assert "field 'rdma' is required by jaccl-ring on host 0 (localhost), host 1" in p.stderr


def test_model_path_missing(tmp_path):
    p = invoke("launch", "--model", tmp_path / "no-such-model", PROMPT)
    assert p.returncode == 2
    assert "no-such-model: no such model directory" in p.stderr


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    p = invoke("launch", "--model", tmp_path, PROMPT)
    assert p.returncode == 2
    assert "not an MLX/Hugging Face checkpoint (no config.json)" in p.stderr


def test_more_ranks_than_layers(models):
    p = invoke("launch", "-n", 7, "--model", models["llama"], PROMPT)
    assert p.returncode == 2
    assert "the model has 6 layers but 7 ranks were asked for" in p.stderr


def test_more_ranks_than_heads(models):
    p = invoke("launch", "-n", 13, "--mode", "tensor", "--model", models["qwen2"], PROMPT)
    assert p.returncode == 2
    assert "num_attention_heads=12 is fewer than 13 ranks; use at most 12 ranks" in p.stderr
    assert "starting" not in p.stderr  # refused before any rank starts


def test_port_already_taken(models):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = invoke("launch", "--starting-port", port, "--model", models["llama"], PROMPT)
    assert p.returncode == 2
    assert f"port {port} on 127.0.0.1 (rank 0, host 0 (localhost)) is already in use" in p.stderr


def test_empty_prompt():
    p = invoke("launch", input="  \n")
    assert p.returncode == 2
    assert "the prompt is empty" in p.stderr


def test_help_explains_options():
    p = invoke("launch", "--help")
    assert p.returncode == 0
    for option in (
        "--hostfile",
        "--num-ranks",
        "--model",
        "--mode",
        "--backend",
        "--max-tokens",
        "--temp",
        "--seed",
        "--verbose",
    ):
        assert option in p.stdout


@pytest.mark.parametrize(
    "split, message",
    [
        ("3,2", "--split 3,2 sums to 5 but the model has 6 layers"),
        ("6,0", "--split 6,0: every rank needs at least one layer"),
        ("6", "--split 6 has 1 entries for 2 ranks"),
    ],
)
def test_bad_split(models, split, message):
    p = invoke("launch", "--split", split, "--model", models["llama"], PROMPT)
    assert p.returncode == 2
    assert message in p.stderr


def test_kv_bits_refusals(models):
    """A group size that does not divide the head dimension: named before any rank starts.
    serve: refused, with the reason (mlx-lm's batching takes full-precision caches only)."""
    p = run_cli("launch", "--model", models["llama"], "--kv-bits", 4, "hi")
    assert p.returncode == 2
    assert "--kv-group-size 64 does not divide the model's head dimension 8" in p.stderr
    assert "run without --kv-bits" in p.stderr and "starting" not in p.stderr
    p = run_cli("serve", "--model", models["llama"], "--kv-bits", 8)
    assert p.returncode == 2
    assert "serve decodes its requests as one batch" in p.stderr and "chat" in p.stderr


def test_micro_batches_are_for_pipeline_mode(models):
    """--micro-batches splits a pipeline's batch: with tensor mode, refused before any rank
    starts; launch and chat decode one stream and do not take it."""
    p = run_cli("serve", "--mode", "tensor", "--micro-batches", 2, "--model", models["qwen2"])
    assert p.returncode == 2
    assert "tensor mode has no stages to keep busy" in p.stderr and "starting" not in p.stderr
    p = invoke("launch", "--micro-batches", 2, "--model", models["llama"], PROMPT)
    assert p.returncode == 2 and "No such option" in p.stderr


def test_the_stats_line_starts_on_its_own_line_on_a_terminal():
    """An answer that ends mid-line, then the stats line, on one terminal (stdout and
    stderr both): the line is not glued to the answer. Into a pipe, stdout stays exactly
    the answer."""
    import io
    import os
    import pty
    import select

    from cluster.core.spec import LaunchSettings
    from cluster.job.launcher import RankWatch

    master, slave = pty.openpty()
    with os.fdopen(slave, "wb", buffering=0) as out, os.fdopen(os.dup(slave), "w") as err:
        watch = RankWatch([], "launch", LaunchSettings(), out, err, 0.0)
        watch.write_text(b"functions that d")
        watch.say("prompt 15 tokens at 16.8 tok/s")
        err.flush()
        seen = ""
        while seen.count("\n") < 2 and select.select([master], [], [], 5)[0]:
            seen += os.read(master, 4096).decode()  # a terminal may pass it on in pieces
    os.close(master)
    assert (
        seen.replace("\r", "") == "functions that d\nmlx-cluster: prompt 15 tokens at 16.8 tok/s\n"
    )
    piped, log = io.BytesIO(), io.StringIO()
    watch = RankWatch([], "launch", LaunchSettings(), piped, log, 0.0)
    watch.write_text(b"functions that d")
    watch.say("prompt 15 tokens")
    assert piped.getvalue() == b"functions that d"  # a pipe gets only the answer


class StandIn:
    """A rank as RankWatch drives it, without a process: ``go`` (a subclass's) puts its
    events on the launcher's queue from a thread of its own; signals are recorded."""

    lost = False

    def __init__(self, rank: int):
        from cluster.core.hostfile import local_hostfile

        self.rank, self.host = rank, local_hostfile(2).hosts[0]
        self.signals: list[int] = []

    def start(self, events) -> None:
        import threading

        threading.Thread(target=self.go, args=(events,), daemon=True).start()

    def go(self, events) -> None:
        raise NotImplementedError

    def write_stdin(self, data: bytes) -> None:
        pass

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def wait(self, timeout=None):
        return 0


def test_a_rank_stopped_for_its_peer_lets_the_peer_say_why():
    """Rank 0 stops because rank 1 failed (exit 3) and its exit reaches the launcher before
    rank 1's error: the job is not torn down until rank 1 has said why (then exit 2, its
    reason), nor is rank 1 signalled before it has."""
    import signal
    import threading
    import time

    from cluster.core.protocol import Error, encode_event
    from cluster.core.spec import LaunchSettings
    from cluster.job.launcher import LaunchError, RankWatch

    said = threading.Event()
    early: list[int] = []  # signals rank 1 got before it spoke

    class Stand(StandIn):
        def go(self, events) -> None:
            if self.rank == 0:
                events.put(("exit", 0, 3))  # first: "a peer failed"
            else:
                said.wait(5)  # a while after rank 0's exit
                error = Error("this rank's tokenizer is not rank 0's", t=1.0, cause="model")
                events.put(("err", 1, encode_event(error)))
                events.put(("exit", 1, 2))

        def send_signal(self, sig: int) -> None:
            super().send_signal(sig)
            if self.rank == 1 and not said.is_set():
                early.append(sig)

    ranks = [Stand(0), Stand(1)]
    watch = RankWatch(ranks, "launch", LaunchSettings(), io.BytesIO(), io.StringIO(),
                      time.monotonic())  # fmt: skip
    threading.Timer(0.3, said.set).start()
    with pytest.raises(LaunchError) as e:
        watch.run()
    assert e.value.exit_code == 2, str(e.value)
    assert "rank 1 of 2" in str(e.value) and "tokenizer is not rank 0's" in str(e.value)
    assert signal.SIGTERM not in early  # not stopped before it spoke


def test_a_ranks_silence_counts_from_its_own_start():
    """Ranks start one after another (over SSH, seconds each on a loaded host): a rank started
    last is not silent for the time its elders took to start."""
    import time

    from cluster.core.protocol import Beat, encode_event
    from cluster.core.spec import LaunchSettings
    from cluster.job.launcher import RankWatch

    class Stand(StandIn):
        def __init__(self, rank: int, starting_s: float):
            super().__init__(rank)
            self.starting_s = starting_s

        def start(self, events) -> None:
            time.sleep(self.starting_s)  # stands for the SSH session, SFTP and exec of a rank
            super().start(events)

        def go(self, events) -> None:
            time.sleep(0.2)  # its first beat a moment after it started
            events.put(("err", self.rank, encode_event(Beat(progress=0, idle=False))))
            events.put(("exit", self.rank, 0))

    ranks = [Stand(0, 0.0), Stand(1, 1.5)]
    settings = LaunchSettings(heartbeat_timeout=1.0)
    watch = RankWatch(ranks, "launch", settings, io.BytesIO(), io.StringIO(), time.monotonic())
    watch.run()  # before: "rank 1 ... sent nothing for 1.5 s (heartbeat timeout 1 s)"
    assert [s.exit_code for s in watch.state.ranks] == [0, 0]
