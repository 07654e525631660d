"""Proves `--speculative-config method=mtp` is accepted for a Qwen3.5 checkpoint with its MTP head,
for GLM-4.7-Flash / DeepSeek-V3 and Nemotron-H checkpoints with their MTP layers, and for a Gemma 4
target with its MTP assistant, and refused at startup, by name, for a model without one, an
assistant for another target or one that does not fit its target, a Nemotron-H MTP pattern vLLM
does not build, and DSpark; a DFlash head is accepted beside a Qwen3 target and refused, by
name, where it does not fit (vLLM's own EngineArgs, the plugin as the platform)."""

from __future__ import annotations

import pytest

MTP = {"method": "mtp", "num_speculative_tokens": 2}


def _engine_config(model, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=256, **kwargs).create_engine_config()


def test_a_qwen3_5_checkpoint_with_its_head_drafts_with_it(tiny_qwen3_5_causal_lm_dir, tmp_path):
    from tests.fixtures.tiny_qwen3_5_mtp import add_mtp_head

    model = add_mtp_head(tiny_qwen3_5_causal_lm_dir, tmp_path / "mtp")
    config = _engine_config(model, speculative_config=MTP)
    assert config.speculative_config.method == "mtp"
    assert config.speculative_config.num_speculative_tokens == 2


def test_a_qwen3_5_checkpoint_without_mtp_layers_is_refused(tiny_qwen3_5_causal_lm_dir):
    with pytest.raises(ValueError, match=r"declares no MTP layers \(mtp_num_hidden_layers\)"):
        _engine_config(tiny_qwen3_5_causal_lm_dir, speculative_config=MTP)


def test_a_hybrid_family_without_a_head_is_refused(tiny_qwen3_next_dir):
    with pytest.raises(
        ValueError,
        match=r"method='mtp' .* built for deepseek_v3, gemma4_text, glm4_moe_lite, kimi_k2, "
        r"nemotron_h, qwen3_5_moe_text, qwen3_5_text, not for",
    ):
        _engine_config(tiny_qwen3_next_dir, speculative_config=MTP)


def _assistant_spec(assistant) -> dict:
    return {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def gemma4_assistant(tiny_gemma4_dir, tmp_path_factory):
    from tests.fixtures.tiny_gemma4_mtp import write_assistant

    return write_assistant(tiny_gemma4_dir, tmp_path_factory.mktemp("assistant") / "a")


def test_a_gemma4_target_drafts_with_its_assistant(tiny_gemma4_dir, gemma4_assistant):
    """Over an fp8 cache too: the assistant keeps no K/V of its own."""
    spec = _assistant_spec(gemma4_assistant)
    config = _engine_config(tiny_gemma4_dir, speculative_config=spec, kv_cache_dtype="fp8")
    assert config.speculative_config.method == "mtp"
    assert config.speculative_config.use_gemma4_mtp()
    assert config.cache_config.cache_dtype == "fp8"


def test_a_gemma4_assistant_for_another_target_is_refused(tiny_model_dir, gemma4_assistant):
    with pytest.raises(
        ValueError, match=r"is an MTP drafter \(gemma4_mtp\) for gemma4_text targets, not for"
    ):
        _engine_config(
            tiny_model_dir("qwen3"), speculative_config=_assistant_spec(gemma4_assistant)
        )


def test_an_assistant_that_does_not_fit_its_gemma4_target_is_refused(tiny_gemma4_dir, tmp_path):
    """The assistant of a wider target (its `backbone_hidden_size`)."""
    import json

    from tests.fixtures.tiny_gemma4_mtp import write_assistant

    assistant = write_assistant(tiny_gemma4_dir, tmp_path / "a")
    config = json.loads((assistant / "config.json").read_text())
    (assistant / "config.json").write_text(json.dumps({**config, "backbone_hidden_size": 128}))
    with pytest.raises(
        ValueError, match="backbone_hidden_size 128 is not the target's hidden_size 64"
    ):
        _engine_config(tiny_gemma4_dir, speculative_config=_assistant_spec(assistant))


def test_dspark_is_refused_by_name(tiny_gemma4_dir, gemma4_assistant):
    """DSpark drafters (Gemma4DSparkForCausalLM among them) are not built."""
    spec = {**_assistant_spec(gemma4_assistant), "method": "dspark"}
    with pytest.raises(ValueError, match=r"method=.dspark. is not supported .* DSpark block"):
        _engine_config(tiny_gemma4_dir, speculative_config=spec)


def test_mla_checkpoints_with_their_mtp_layer_draft_with_it(tiny_glm4_moe_lite_dir, tmp_path):
    """GLM-4.7-Flash (and DeepSeek-V3, the same module: its draft is vLLM's `deepseek_mtp`); an
    MLA target's speculation is its own MTP layer's, n-gram is refused by name."""
    from tests.fixtures.tiny_deepseek_mtp import add_mtp_layer

    model = add_mtp_layer(tiny_glm4_moe_lite_dir, tmp_path / "mtp")
    config = _engine_config(model, speculative_config=MTP)
    assert config.speculative_config.draft_model_config.hf_config.model_type == (
        "glm4_moe_lite_mtp"
    )
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    with pytest.raises(ValueError, match=r"method='ngram' is not supported with multi-head latent"):
        _engine_config(model, speculative_config=ngram)


def test_an_mla_checkpoint_without_mtp_layers_is_refused(tiny_glm4_moe_lite_dir):
    with pytest.raises(
        ValueError,
        match=r"declares no MTP layers \(num_nextn_predict_layers\); serve it without drafts",
    ):
        _engine_config(tiny_glm4_moe_lite_dir, speculative_config=MTP)


def _nemotron_h_with_mtp(src, out, **fields):
    import json

    from tests.fixtures.tiny_nemotron_h_mtp import add_mtp_step

    model = add_mtp_step(src, out)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **fields}))
    return model


