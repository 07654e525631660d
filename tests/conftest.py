"""Shared pytest fixtures: tiny checkpoints built once per session into a temporary directory.

Use ``tiny_model_dir("qwen3", "bfloat16")`` or ``tiny_quantized_dir("llama", bits=4)`` in a test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# The plugin sets up MLX's CPU BLAS when it is imported, which must come before mlx.core: in-process
# MLX tests then run on the same BLAS as the engines.
import vllm_metal  # noqa: F401
from tests.scheduling import make_scheduler, order_units


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-full",
        action="store_true",
        help="also run the tests marked `full` (minutes each; not part of CI's run)",
    )


@pytest.hookimpl(tryfirst=True)  # before tests/serving's ordering within the serving suite
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order_units(items)
    if config.getoption("--run-full"):
        return
    skip = pytest.mark.skip(reason="marked `full`: run with --run-full")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, called under `pytest -n N`
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    return make_scheduler(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory ``(arch, dtype="float32", **write_tiny_model_kwargs) -> Path``, cached per session."""
    from vllm_metal.testing.tiny_models import write_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[tuple[Any, ...], Path] = {}

    def make(arch: str, dtype: str = "float32", **kwargs: Any) -> Path:
        key = (arch, dtype, tuple(sorted(kwargs.items())))
        if key not in built:
            suffix = "".join(f"-{k}{v}" for k, v in sorted(kwargs.items()))
            built[key] = write_tiny_model(
                root / f"{arch}-{dtype}{suffix}", arch, dtype=dtype, **kwargs
            )
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_quantized_dir(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Callable[..., Path]
) -> Callable[..., Path]:
    """Factory ``(arch, bits=4, group_size=64, dtype="bfloat16") -> Path`` of MLX-quantized
    checkpoints (made by mlx-lm's converter), cached per session."""
    from vllm_metal.testing.tiny_models import quantize_tiny_model

    root = tmp_path_factory.mktemp("tiny-quantized")
    built: dict[tuple[str, int, int, str], Path] = {}

    def make(arch: str, bits: int = 4, group_size: int = 64, dtype: str = "bfloat16") -> Path:
        key = (arch, bits, group_size, dtype)
        if key not in built:
            src = tiny_model_dir(arch, dtype)
            dst = root / f"{arch}-{dtype}-q{bits}g{group_size}"
            built[key] = quantize_tiny_model(src, dst, bits=bits, group_size=group_size)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Whisper checkpoint (`tests.fixtures.tiny_whisper`), once per session."""
    from tests.fixtures.tiny_whisper import write_tiny_whisper

    return write_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper") / "whisper")


@pytest.fixture(scope="session")
def tiny_qwen3_asr_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen3-ASR checkpoint (`tests.fixtures.tiny_qwen3_asr`), once per session."""
    from tests.fixtures.tiny_qwen3_asr import write_tiny_qwen3_asr

    return write_tiny_qwen3_asr(tmp_path_factory.mktemp("tiny-qwen3-asr") / "qwen3_asr")


@pytest.fixture(scope="session")
def tiny_idefics3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Idefics3 checkpoint (`tests.fixtures.tiny_idefics3`), once per session."""
    from tests.fixtures.tiny_idefics3 import write_tiny_idefics3

    return write_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3") / "idefics3")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Gemma 3 checkpoint (`tests.fixtures.tiny_gemma3`), once per session."""
    from tests.fixtures.tiny_gemma3 import write_tiny_gemma3

    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3") / "gemma3")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2.5-VL checkpoint (`tests.fixtures.tiny_qwen2_5_vl`), once per
    session."""
    from tests.fixtures.tiny_qwen2_5_vl import write_tiny_qwen2_5_vl

    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2-5-vl") / "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen3-VL checkpoint (`tests.fixtures.tiny_qwen3_vl`), once per
    session."""
    from tests.fixtures.tiny_qwen3_vl import write_tiny_qwen3_vl

    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl") / "qwen3_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen3-Next hybrid checkpoint (`tests.fixtures.tiny_qwen3_next`), once
    per session."""
    from tests.fixtures.tiny_qwen3_next import write_tiny_qwen3_next

    return write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next") / "qwen3_next")


@pytest.fixture(scope="session")
def tiny_qwen3_5_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory ``(layout="wrapper", dtype="float32") -> Path`` of the tiny random Qwen3.5
    checkpoints (`tests.fixtures.tiny_qwen3_5.LAYOUTS`: "wrapper", "causal_lm", "moe_wrapper",
    "moe_causal_lm"), each written once per session."""
    from tests.fixtures.tiny_qwen3_5 import write_tiny_qwen3_5

    root = tmp_path_factory.mktemp("tiny-qwen3-5")
    built: dict[tuple[str, str], Path] = {}

    def make(layout: str = "wrapper", dtype: str = "float32") -> Path:
        if (layout, dtype) not in built:
            built[layout, dtype] = write_tiny_qwen3_5(
                root / f"{layout}-{dtype}", layout, dtype=dtype
            )
        return built[layout, dtype]

    return make


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tiny_qwen3_5_dirs: Callable[..., Path]) -> Path:
    """The tiny Qwen3.5 checkpoint in the published wrapper layout (float32)."""
    return tiny_qwen3_5_dirs("wrapper")


@pytest.fixture(scope="session")
def tiny_qwen3_5_causal_lm_dir(tiny_qwen3_5_dirs: Callable[..., Path]) -> Path:
    """The tiny text-only `Qwen3_5ForCausalLM` checkpoint (float32)."""
    return tiny_qwen3_5_dirs("causal_lm")


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_dir(tiny_qwen3_5_dirs: Callable[..., Path]) -> Path:
    """The tiny Qwen3.5-MoE checkpoint in the published wrapper layout (float32)."""
    return tiny_qwen3_5_dirs("moe_wrapper")


