"""The fast layer: no rank, no server process, no sshd (python -m pytest -m 'not e2e')."""
