"""Sleep mode frees MLX memory (KV cache at level 1, weights too at level 2, the KV cache alone on
`release_kv_cache_memory`) and wakes up intact; the worker answers the RPCs vLLM's engine makes
for drafts and KV connectors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=16 * 2**20, enable_sleep_mode=True)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        prompt = {"prompt_token_ids": list(range(20, 60))}
        mem = lambda: llm.collective_rpc("memory_usage")[0]
        out = {"awake": mem()}
        out["first"] = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
        llm.sleep(level=1)
        out["level1"] = mem()
        llm.wake_up()
        out["after_level1"] = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
        llm.sleep(level=2)
        out["level2"] = mem()
        llm.wake_up()
        out["woken"] = mem()
        out["after_level2"] = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
        llm.sleep(level=0)
        llm.release_kv_cache_memory()
        out["released"] = mem()
        llm.wake_up(tags=["kv_cache"])
        llm.wake_up(tags=["scheduling"])
        out["after_release"] = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
        out["drafts"] = llm.collective_rpc("take_draft_token_ids")
        out["handshake"] = llm.collective_rpc("get_kv_connector_handshake_metadata")
        print("RESULT" + json.dumps(out))
    """
)


def test_sleep_frees_memory_and_wakes_up(tiny_model_dir, tmp_path):
    model = tiny_model_dir("qwen3")
    script = tmp_path / "sleep_job.py"
    script.write_text(SCRIPT)
    # The script runs no MLX before building the engine: forking its engine core is safe.
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    proc = subprocess.run(
        [sys.executable, str(script), str(model)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, proc.stderr[-4000:]
    out = json.loads(line[len("RESULT") :])
    awake, level1, level2 = out["awake"], out["level1"], out["level2"]
    assert awake["kv_cache"] == 16 * 2**20 and awake["weights"] > 0
    assert level1["kv_cache"] == 0 and level1["weights"] == awake["weights"]
    assert awake["active"] - level1["active"] >= awake["kv_cache"] * 0.9
    assert level2["weights"] == 0
    assert awake["active"] - level2["active"] >= (awake["kv_cache"] + awake["weights"]) * 0.9
    assert out["woken"]["kv_cache"] == awake["kv_cache"]
    assert out["first"] == out["after_level1"] == out["after_level2"] == out["after_release"]
    released = out["released"]
    assert released["kv_cache"] == 0 and released["weights"] == awake["weights"]
    assert awake["active"] - released["active"] >= awake["kv_cache"] * 0.9
    assert out["drafts"] == [None]  # no speculative decoding configured
    assert out["handshake"] == [None]  # no KV connector
