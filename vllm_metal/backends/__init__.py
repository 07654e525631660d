"""Compute backends: each supplies the device facts and the model runner the worker drives.

`VLLM_METAL_BACKEND` picks one (`mlx` is the default). Nothing here imports a backend library at
module level: `vllm_metal.backends.mlx` must stay importable before `mlx.core` is.
"""
