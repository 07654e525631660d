"""Fixtures both backends' runner tests share: one tiny checkpoint per dense text family."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_metal.testing.tiny_models import write_tiny_model

# The dense text families the runner parity tests cover on every backend.
FAMILIES = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3",
    "olmo2",
    "olmo3",
    "hunyuan_v1_dense",
    "seed_oss",
    "glm4",
    "ernie4_5",
    "ministral3",
]


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runner-models")
    return {arch: write_tiny_model(root / arch, arch) for arch in FAMILIES}
