"""The startup self-check of architectures this project does not verify.

mlx-lm implements many more decoders than the plugin checks against transformers
(`families.verified`); the MLX runner serves the others through the generic adapter. Loading the
model, the profiling run's dummy prefill and the warm-up's dummy prefills and decode step (a
prefill crossing a block, then a token reading the cached K/V back) run before vLLM says the
engine is ready, through the KV layout and layer kinds the model declares. Where one of them fails
for an unverified architecture (a config key mlx-lm reads under another name, attention outside
`scaled_dot_product_attention`, a layer whose K/V shape the kinds do not know), the engine is
refused at startup with a `MetalConfigError` naming the architecture, the stage and the cause,
instead of a bare traceback. A verified family's failure is a bug and propagates as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from vllm_metal.config.errors import MetalConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@contextmanager
def startup_stage(vllm_config: VllmConfig, stage: str) -> Iterator[None]:
    """Run one startup stage (`stage` says what it does) of the model `vllm_config` serves."""
    try:
        yield
    except MetalConfigError:
        raise
    except Exception as error:
        from vllm_metal.config.kinds import model_label, model_type
        from vllm_metal.models.families import verified

        if verified(model_type(vllm_config)) or verified(model_type(vllm_config, text=True)):
            raise
        raise MetalConfigError(
            f"vllm-metal: {model_label(vllm_config)} is an architecture vllm-metal does not "
            f"verify, and {stage} failed at startup: {type(error).__name__}: {error}. "
            "Serve one of the families in docs/models.md, or a checkpoint of this architecture "
            "whose config mlx-lm reads as it is"
        ) from error
