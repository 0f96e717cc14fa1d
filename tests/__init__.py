"""The test suite: fast/ (no process is started: under 30 s), e2e/ (real ranks, servers, sshd,
a rig of hosts), support/ (what both use: tiny models, processes, references), bench/
(measurements behind docs/benchmarks.md), tools/ (what makes docs pages and the embedded
model)."""
