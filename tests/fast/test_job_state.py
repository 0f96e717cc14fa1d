"""The launcher's bookkeeping of a job (cluster.job.state) and the events it reads
(cluster.core.protocol): phases, readiness, silence, and which rank a failure blames."""

import pytest

from cluster.core import protocol
from cluster.job.state import (
    JobState,
    RankState,
    culprit,
    failure_report,
    on_event,
    on_text,
    overdue,
)
from node.decode.loop import answer_stats


def test_events_round_trip_and_log_lines_stay_lines():
    events = [
        protocol.Beat(),
        protocol.Phase("loading"),
        protocol.Ready(1.5, layers=[0, 3], files=["a.safetensors"]),
        protocol.Stats(**answer_stats(3, 10.0, 2, 5.0, 2, "length", 0.1)),
        protocol.Error("boom", t=1.0, peer=True),
        protocol.BenchComm({"send": 1}, allsum_bytes=4),
    ]
    for event in events:
        line = protocol.encode_event(event)
        assert line.endswith("\n") and line.count("\n") == 1
        assert protocol.decode_event(line) == event
    assert protocol.decode_event("Traceback (most recent call last):\n") is None


def test_a_rank_s_events_are_checked_and_a_bad_one_is_the_rank_s_fault():
    """Names, types and contents, and who may send what: what once ended serve (a stats
    event without its timings: KeyError in the stats line) or hung a client (a Wake from rank
    1 wrote WAKE into rank 0's request channel) is a BadEvent of that rank."""
    good = protocol.Stats(**answer_stats(3, 10.0, 2, 5.0, 2, "stop", 0.1), request="r")
    bad = {
        '{"event": "nope"}': "no event",
        "{broken": "Expecting",
        "[1]": "not an object",
        '{"event": "stats", "finish_reason": "stop", "usage": {}, "timings": {}}': "usage.",
        '{"event": "piece", "request": "r", "text": 5}': "Piece.text: expected str",
        '{"event": "beat", "progress": "x"}': "Beat.progress",
        '{"event": "ready", "load_s": 1, "layers": ["a"]}': "Ready.layers",
        '{"event": "memory", "peak_memory_gb": true}': "Memory.peak_memory_gb",
    }
    for line, why in bad.items():
        with pytest.raises(protocol.BadEvent, match=why):
            protocol.decode_event(protocol.EVENT_PREFIX + line + "\n")
    broken = protocol.encode_event(good).replace('"prompt_n": 3', '"prompt_n": "3"')
    with pytest.raises(protocol.BadEvent, match="timings.prompt_n"):
        protocol.decode_event(broken)
    for event in (protocol.Wake(), good, protocol.Piece("r", "hi")):
        assert protocol.decode_event(protocol.encode_event(event), rank=0) == event
        with pytest.raises(protocol.BadEvent, match="only rank 0"):
            protocol.decode_event(protocol.encode_event(event), rank=1)
    for event in (protocol.Beat(3), protocol.Memory(1.5), protocol.Error("x", t=1.0)):
        assert protocol.decode_event(protocol.encode_event(event), rank=2) == event


def test_a_rank_s_stderr_is_cut_into_lines_in_linear_time_and_bounded():
    from cluster.job.process import MAX_LINE, Lines

    lines = Lines()
    got = []
    for _ in range(4096):  # a 32 MiB line arriving in 8 KiB reads: was quadratic
        got += lines.feed(b"x" * 8192)
    got += lines.feed(b"y\nnext\n") + lines.end()
    assert len(got) == 2 and got[1] == "next\n"
    assert len(got[0]) < MAX_LINE + 100 and got[0].endswith(f"longer than {MAX_LINE} bytes]\n")
    assert Lines().feed(b"a\nb") == ["a\n"]


def job(n: int = 2) -> JobState:
    return JobState([RankState(r, f"mac{r}") for r in range(n)])


