"""FLUX.2 [klein] on MLX."""

__version__ = "0.1.0"
