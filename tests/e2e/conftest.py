"""Every test here is of the end-to-end layer: real processes (ranks, servers, sshd, a rig),
so ``-m "not e2e"`` leaves them out by their folder."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/e2e/" in str(item.path):
            item.add_marker(pytest.mark.e2e)
