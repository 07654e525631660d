"""Speculative decoding on the MLX runner (vLLM's `--speculative-config`).

Proposers (`ngram.py`: vLLM's n-gram proposer; `draft_model.py`: a smaller mlx-lm model with its
own paged KV; `mtp.py`: the target's own multi-token-prediction head; `assistant.py`: an MTP
assistant checkpoint over the target's K/V; `eagle3.py`: an EAGLE-3 head over the target's aux
hidden states; `dflash.py`: a DFlash head drafting a block at once from them) fill `take_draft_token_ids` after each step; the
scheduler sends the drafts back
as `scheduled_spec_decode_tokens`, and the runner verifies them as ordinary varlen query rows
(q_len = 1 + drafts) with vLLM's rejection sampler (`verify.py`, kernels in `kernels.py`).
`backoff.py` stops drafting where it does not pay; `decoder.py` ties the pieces together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_metal import envs
from vllm_metal.backends.mlx.runner.spec_decode.backoff import Backoff
from vllm_metal.backends.mlx.runner.spec_decode.decoder import SpecDecoder

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.sample.sampler import Sampler

    from vllm_metal.backends.mlx.runner.model_states import ModelState


def make_spec_decoder(
    vllm_config: VllmConfig,
    sampler: Sampler,
    target: ModelState,
) -> SpecDecoder | None:
    spec = vllm_config.speculative_config
    if spec is None:
        return None
    from vllm_metal.backends.mlx.runner.spec_decode.kernels import register_rejection_kernels

    register_rejection_kernels()
    if spec.method == "ngram":
        from vllm_metal.backends.mlx.runner.spec_decode.ngram import NgramDrafter

        drafter = NgramDrafter(vllm_config)
    elif spec.method == "draft_model":
        from vllm_metal.backends.mlx.runner.spec_decode.draft_model import DraftModelDrafter

        drafter = DraftModelDrafter(
            vllm_config,
            compute_dtype=target.compute_dtype,
            kv_dtype=target.mlx_kv_dtype,
            dequantize=target.dequantize,
        )
    elif spec.method == "mtp":
        from vllm_metal.models.families import mtp_module

        module = mtp_module(vllm_config.model_config.hf_text_config.model_type)
        if module is not None and not module.HEAD_IN_TARGET:
            from vllm_metal.backends.mlx.runner.spec_decode.assistant import AssistantDrafter

            drafter = AssistantDrafter(vllm_config, target)
        else:
            from vllm_metal.backends.mlx.runner.spec_decode.mtp import MTPDrafter

            drafter = MTPDrafter(vllm_config, target, kv_dtype=target.mlx_kv_dtype)
    elif spec.method == "eagle3":
        from vllm_metal.backends.mlx.runner.spec_decode.eagle3 import Eagle3Drafter

        drafter = Eagle3Drafter(vllm_config, target, kv_dtype=target.mlx_kv_dtype)
    elif spec.method == "dflash":
        from vllm_metal.backends.mlx.runner.spec_decode.dflash import DFlashDrafter

        drafter = DFlashDrafter(vllm_config, target, kv_dtype=target.mlx_kv_dtype)
    else:  # the platform refuses other methods at startup
        raise ValueError(f"speculative method {spec.method!r} is not supported by vllm-metal")
    return SpecDecoder(vllm_config, sampler, drafter, Backoff(enabled=envs.VLLM_METAL_SPEC_BACKOFF))
