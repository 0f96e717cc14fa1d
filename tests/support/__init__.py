"""What the tests use: tiny models built on the fly (tiny, toolmodel, agentmodel), single-
process references (reference), the model matrix (matrix, matrix_ranks), processes started
and counted (processes), servers (serving), an sshd and a rig of hosts (sshd, netrig), a
stand-in hub (hubstand)."""
