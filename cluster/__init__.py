"""mlx-cluster: the part that runs where the user types (no mlx import here)."""

__version__ = "0.1.0"
