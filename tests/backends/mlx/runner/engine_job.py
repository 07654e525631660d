"""Runs one vLLM engine job described by a JSON file and prints the results as JSON.

Tests start it as a subprocess so the plugin and vLLM's own CPU backend (VLLM_TARGET_DEVICE=cpu)
run the same job the same way, each in a clean process.
"""

from __future__ import annotations

import json
import os
import sys


def _decode_params(p: dict) -> dict:
    p = dict(p)
    if "logit_bias" in p:  # JSON object keys are strings; vLLM wants token ids
        p["logit_bias"] = {int(k): v for k, v in p["logit_bias"].items()}
    if "structured_outputs" in p:
        from vllm.sampling_params import StructuredOutputsParams

        p["structured_outputs"] = StructuredOutputsParams(**p["structured_outputs"])
    return p


def _counters(llm) -> dict:
    counters = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            counters[metric.name] = value
        elif isinstance(values := getattr(metric, "values", None), list):  # a labelled vector
            counters[metric.name] = values
    return counters


def _lora_request(entry):
    """[name, id, path] -> LoRARequest (None for the base model)."""
    if entry is None:
        return None
    from vllm.lora.request import LoRARequest

    name, lora_id, path = entry
    return LoRARequest(name, lora_id, path)


def _adapter_action(llm, job: dict) -> dict:
    """{"action": "add_lora" | "remove_lora" | "pin_lora", "lora": [name, id, path]}: the call's
    result (or its error) and the adapter ids the workers hold afterwards. {"action":
    "sleep_wake"}: sleep at level 2 and wake up."""
    engine = llm.llm_engine
    if job["action"] == "sleep_wake":  # level 2 frees the weights; wake-up reloads them
        llm.sleep(level=2)
        llm.wake_up()
        return {"loras": sorted(engine.list_loras())}
    request = _lora_request(job["lora"])
    try:
        if job["action"] == "add_lora":
            result = engine.add_lora(request)
        else:
            result = getattr(engine, job["action"])(request.lora_int_id)
        out = {"result": result}
    except Exception as e:  # noqa: BLE001 (the error is the result the test looks at)
        out = {"error": f"{type(e).__name__}: {e}"}
    out["loras"] = sorted(engine.list_loras())
    return out


def _pool(llm, job: dict) -> list[dict] | dict:
    """{"pool": "embed" | "classify" | "score" | "token_embed" | "token_classify", "prompts",
    "params" (PoolingParams fields), for "score" "query" and "documents"}: each request's pooled
    output as a list of floats (a score as [score]) and its cached tokens, or {"error": ...}
    when the API raises (a refused parameter)."""
    from vllm import PoolingParams

    task = job["pool"]
    params = PoolingParams(**job["params"]) if job.get("params") else None
    prompts = [
        {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}
        for p in job.get("prompts", [])
    ]
    try:
        if task == "score":
            outs = llm.score(job["query"], job["documents"], pooling_params=params, use_tqdm=False)
            return [{"data": [o.outputs.score]} for o in outs]
        if task == "embed":
            outs = llm.embed(prompts, pooling_params=params, use_tqdm=False)
            data = [o.outputs.embedding for o in outs]
        elif task == "classify":
            outs = llm.classify(prompts, pooling_params=params, use_tqdm=False)
            data = [o.outputs.probs for o in outs]
        else:
            outs = llm.encode(prompts, params, pooling_task=task, use_tqdm=False)
            data = [o.outputs.data.tolist() for o in outs]
    except Exception as e:  # noqa: BLE001 (the error is the result the test looks at)
        return {"error": f"{type(e).__name__}: {e}"}
    return [{"data": d, "num_cached_tokens": o.num_cached_tokens} for d, o in zip(data, outs)]


def _corrupt_files(pattern: str) -> dict:
    """{"action": "corrupt_files", "glob": pattern}: flip one byte near the end of every file
    matching `pattern` (recursive), as a failing disk would; the number of files touched."""
    import glob

    paths = glob.glob(pattern, recursive=True)
    for path in paths:
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    return {"corrupted": len(paths)}


