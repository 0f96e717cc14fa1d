"""`mlx-cluster chat`: turns through stdin, history, the prompt cache across turns, Ctrl-C."""

import re
import signal
import subprocess
import threading
import time

from tests.support.processes import CLI, cpu_seconds, ranks_below, run_cli
from tests.support.reference import TURNS, reference_chat

STATS = re.compile(r"prompt (\d+) tokens at [\d.]+ tok/s, cache (\d+), generated")


def turn_stats(stderr: str) -> list[tuple[int, int]]:
    """(prefilled tokens, reused tokens) of each answer, from the stats lines on stderr."""
    return [(int(m[1]), int(m[2])) for m in STATS.finditer(stderr)]


def test_three_turns_through_stdin(models):
    answers, sizes = reference_chat(models["qwen2"], TURNS, 16)
    p = run_cli(
        "chat", "--model", models["qwen2"], "--max-tokens", 16, input="\n".join(TURNS) + "\n"
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == "".join(a + "\n" for a in answers)
    stats = turn_stats(p.stderr)
    assert len(stats) == 3, p.stderr
    assert stats[0] == (sizes[0], 0)
    for (prefilled, reused), size, previous in zip(stats[1:], sizes[1:], sizes, strict=False):
        # the whole earlier conversation came from the cache; only the new tail was prefilled
        assert reused >= previous, stats
        assert prefilled + reused == size, stats


def test_ranks_rest_while_the_user_thinks(models):
    """Between turns rank 1 waits for rank 0's wake, not in a collective: over a few idle
    seconds both ranks use a fraction of one core's time, and the next turn goes on."""
    answers, _ = reference_chat(models["qwen2"], TURNS[:2], 8)
    proc = subprocess.Popen([CLI, "chat", "--model", str(models["qwen2"]), "--max-tokens", "8"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    try:
        pids = ranks_below(proc.pid, 2)
        proc.stdin.write(f"{TURNS[0]}\n".encode())
        proc.stdin.flush()
        first = (answers[0] + "\n").encode()
        assert proc.stdout.read(len(first)) == first
        before = cpu_seconds(pids)
        time.sleep(3)  # the idle window measured
        used = cpu_seconds(pids) - before
        out, err = proc.communicate(f"{TURNS[1]}\n".encode(), timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    assert out.decode() == answers[1] + "\n"
    assert used < 1.0, f"ranks waiting for the user used {used:.2f} s of CPU in 3 s"


def test_reset_and_exit(models):
    answers, _ = reference_chat(models["qwen2"], TURNS[:1], 12)
    p = run_cli(
        "chat", "--model", models["qwen2"], "--max-tokens", 12,
        input=f"{TURNS[0]}\n/reset\n{TURNS[0]}\n/exit\nnever read\n",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout == answers[0] + "\n" + answers[0] + "\n"  # the same fresh start twice
    assert "conversation reset" in p.stderr


def test_without_template_warns_and_goes_on(models):
    p = run_cli("chat", "--model", models["llama"], "--max-tokens", 8, input="hello\n")
    assert p.returncode == 0, p.stderr
    assert "no chat template" in p.stderr
    assert p.stdout.endswith("\n") and len(p.stdout) > 1


def test_ctrl_c_cancels_the_answer_and_keeps_the_session(models):
    proc = subprocess.Popen(
        [CLI, "chat", "--model", str(models["endless"]), "--max-tokens", "100000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    got_text = threading.Event()
    out = bytearray()

    def read():
        while data := proc.stdout.read1(4096):
            out.extend(data)
            got_text.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.stdin.write(b"Tell me about lists\n")
    proc.stdin.flush()
    assert got_text.wait(60), "no answer streamed"
    proc.send_signal(signal.SIGINT)
    proc.stdin.write(b"/exit\n")
    proc.stdin.close()
    try:
        proc.wait(60)
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert proc.returncode == 0, err
    assert "(cancelled)" in err


def test_every_rank_drops_its_turn_cache_when_any_rank_is_over_its_budget(models):
    """An uneven split (5 layers and 1): one rank's turn cache passes --prompt-cache-gb, the
    other's does not; both drop it, so the next turn prefills the same tokens on each (a
    rank that kept its cache alone would prefill fewer: a hung pipeline, or wrong text)."""
    answers, sizes = reference_chat(models["qwen2"], TURNS[:2], 12)
    p = run_cli(
        "chat", "--model", models["qwen2"], "--max-tokens", 12, "-n", 2, "--split", "5,1",
        "--prompt-cache-gb", "0.0003", "--stall-timeout", "30",
        input="\n".join(TURNS[:2]) + "\n",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout == "".join(a + "\n" for a in answers)
    assert turn_stats(p.stderr) == [(sizes[0], 0), (sizes[1], 0)], p.stderr  # no reuse