def test_a_nemotron_h_checkpoint_with_its_mtp_step_drafts_with_it(tiny_nemotron_h_dir, tmp_path):
    config = _engine_config(
        _nemotron_h_with_mtp(tiny_nemotron_h_dir, tmp_path / "mtp"), speculative_config=MTP
    )
    assert config.speculative_config.draft_model_config.hf_config.model_type == "nemotron_h_mtp"


def test_a_nemotron_h_mtp_pattern_not_built_is_refused(tiny_nemotron_h_dir, tmp_path):
    """Two attention blocks in the MTP step (vLLM builds '*' and 'E' blocks; here one '*')."""
    model = _nemotron_h_with_mtp(
        tiny_nemotron_h_dir, tmp_path / "mtp", mtp_hybrid_override_pattern="*E*E"
    )
    with pytest.raises(ValueError, match=r"its MTP pattern '\*E\*E' is not served"):
        _engine_config(model, speculative_config=MTP)


def test_kimi_k2_with_mtp_layers_is_refused_by_vllm(tiny_deepseek_v3_dir, tmp_path):
    """vLLM 0.32 maps only deepseek_v3 (not kimi_k2) to its DeepSeek MTP drafter and refuses the
    method before the platform sees it; were that to change, `deepseek_mtp` would serve Kimi K2
    untested by the engine tests."""
    import json

    from tests.fixtures.tiny_deepseek_mtp import add_mtp_layer

    model = add_mtp_layer(tiny_deepseek_v3_dir, tmp_path / "kimi_k2")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    with pytest.raises(NotImplementedError, match=r"Unsupported speculative method: 'mtp'"):
        _engine_config(model, speculative_config=MTP)


