"""The startup self-check of architectures this project does not verify.

mlx-lm implements many more decoders than the plugin checks against transformers
(`families.verified`); the MLX runner serves the others through the generic adapter. Loading the
model, the profiling run's dummy prefill and the warm-up's dummy prefills and decode step (a
prefill crossing a block, then a token reading the cached K/V back) run before vLLM says the
engine is ready, through the KV layout and layer kinds the model declares. Where one of them fails
for an unverified architecture (a config key mlx-lm reads under another name, attention outside
`scaled_dot_product_attention`, a layer whose K/V shape the kinds do not know), the engine is
refused at startup with an `UnverifiedModelError` naming the architecture, the stage and the cause,
instead of a bare traceback. A verified family's failure is a bug and propagates as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@contextmanager
def startup_stage(vllm_config: VllmConfig, stage: str) -> Iterator[None]:
    """Run one startup stage (`stage` says what it does) of the model `vllm_config` serves."""
    try:
        yield
    except Exception as error:
        from vllm_metal.models.families import verified

        model = vllm_config.model_config
        model_type = getattr(model.hf_config, "model_type", None)
        text_type = getattr(model.hf_text_config, "model_type", None)
        if verified(model_type) or verified(text_type):
            raise
        architecture = (getattr(model.hf_config, "architectures", None) or ["?"])[0]
        raise UnverifiedModelError(
            f"vllm-metal: model={model.model!r} ({model_type or text_type}, {architecture}) is "
            f"an architecture vllm-metal does not verify, and {stage} failed at startup: "
            f"{type(error).__name__}: {error}. Serve one of the families in docs/models.md, or "
            "a checkpoint of this architecture whose config mlx-lm reads as it is"
        ) from error


class UnverifiedModelError(ValueError):
    """An architecture the project does not verify failed a startup stage (a `ValueError`, so
    vLLM reports it as a bad argument, as the platform's refusals are)."""
