"""The tiny random-weight checkpoint writer behind the README's quick start, and its tokenizer.

Nothing here is imported by the plugin at runtime. The test suite's other fixtures (families,
float32 oracles) live in the repository's tests/fixtures and do not ship.
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
    "write_transformers_checkpoint": "tiny_models",
}

__all__ = [
    "ARCHS",
    "DTYPES",
    "build_tokenizer_json",
    "quantize_tiny_model",
    "write_tiny_model",
    "write_transformers_checkpoint",
]


def __getattr__(name: str) -> Any:
    # Lazy, so `python -m vllm_metal.testing.tiny_models` does not import the module twice.
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    return getattr(module, name)
