"""Which rank a failure report blames, when several ranks fail one after another."""

from cluster.job.state import RankState, culprit, failure_report


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
