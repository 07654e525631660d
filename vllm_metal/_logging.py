"""Loggers for the plugin, placed under vLLM's `vllm` logger so its handler and level apply.

vLLM configures only the `vllm` logger tree; a logger named `vllm_metal.*` would drop INFO lines
such as the MLX device and the KV cache size.
"""

from __future__ import annotations

import logging


def init_logger(name: str) -> logging.Logger:
    """`vllm_metal.kv.pool` logs as `vllm.metal.kv.pool`."""
    suffix = name.removeprefix("vllm_metal").lstrip(".")
    return logging.getLogger("vllm.metal" + (f".{suffix}" if suffix else ""))