@pytest.fixture(scope="session")
def tiny_granitemoehybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Granite 4.0-H hybrid checkpoint (`tests.fixtures.tiny_granitemoehybrid`),
    once per session."""
    from tests.fixtures.tiny_granitemoehybrid import write_tiny_granitemoehybrid

    return write_tiny_granitemoehybrid(
        tmp_path_factory.mktemp("tiny-granitemoehybrid") / "granitemoehybrid"
    )


@pytest.fixture(scope="session")
def tiny_lfm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random LFM2 short-convolution hybrid checkpoint (`tests.fixtures.tiny_lfm2`),
    once per session."""
    from tests.fixtures.tiny_lfm2 import write_tiny_lfm2

    return write_tiny_lfm2(tmp_path_factory.mktemp("tiny-lfm2") / "lfm2")


@pytest.fixture(scope="session")
def tiny_gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Gemma 4 text checkpoint laid out as E2B/E4B (`tests.fixtures.tiny_gemma4`:
    two head sizes, shared KV layers, per-layer inputs), once per session."""
    from tests.fixtures.tiny_gemma4 import write_tiny_gemma4

    return write_tiny_gemma4(tmp_path_factory.mktemp("tiny-gemma4") / "dense", "dense")


@pytest.fixture(scope="session")
def tiny_gemma4_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Gemma 4 MoE text checkpoint laid out as 26B-A4B (`tests.fixtures.tiny_gemma4`),
    once per session."""
    from tests.fixtures.tiny_gemma4 import write_tiny_gemma4

    return write_tiny_gemma4(tmp_path_factory.mktemp("tiny-gemma4-moe") / "moe", "moe")


@pytest.fixture(scope="session")
def tiny_gemma4_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Gemma 4 wrapper checkpoint (`Gemma4ForConditionalGeneration`,
    `tests.fixtures.tiny_gemma4_vl`: the dense text model beside a vision tower), once per
    session."""
    from tests.fixtures.tiny_gemma4_vl import write_tiny_gemma4_vl

    return write_tiny_gemma4_vl(tmp_path_factory.mktemp("tiny-gemma4-vl") / "gemma4_vl")


@pytest.fixture(scope="session")
def tiny_nemotron_h_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Nemotron-H hybrid checkpoint (`tests.fixtures.tiny_nemotron_h`), once per
    session."""
    from tests.fixtures.tiny_nemotron_h import write_tiny_nemotron_h

    return write_tiny_nemotron_h(tmp_path_factory.mktemp("tiny-nemotron-h") / "nemotron_h")


@pytest.fixture(scope="session")
def tiny_falcon_h1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Falcon-H1 hybrid checkpoint (`tests.fixtures.tiny_falcon_h1`), once per
    session."""
    from tests.fixtures.tiny_falcon_h1 import write_tiny_falcon_h1

    return write_tiny_falcon_h1(tmp_path_factory.mktemp("tiny-falcon-h1") / "falcon_h1")


@pytest.fixture(scope="session")
def tiny_glm4_moe_lite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random GLM-4.7-Flash (MLA) checkpoint (`tests.fixtures.tiny_glm4_moe_lite`), once
    per session."""
    from tests.fixtures.tiny_glm4_moe_lite import write_tiny_glm4_moe_lite

    return write_tiny_glm4_moe_lite(tmp_path_factory.mktemp("tiny-glm4-moe-lite") / "glm4_moe_lite")


@pytest.fixture(scope="session")
def tiny_kimi_linear_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Kimi-Linear (MLA + KDA hybrid) checkpoint
    (`tests.fixtures.tiny_kimi_linear`), once per session."""
    from tests.fixtures.tiny_kimi_linear import write_tiny_kimi_linear

    return write_tiny_kimi_linear(tmp_path_factory.mktemp("tiny-kimi-linear") / "kimi_linear")


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random DeepSeek-V3 (MLA) checkpoint (`tests.fixtures.tiny_deepseek_v3`), once
    per session."""
    from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_v3

    return write_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny-deepseek-v3") / "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_deepseek_v2_lite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random DeepSeek-V2 (MLA) checkpoint shaped like V2-Lite (no query LoRA, greedy
    softmax routing: `tests.fixtures.tiny_deepseek_v2`), once per session."""
    from tests.fixtures.tiny_deepseek_v2 import write_tiny_deepseek_v2

    out = tmp_path_factory.mktemp("tiny-deepseek-v2-lite") / "deepseek_v2"
    return write_tiny_deepseek_v2(out, variant="lite")


@pytest.fixture(scope="session")
def tiny_deepseek_v2_grouped_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random DeepSeek-V2 (MLA) checkpoint with a query LoRA and group-limited routing
    (`tests.fixtures.tiny_deepseek_v2`), once per session."""
    from tests.fixtures.tiny_deepseek_v2 import write_tiny_deepseek_v2

    out = tmp_path_factory.mktemp("tiny-deepseek-v2-grouped") / "deepseek_v2"
    return write_tiny_deepseek_v2(out, variant="grouped")


@pytest.fixture(scope="session")
def tiny_minicpm3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random MiniCPM3 (MLA) checkpoint (`tests.fixtures.tiny_minicpm3`), once per
    session."""
    from tests.fixtures.tiny_minicpm3 import write_tiny_minicpm3

    return write_tiny_minicpm3(tmp_path_factory.mktemp("tiny-minicpm3") / "minicpm3")