def test_bookkeeping_follows_phases_ready_and_stats():
    state = job()
    assert on_event(state, 1, protocol.Phase("loading"), 0.5) == []
    assert state.ranks[1].phase == "loading"
    on_event(state, 0, protocol.Ready(1.0), 1.0)
    said = on_event(state, 1, protocol.Ready(2.0), 2.5)
    assert [s.text for s in said] == ["all ranks ready after 2.5 s"]
    assert state.result.ready_s == 2.5 and state.ranks[1].load_s == 2.0
    assert on_text(state, 1, b"not for the user\n", 3.0) is False
    assert list(state.ranks[1].tail) == ["not for the user"]
    assert on_text(state, 0, b"Hi", 3.0) is True and state.result.first_token_s == 3.0
    stats = protocol.Stats(
        "stop",
        {},
        {
            "prompt_n": 4,
            "prompt_per_second": 10.0,
            "cache_n": 0,
            "predicted_n": 2,
            "predicted_per_second": 5.0,
        },
    )
    said = on_event(state, 0, stats, 4.0)
    assert state.result.stats is stats
    assert said[0].text.startswith("prompt 4 tokens at 10.0 tok/s, cache 0, generated 2")
    on_event(state, 1, protocol.Error("bad model", t=7.0, cause="model"), 5.0)
    assert state.ranks[1].bad_model and state.ranks[1].error_t == 7.0


def test_the_rank_silent_longest_is_given_up_on_and_the_others_named():
    state = job(3)
    for s, seen in zip(state.ranks, (100.0, 80.0, 90.0), strict=True):
        s.last_seen = seen
    assert overdue(state, 105.0, 5.0, heartbeat_timeout=30, start_timeout=60) is None
    late = overdue(state, 115.0, 25.0, heartbeat_timeout=30, start_timeout=60)
    assert late.rank == 1 and late.unresponsive
    assert "also silent" not in late.error
    late = overdue(state, 131.0, 25.0, heartbeat_timeout=30, start_timeout=60)
    assert "also silent: rank 2 on mac2" in late.error


def test_start_timeout_names_a_rank_not_ready():
    state = job(2)
    for s in state.ranks:
        s.last_seen = 100.0
    on_event(state, 0, protocol.Ready(1.0), 1.0)
    late = overdue(state, 101.0, 61.0, heartbeat_timeout=30, start_timeout=60)
    assert late.rank == 1 and "--start-timeout" in late.error


def test_the_earliest_reported_error_is_the_cause():
    cause = RankState(
        1, "localhost", phase="loading", exit_code=1, error="truncated file", error_t=100.0
    )
    peer = RankState(
        0, "localhost", phase="loading", exit_code=1, error="[ring] Recv failed", error_t=100.2
    )
    # rank 0's exit arrived first, but rank 1 failed first
    assert culprit(peer, [peer, cause]) is cause
    report = failure_report(culprit(peer, [peer, cause]), [peer, cause])
    assert report.startswith("error: rank 1 of 2 on localhost failed while loading")


def test_peer_notices_and_silence_do_not_move_the_blame():
    stopped = RankState(2, "mac3", exit_code=-9, unresponsive=True)
    noisy = RankState(0, "mac1", exit_code=1, error_t=5.0)
    assert culprit(stopped, [noisy, stopped]) is stopped
    unreported = RankState(1, "mac2", exit_code=-9)
    assert culprit(unreported, [unreported]) is unreported


def test_a_rank_killed_without_a_word_beats_peers_that_lost_it():
    killed = RankState(2, "mac3", exit_code=255)
    peer1 = RankState(1, "mac2", exit_code=1, error="[ring] connection to a peer was lost")
    ours = RankState(0, "mac1", exit_code=-15, stopped_by_us=True)
    assert culprit(peer1, [ours, peer1, killed]) is killed


def test_a_long_prefill_shows_its_progress_every_two_seconds():
    """Rank 0's Prefill events: a line with tokens done, the rate and the time left, at most
    every PREFILL_EVERY_S; none for a prompt too short to need one."""
    from cluster.core.protocol import Prefill
    from cluster.job.state import JobState, on_event

    job = JobState([RankState(0, "localhost")])
    said = [on_event(job, 0, Prefill(d, 8192), t) for d, t in [(0, 10.0), (2048, 11.0),
            (4096, 12.5), (6144, 13.0), (8191, 16.0), (8192, 16.1)]]  # fmt: skip
    lines = [s.text for group in said for s in group]
    assert lines == [
        "prefill 4096/8192 tokens (50%), 1638 tok/s, about 2 s left",
        "prefill 8191/8192 tokens (99%), 1365 tok/s, about 0 s left",
    ], lines
    short = JobState([RankState(0, "localhost")])
    assert not any(on_event(short, 0, Prefill(d, 3000), t) for d, t in [(0, 1), (2048, 9)])
