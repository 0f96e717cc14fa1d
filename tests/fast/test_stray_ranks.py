"""The tests' own process bookkeeping (tests.support.processes): the stray-rank check
every test ends with touches only the ranks this session started."""


def test_the_cleanup_fixture_sees_only_the_sessions_own_ranks():
    """A user's own job beside the tests (not below this session) is never ours to kill."""
    from tests.support.processes import descendant_ranks

    tree = {1: [10, 50], 10: [11, 12], 11: [13], 50: [51]}
    cmd = {
        11: "mlx-cluster launch hi",
        12: "python -m node run --spec a.json",
        13: "/v/python -m node run --spec b.json",
        51: "python -m node run --spec users-own.json",  # the user's job, under another parent
    }
    assert sorted(descendant_ranks(10, tree, lambda p: cmd.get(p, ""))) == [12, 13]
