"""Tiny checkpoints shared by the runner tests (written once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_metal.testing.tiny_models import write_tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runner-models")
    return {arch: write_tiny_model(root / arch, arch) for arch in FAMILIES}
