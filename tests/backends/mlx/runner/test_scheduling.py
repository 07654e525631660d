"""Scheduler-driven paths: preemption and resume, prompt logprobs over chunks, grammar bitmasks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import greedy, random_prompts, run_engine_job, tokens
from vllm_metal.testing.oracles import hf_greedy, hf_logprobs

pytestmark = pytest.mark.slow


def test_preempted_requests_resume_with_identical_tokens(tiny_model_dir):
    """A KV pool of 32 blocks cannot hold six 124-token sequences: vLLM preempts and recomputes,
    and every request still gets exactly the transformers greedy continuation."""
    model = tiny_model_dir("qwen3")
    prompts = random_prompts(7, [60] * 6)
    # float32, 2 layers x 2 KV heads x 64 dims: 32 KiB per 16-token block -> 32 blocks.
    engine = {
        "kv_cache_memory_bytes": 32 * 32 * 2**10,
        "max_model_len": 256,
        "disable_log_stats": False,
    }
    results, metrics = run_engine_job(
        model, [{"prompts": prompts, "params": [greedy(64)]}], engine=engine, with_metrics=True
    )
    assert metrics.get("vllm:num_preemptions", 0) > 0, metrics
    assert tokens(results[0]) == hf_greedy(model, prompts, 64)


def test_prompt_logprobs_across_prefill_chunks(tiny_model_dir):
    model = tiny_model_dir("llama")
    prompts = random_prompts(8, [5, 37])
    params = [greedy(2, prompt_logprobs=2)]
    (batch,) = run_engine_job(
        model, [{"prompts": prompts, "params": params}], engine={"max_num_batched_tokens": 16}
    )
    for prompt, result in zip(prompts, batch):
        plp = result["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(prompt)
        ref = hf_logprobs(model, prompt)
        for pos in range(1, len(prompt)):
            entry = plp[pos]
            # The prompt token itself plus the top-2 alternatives.
            assert str(prompt[pos]) in entry and len(entry) >= 2
            assert abs(entry[str(prompt[pos])] - ref[pos - 1, prompt[pos]]) < 1e-3
            top = np.argsort(-ref[pos - 1])[:2]
            for t in top:
                assert abs(entry[str(int(t))] - ref[pos - 1, t]) < 1e-3


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


# Structured outputs run vLLM's grammar bitmask on either backend's logits.
@pytest.mark.parametrize("env", [{}, {"VLLM_METAL_BACKEND": "mps"}], ids=["mlx", "mps"])
def test_grammar_bitmask_constrains_random_model(tiny_model_dir, env):
    import jsonschema

    model = tiny_model_dir("qwen3")
    jobs = [
        {
            "prompts": ["Person:"] * 2,
            "params": [
                {
                    "max_tokens": 200,
                    "temperature": 0.8,
                    "seed": 3,
                    "structured_outputs": {"json": SCHEMA},
                }
            ],
        },
        {
            "prompts": ["Pick:"],
            "params": [
                {
                    "max_tokens": 8,
                    "temperature": 1.0,
                    "seed": 5,
                    "structured_outputs": {"choice": ["red", "blue"]},
                }
            ],
        },
        {
            "prompts": ["Code:"],
            "params": [
                {
                    "max_tokens": 12,
                    "temperature": 1.0,
                    "seed": 6,
                    "structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"},
                }
            ],
        },
    ]
    as_json, choice, regex = run_engine_job(
        model,
        jobs,
        engine={
            "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}
        },
        env=env,
    )
    for r in as_json:
        assert r["outputs"][0]["finish_reason"] == "stop", r["outputs"][0]
        jsonschema.validate(json.loads(r["outputs"][0]["text"]), SCHEMA)
    assert choice[0]["outputs"][0]["text"] in ("red", "blue")
    import re

    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", regex[0]["outputs"][0]["text"])
