"""Proves the startup of the KV offload tiers: what vLLM's config becomes, and every bad setting refused at
startup with its name (vLLM's own config building, with the plugin as the platform)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_metal import envs
from vllm_metal.kv.offload import SPEC_MODULE, SPEC_NAME
from vllm_metal.kv.offload.spec import DISK_BYTES, DISK_DIR


@pytest.fixture()
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [*envs.ENV_VARS, "PYTHONHASHSEED", "VLLM_USE_SIMPLE_KV_OFFLOAD"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def _config(model: Path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=256, **kwargs).create_engine_config()


def _refused(model: Path, *names: str, **kwargs) -> None:
    with pytest.raises(ValueError) as info:
        _config(model, **kwargs)
    for name in names:
        assert name in str(info.value)


def test_the_host_tier_becomes_vllms_offloading_connector_with_our_spec(env, model):
    transfer = _config(model, kv_offloading_size=0.5).kv_transfer_config
    assert transfer.kv_connector == "OffloadingConnector"
    assert transfer.kv_role == "kv_both"
    extra = transfer.kv_connector_extra_config
    assert (extra["spec_name"], extra["spec_module_path"]) == (SPEC_NAME, SPEC_MODULE)
    assert extra["cpu_bytes_to_use"] == 2**29
    assert DISK_DIR not in extra


def test_the_disk_tier_alone_sizes_a_host_tier_from_free_memory(env, model, tmp_path):
    env.setenv("VLLM_METAL_SSD_CACHE_DIR", str(tmp_path / "kv"))
    env.setenv("VLLM_METAL_SSD_CACHE_SIZE", "256M")
    config = _config(model)
    size = config.cache_config.kv_offloading_size
    from vllm_metal.host import available_memory_bytes

    assert 0 < size * 2**30 <= available_memory_bytes()
    transfer = config.kv_transfer_config
    assert transfer.kv_connector == "OffloadingConnector"
    extra = transfer.kv_connector_extra_config
    assert extra[DISK_DIR] == str(tmp_path / "kv") and (tmp_path / "kv").is_dir()
    assert extra[DISK_BYTES] == 256 * 2**20
    # A block file that fails its checksum is a load error; the request recomputes it.
    assert transfer.kv_load_failure_policy == "recompute"


def test_an_explicit_offloading_connector_gets_our_spec(env, model):
    transfer = _config(
        model,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 2**28},
        },
    ).kv_transfer_config
    assert transfer.kv_connector_extra_config["spec_name"] == SPEC_NAME


def test_a_directory_that_cannot_be_created_is_refused(env, model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env.setenv("VLLM_METAL_SSD_CACHE_DIR", str(blocker / "kv"))
    _refused(model, "VLLM_METAL_SSD_CACHE_DIR", "not a writable directory")


def test_a_disk_tier_larger_than_the_disk_is_refused(env, model, tmp_path):
    env.setenv("VLLM_METAL_SSD_CACHE_DIR", str(tmp_path))
    env.setenv("VLLM_METAL_SSD_CACHE_SIZE", "100000T")
    _refused(model, "VLLM_METAL_SSD_CACHE_SIZE", "lower it")


def test_a_bad_disk_size_is_refused_by_name(env, model, tmp_path):
    env.setenv("VLLM_METAL_SSD_CACHE_DIR", str(tmp_path))
    env.setenv("VLLM_METAL_SSD_CACHE_SIZE", "lots")
    _refused(model, "VLLM_METAL_SSD_CACHE_SIZE='lots'")


def test_a_host_tier_larger_than_free_memory_is_refused(env, model):
    _refused(model, "--kv-offloading-size", "free", kv_offloading_size=100000.0)


def test_block_hashes_seeded_per_process_are_refused_for_the_disk_tier(env, model, tmp_path):
    env.setenv("VLLM_METAL_SSD_CACHE_DIR", str(tmp_path))
    _refused(
        model,
        "--prefix-caching-hash-algo xxhash",
        "PYTHONHASHSEED",
        prefix_caching_hash_algo="xxhash",
    )
    env.setenv("PYTHONHASHSEED", "0")  # a shared seed makes them stable: accepted
    assert _config(model, prefix_caching_hash_algo="xxhash").kv_transfer_config is not None


def test_another_spec_and_the_simple_connector_are_refused(env, model):
    _refused(
        model,
        "spec_name='CPUOffloadingSpec'",
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec"},
        },
    )
    env.setenv("VLLM_USE_SIMPLE_KV_OFFLOAD", "1")
    _refused(model, "VLLM_USE_SIMPLE_KV_OFFLOAD", kv_offloading_size=0.5)


def test_a_host_tier_too_small_for_one_request_is_refused_at_engine_start(env, model):
    """The spec knows the block size only once vLLM planned the KV cache."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from vllm_metal.kv import KV_CACHE_LAYOUT
    from vllm_metal.kv.spec import kv_cache_specs
    from vllm_metal.models.layers import FULL_ATTENTION

    # 0.1 MiB holds 3 blocks of 32 KiB; one request of max_model_len 256 needs 16.
    config = _config(model, kv_offloading_size=0.1 / 1024, dtype="float32")
    config.cache_config.kv_cache_layout = KV_CACHE_LAYOUT  # the engine core resolves it
    names = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    specs = kv_cache_specs(
        names,
        [FULL_ATTENTION] * 2,
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=config.model_config.dtype,
    )
    kv_cache_config = get_kv_cache_config_from_groups(
        config, get_kv_cache_groups(config, specs), 64 * 2**20
    )
    with pytest.raises(ValueError) as info:
        OffloadingSpecFactory.create_spec(build_offloading_config(config, kv_cache_config))
    message = str(info.value)
    assert "holds 3 blocks" in message and "the 16 one request" in message
    assert "--kv-offloading-size" in message


def test_on_a_paging_machine_the_automatic_host_tier_shrinks_and_says_so(env, model, tmp_path):
    """This machine cannot be made to page on demand: the memory facts are stubbed, vLLM and the
    plugin's config code are real."""
    from vllm_metal import host
    from vllm_metal.config import kv_offload as offload_config

    env.setenv("VLLM_METAL_SSD_CACHE_DIR", str(tmp_path))
    env.setenv("VLLM_METAL_SSD_CACHE_SIZE", "64M")
    relaxed = _config(model).cache_config.kv_offloading_size
    env.setattr(offload_config, "memory_pressure", lambda: True)
    paging = _config(model).cache_config.kv_offloading_size
    assert 0 < paging < relaxed

    from vllm_metal.kv.offload.spec import _too_small

    env.setattr(host, "memory_pressure", lambda: True)
    assert "the machine is paging" in _too_small(2, 16, 2**15)
    env.setattr(host, "memory_pressure", lambda: False)
    assert "paging" not in _too_small(2, 16, 2**15)
