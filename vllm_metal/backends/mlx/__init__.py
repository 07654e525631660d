"""The MLX backend: mlx-lm models on MLX's GPU (Metal) or CPU device.

Importing this package must not import `mlx.core` (the CPU BLAS is set up before that).
"""
