"""Proves `--speculative-config method=mtp` is accepted for a Qwen3.5 checkpoint with its MTP head
and refused at startup, by name, for a model without one (vLLM's own EngineArgs, the plugin as
the platform)."""

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
        ValueError, match=r"method='mtp' .* built for qwen3_5_moe_text, qwen3_5_text"
    ):
        _engine_config(tiny_qwen3_next_dir, speculative_config=MTP)
