"""The error a startup refusal raises: a setting this platform cannot serve, named with what to
change. A `ValueError`, so vLLM reports it as a bad argument."""

from __future__ import annotations


class MetalConfigError(ValueError):
    """A setting this platform cannot serve; raised at startup with what to change."""
