"""Proves every entry of `vllm_metal.compat.PATCHES` still finds its target with the parameters it
was written against, and that the text the adapter-route patch matches is still what vLLM passes
from the engine to the API server, so a vLLM or mlx-lm bump fails here first; and that the check
rejects an entry that no longer holds."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from http import HTTPStatus
from types import SimpleNamespace

import pytest

from vllm_metal.compat import PATCHES, Patch, problems, resolve


@pytest.mark.parametrize("patch", PATCHES, ids=[p.target for p in PATCHES])
def test_the_target_is_as_it_was_written_against(patch: Patch) -> None:
    assert problems(patch) == []
    assert patch.why and patch.written_for and patch.remove_when
    assert resolve(patch.where) is not None  # the code that patches it is where it says


def test_the_check_rejects_a_changed_signature_and_a_missing_target() -> None:
    entry = next(p for p in PATCHES if p.target.endswith("maybe_override_with_speculators"))
    (changed,) = problems(replace(entry, params=("model", "tokenizer")))
    assert "written against ('model', 'tokenizer')" in changed
    (missing,) = problems(replace(entry, target="vllm.engine.arg_utils.no_such_function"))
    assert "not found" in missing
    (module,) = problems(replace(entry, target="vllm.no_such_module.f"))
    assert "not found" in module


def test_each_target_has_one_entry() -> None:
    targets = [p.target for p in PATCHES]
    assert len(targets) == len(set(targets))


def _refusal(name: str) -> str:
    from vllm_metal.compat.openai_routes import ADAPTER_REFUSAL

    return ADAPTER_REFUSAL.format(name=name) + " module 'x' is not a linear projection"


def test_the_engine_core_passes_a_refusal_text_through() -> None:
    """The runner's AdapterError crosses to the API server as text only: vLLM's engine core puts
    `str(e)` into the failure message the client raises as a plain Exception."""
    from vllm.v1.engine import UtilityOutput
    from vllm.v1.engine.core import EngineCoreProc

    def fail():
        raise ValueError(_refusal("a"))

    output = UtilityOutput(call_id=0)
    EngineCoreProc._invoke_utility_method("add_lora", fail, output, lambda out: None)
    assert _refusal("a") in output.failure_message


def _serving_models(add_lora):
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    client = SimpleNamespace(
        model_config=None, renderer=None, input_processor=None, add_lora=add_lora
    )
    return OpenAIServingModels(client, [BaseModelPath(name="base", model_path="base")])


def test_vllm_answers_that_text_with_a_500_and_the_patch_makes_it_a_400() -> None:
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    from vllm_metal.compat import openai_routes

    async def add_lora(request):
        raise RuntimeError(f"Call to add_lora method failed: {_refusal(request.lora_name)}")

    models = _serving_models(add_lora)
    request = LoadLoRAAdapterRequest(lora_name="a", lora_path="/nowhere")
    patched = OpenAIServingModels.load_lora_adapter
    vllms = getattr(patched, "__wrapped__", patched)
    response = asyncio.run(vllms(models, request))
    assert response.error.code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert _refusal("a") in response.error.message
    openai_routes.install()
    response = asyncio.run(OpenAIServingModels.load_lora_adapter(models, request))
    assert response.error.code == HTTPStatus.BAD_REQUEST
