"""Every test here is of the end-to-end layer: real processes (ranks, servers, sshd, a rig),
so ``-m "not e2e"`` leaves them out by their folder.

The files run longest first: README's command spreads them over two workers a file at a time
(``--dist loadfile``), and a long file handed out last would run alone at the end while the
other worker has nothing left to do."""

import pytest

# by the time each file took one test at a time (2 cores, 2026-12-07), the longest first; files
# not named follow in the order collected
LONGEST_FIRST = ("test_rig.py", "test_speculative.py", "test_models.py", "test_ssh.py",
                 "test_serve.py", "test_launch.py", "test_real_agents.py", "test_sync.py",
                 "test_bench.py", "test_serve_restart.py", "test_long_context.py",
                 "test_sampling.py", "test_structured.py", "test_quantized.py", "test_page.py",
                 "test_fleet.py", "test_handoff.py", "test_agents.py", "test_chat.py")  # fmt: skip


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/e2e/" in str(item.path):
            item.add_marker(pytest.mark.e2e)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order
