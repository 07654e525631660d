"""Patches of vLLM's adapter routes in the API server (`OpenAIServingModels`), applied when
`--enable-lora` is set on this platform:

- `/v1/unload_lora_adapter` only forgets the name in the front end; here it also asks the
  workers to remove the adapter (`engine_client.remove_lora`), so its memory is freed. A
  request already running with it reads it again from its path, as after an LRU eviction.
- `/v1/load_lora_adapter` answers 500 for every adapter the workers refuse; an adapter this
  model cannot serve (its rank above `--max-lora-rank`, modules the model lacks, shapes of
  another model, embedding or head deltas: the runner's `AdapterError`) gets 400 instead.
  The engine core's exception reaches the API server as text only (no type survives the
  process boundary), so the refusal is told by the runner's own prefix, "LoRA adapter 'NAME':",
  inside vLLM's 500 (`ADAPTER_REFUSAL`; tests/compat checks vLLM still passes the text through).

Both wrap `OpenAIServingModels` methods and keep their behaviour otherwise.
"""

from __future__ import annotations

from functools import wraps
from http import HTTPStatus

from vllm_metal._logging import init_logger

logger = init_logger(__name__)

_INSTALLED = "_vllm_metal_lora_routes"
# How every refusal of the runner's adapter checks starts (`backends/mlx/runner/lora/`).
ADAPTER_REFUSAL = "LoRA adapter {name!r}:"


def install() -> None:
    try:
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    except ImportError:  # an install without the server
        return
    if getattr(OpenAIServingModels, _INSTALLED, False):
        return
    OpenAIServingModels.load_lora_adapter = _refusals_as_400(OpenAIServingModels.load_lora_adapter)
    OpenAIServingModels.unload_lora_adapter = _remove_from_workers(
        OpenAIServingModels.unload_lora_adapter
    )
    setattr(OpenAIServingModels, _INSTALLED, True)


def _refusals_as_400(load):
    from vllm.entrypoints.serve import create_error_response
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    @wraps(load)
    async def load_lora_adapter(self, request, *args, **kwargs):
        response = await load(self, request, *args, **kwargs)
        if (
            isinstance(response, ErrorResponse)
            and response.error.code == HTTPStatus.INTERNAL_SERVER_ERROR
            and ADAPTER_REFUSAL.format(name=request.lora_name) in response.error.message
        ):
            return create_error_response(
                message=response.error.message,
                err_type="BadRequestError",
                status_code=HTTPStatus.BAD_REQUEST,
            )
        return response

    return load_lora_adapter


def _remove_from_workers(unload):
    @wraps(unload)
    async def unload_lora_adapter(self, request, *args, **kwargs):
        known = self.lora_requests.get(request.lora_name)
        response = await unload(self, request, *args, **kwargs)
        if known is not None and request.lora_name not in self.lora_requests:
            await self.engine_client.remove_lora(known.lora_int_id)
            logger.info("Removed LoRA adapter %r from the workers", request.lora_name)
        return response

    return unload_lora_adapter
