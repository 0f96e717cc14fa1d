"""mlx-cluster's rank process: one per rank, started as ``python -m node run --spec FILE``."""