def _record_drafts(llm) -> list:
    """Record every draft list the in-process engine's drafter proposes from now on, as
    [tokens it follows, drafts] (cut at the row's cap, as the runner cuts them), where the
    runner keeps them for vLLM (`SpecDecoder._keep`, also for drafts proposed on the device
    behind their step), wrapped."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    spec = runner.output.spec
    keep = spec._keep
    recorded: list = []

    def recording(req_ids, drafts):
        for req_id, row in zip(req_ids, drafts):
            state = runner.states.requests.get(req_id)
            if row and state is not None:
                context = [*state.prompt_token_ids, *state.output_token_ids]
                recorded.append([context, list(row)])
        return keep(req_ids, drafts)

    spec._keep = recording
    return recorded


def _prompt(p):
    """Text, token ids, {"prompt": text, "images": [[seed, width, height], ...]}: images of
    `tests.fixtures.tiny_idefics3.tiny_image` for the prompt's `<image>` markers (or
    "prompt_token_ids" for "prompt": ids with the markers unexpanded), or
    {"audio": [seed, seconds], "decoder_prompt": text}: a clip of
    `tests.fixtures.tiny_whisper.audio_clip` as an encoder-decoder prompt, or
    {"prompt": text, "audios": [[seed, seconds], ...]}: such clips for a decoder prompt's audio
    placeholders."""
    if isinstance(p, str):
        return {"prompt": p}
    if isinstance(p, dict) and "images" in p:
        from tests.fixtures.tiny_idefics3 import tiny_image

        images = [tiny_image(seed, (width, height)) for seed, width, height in p["images"]]
        if "prompt_token_ids" in p:  # token ids holding the unexpanded `<image>` markers
            return {
                "prompt_token_ids": p["prompt_token_ids"],
                "multi_modal_data": {"image": images},
            }
        return {"prompt": p["prompt"], "multi_modal_data": {"image": images}}
    if isinstance(p, dict) and "audios" in p:
        from tests.fixtures.tiny_whisper import SAMPLE_RATE, audio_clip

        clips = [(audio_clip(seed, seconds), SAMPLE_RATE) for seed, seconds in p["audios"]]
        return {"prompt": p["prompt"], "multi_modal_data": {"audio": clips}}
    if isinstance(p, dict):
        from tests.fixtures.tiny_whisper import SAMPLE_RATE, audio_clip

        clip = audio_clip(*p["audio"])
        return {
            "encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (clip, SAMPLE_RATE)}},
            "decoder_prompt": p["decoder_prompt"],
        }
    return {"prompt_token_ids": p}


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], **spec.get("engine", {}))
    stats_on = not spec.get("engine", {}).get("disable_log_stats", True)
    results, snapshots = [], []  # snapshots: the engine's counters after each job
    drafts: list | None = None
    for job in spec["jobs"]:
        if job.get("action") == "record_drafts":  # from here on
            drafts = _record_drafts(llm)
            results.append(True)
            continue
        if job.get("action") == "recorded_drafts":  # those since the last such action
            results.append(list(drafts))
            drafts.clear()
            continue
        if job.get("action") == "corrupt_files":
            results.append(_corrupt_files(job["glob"]))
            continue
        if job.get("action") == "compiled_steps":  # an in-process engine's compiled decode steps
            state = llm.llm_engine.model_executor.driver_worker.worker.model_runner.state
            results.append(0 if state.compiled is None else state.compiled.steps)
            continue
        if job.get("action") == "compiled_verify_steps":  # of which verifying drafts
            state = llm.llm_engine.model_executor.driver_worker.worker.model_runner.state
            results.append(0 if state.compiled is None else state.compiled.verify_steps)
            continue
        if job.get("action") in ("compiled_chains", "chain_traces"):  # a head drafter's chains
            spec = llm.llm_engine.model_executor.driver_worker.worker.model_runner.output.spec
            chain = None if spec is None else getattr(spec.drafter, "chain", None)
            count = "steps" if job["action"] == "compiled_chains" else "traces"
            results.append(0 if chain is None else getattr(chain, count))
            continue
        if job.get("action") == "queued_proposals":  # a head's, queued behind their step
            spec = llm.llm_engine.model_executor.driver_worker.worker.model_runner.output.spec
            drafter = None if spec is None else spec.drafter
            results.append([getattr(drafter, "queued", 0), getattr(drafter, "dropped", 0)])
            continue
        if job.get("action") == "verified_on_device":  # steps whose drafts the device verified
            output = llm.llm_engine.model_executor.driver_worker.worker.model_runner.output
            results.append(output.verified_on_device)
            continue
        if job.get("action") == "carried_steps":  # steps whose tokens stayed on the device
            output = llm.llm_engine.model_executor.driver_worker.worker.model_runner.output
            results.append(output.pipeline.carried_steps)
            continue
        if job.get("action") == "memory_usage":  # every worker's (each pipeline stage's)
            results.append(llm.collective_rpc("memory_usage"))
            continue
        if job.get("action") == "async_scheduling":  # what the engine runs with, after startup
            results.append(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
            continue
        if "action" in job:
            results.append(_adapter_action(llm, job))
            continue
        if "pool" in job:
            results.append(_pool(llm, job))
            continue
        params = [SamplingParams(**_decode_params(p)) for p in job["params"]]
        prompts = [_prompt(p) for p in job["prompts"]]
        loras = [_lora_request(e) for e in job.get("loras", [])] or None
        outs = llm.generate(
            prompts,
            params if len(params) > 1 else params[0],
            use_tqdm=False,
            lora_request=loras,
        )
        batch = []
        for out in outs:
            samples = []
            for c in out.outputs:
                lp = None
                if c.logprobs is not None:
                    lp = [{str(t): v.logprob for t, v in d.items()} for d in c.logprobs]
                samples.append(
                    {
                        "token_ids": list(c.token_ids),
                        "text": c.text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                    }
                )
            plp = None
            if out.prompt_logprobs is not None:
                plp = [
                    None if d is None else {str(t): v.logprob for t, v in d.items()}
                    for d in out.prompt_logprobs
                ]
            batch.append(
                {
                    "outputs": samples,
                    "prompt_logprobs": plp,
                    "num_cached_tokens": out.num_cached_tokens,
                }
            )
        results.append(batch)
        if stats_on:
            snapshots.append(_counters(llm))
    llm.llm_engine.engine_core.shutdown()  # stops the engine core process now
    return {
        "results": results,
        "metrics": snapshots[-1] if snapshots else {},
        "job_metrics": snapshots,
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    # The engine is shut down and the results are written. The front-end process of a pooling
    # engine sometimes aborts in interpreter teardown ("terminate called without an active
    # exception", after every Python frame is gone; cause not found), so it ends here without
    # running C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