def _eagle3_spec(head, method="eagle3") -> dict:
    return {"method": method, "model": str(head), "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def eagle3_target(tiny_model_dir):
    return tiny_model_dir("qwen3", hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_qwen3_target_drafts_with_an_eagle3_head(eagle3_target, tmp_path, arch):
    """vLLM reads the head as its EAGLE-3 architecture; async scheduling stays on."""
    from tests.fixtures.tiny_eagle3 import write_eagle3_head

    head = write_eagle3_head(eagle3_target, tmp_path / arch, arch=arch)
    config = _engine_config(eagle3_target, speculative_config=_eagle3_spec(head))
    spec = config.speculative_config
    assert spec.method == "eagle3"
    assert spec.draft_model_config.architectures[0] == (
        "LlamaForCausalLMEagle3" if arch == "llama" else "Eagle3Qwen3ForCausalLM"
    )
    assert config.scheduler_config.async_scheduling is True


def test_an_eagle3_head_beside_an_unbuilt_target_is_refused(tiny_model_dir, tmp_path):
    from tests.fixtures.tiny_eagle3 import write_eagle3_head

    target = tiny_model_dir("olmo2", hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64)
    head = write_eagle3_head(target, tmp_path / "h")
    with pytest.raises(ValueError, match=r"method='eagle3' .* kept for llama, .* not 'olmo2'"):
        _engine_config(target, speculative_config=_eagle3_spec(head))


def test_an_eagle3_head_with_other_kv_heads_is_refused(eagle3_target, tmp_path):
    import json

    from tests.fixtures.tiny_eagle3 import write_eagle3_head

    head = write_eagle3_head(eagle3_target, tmp_path / "h")
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))
    with pytest.raises(ValueError, match="K/V heads or head size differ from the target's"):
        _engine_config(eagle3_target, speculative_config=_eagle3_spec(head))


def _dflash_head(target, out, **config_fields):
    import json

    from tests.fixtures.tiny_dflash import write_dflash_head

    head = write_dflash_head(target, out)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, **config_fields}))
    return head


def test_a_qwen3_target_drafts_with_a_dflash_head(eagle3_target, tmp_path):
    """vLLM reads the head as `DFlashDraftModel` with parallel drafting; async scheduling stays
    on."""
    head = _dflash_head(eagle3_target, tmp_path / "h")
    config = _engine_config(eagle3_target, speculative_config=_eagle3_spec(head, "dflash"))
    spec = config.speculative_config
    assert spec.method == "dflash"
    assert spec.draft_model_config.architectures[0] == "DFlashDraftModel"
    assert spec.parallel_drafting is True
    assert config.scheduler_config.async_scheduling is True


_SWA = {"mask_token_id": 5, "target_layer_ids": [0, 1], "use_swa": True, "swa_window_size": 8}


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        ({"dflash_config": _SWA}, "sliding-window DFlash layers"),
        ({"num_key_value_heads": 1}, "K/V heads or head size differ from the target's"),
        (
            {"dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 7]}},
            r"aux layer ids \[1, 8\] are outside the target's 0..2",
        ),
    ],
)
def test_unfit_dflash_heads_are_refused(eagle3_target, tmp_path, fields, refusal):
    head = _dflash_head(eagle3_target, tmp_path / "h", **fields)
    with pytest.raises(ValueError, match=rf"method='dflash' .*{refusal}"):
        _engine_config(eagle3_target, speculative_config=_eagle3_spec(head, "dflash"))


def test_a_dflash_head_beside_an_unbuilt_target_is_refused(tiny_model_dir, tmp_path):
    target = tiny_model_dir("olmo2", hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64)
    head = _dflash_head(target, tmp_path / "h")
    with pytest.raises(ValueError, match=r"method='dflash' .* kept for llama, .* not 'olmo2'"):
        _engine_config(target, speculative_config=_eagle3_spec(head, "dflash"))


def test_a_dflash_head_beside_a_turboquant_cache_is_refused(eagle3_target, tmp_path):
    """A DFlash block attends over its context both ways, which the TurboQuant read does not
    take; fp8 and per-token-head caches serve it (tests/backends/mlx/runner/test_dflash.py)."""
    head = _dflash_head(eagle3_target, tmp_path / "h")
    spec = _eagle3_spec(head, "dflash")
    with pytest.raises(ValueError, match=r"method='dflash' .* --kv-cache-dtype turboquant_k8v4"):
        _engine_config(eagle3_target, speculative_config=spec, kv_cache_dtype="turboquant_k8v4")
    config = _engine_config(eagle3_target, speculative_config=spec, kv_cache_dtype="fp8")
    assert config.cache_config.cache_dtype == "fp8"
