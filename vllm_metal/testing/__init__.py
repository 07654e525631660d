"""Test support: tiny random-weight checkpoints built on the spot and float32 reference oracles.

Nothing here is imported by the plugin at runtime; tests and benchmarks use it without model downloads.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ARCHS": "tiny_models",
    "DTYPES": "tiny_models",
    "build_tokenizer_json": "tiny_tokenizer",
    "quantize_tiny_model": "tiny_models",
    "write_tiny_model": "tiny_models",
    "hf_greedy": "oracles",
    "hf_logprobs": "oracles",
    "mlx_lm_greedy": "oracles",
}

__all__ = [
    "ARCHS",
    "DTYPES",
    "build_tokenizer_json",
    "hf_greedy",
    "hf_logprobs",
    "mlx_lm_greedy",
    "quantize_tiny_model",
    "write_tiny_model",
]


def __getattr__(name: str) -> Any:
    # Lazy, so `python -m vllm_metal.testing.tiny_models` does not import the module twice.
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    return getattr(module, name)
