"""Helpers to run engine jobs (tests/backends/mlx/runner/engine_job.py) in subprocesses and read their results."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

JOB_SCRIPT = Path(__file__).with_name("engine_job.py")
# The job script imports image and audio fixtures as tests.fixtures, from the repository root.
REPO_ROOT = Path(__file__).resolve().parents[4]

# Small, explicit memory settings: the defaults reserve most of the machine's RAM.
ENGINE_DEFAULTS = {
    "dtype": "float32",
    "max_model_len": 512,
    "kv_cache_memory_bytes": 64 * 2**20,
    "max_num_seqs": 16,
    "seed": 0,
}


# An in-process engine with compiled decode steps (`runner/compiled.py`, the default on a Mac's
# GPU, not on the CPU): the runner's count of them can be read with {"action": "compiled_steps"}.
COMPILED_ENV = {"VLLM_METAL_COMPILE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run_engine_job(
    model: str | Path,
    jobs: list[dict],
    *,
    engine: dict | None = None,
    backend: str = "metal",
    timeout: float = 600,
    with_metrics: bool | str = False,
    env: dict[str, str] | None = None,
) -> list[list[dict]] | tuple[list[list[dict]], dict]:
    """Run `jobs` on one engine in a fresh process; backend 'metal' (this plugin) or 'cpu'.

    with_metrics=True also returns the engine's counters at the end (engine option
    disable_log_stats=False), "per_job" a list of them, one after each job.
    """
    # The job script runs no MLX before it builds the engine, so forking its engine core is
    # safe, and ~10 s quicker than the spawn the plugin picks for scripts; a caller's `env` may
    # ask for spawn. Not inherited: the plugin sets the variable in a test process it activates.
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "fork", **(env or {})}
    env.pop("VLLM_TARGET_DEVICE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if backend == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        # vLLM's CPU backend reserves a fraction of RAM instead of honouring the KV byte count.
    spec = {"model": str(model), "engine": {**ENGINE_DEFAULTS, **(engine or {})}, "jobs": jobs}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        out_path = Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, str(JOB_SCRIPT), str(spec_path), str(out_path)],
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(
                f"engine job ({backend}) failed with exit code {proc.returncode}:\n"
                f"{proc.stderr[-6000:]}"
            )
        out = json.loads(out_path.read_text())
        if with_metrics == "per_job":
            return out["results"], out["job_metrics"]
        return (out["results"], out["metrics"]) if with_metrics else out["results"]


def plain_and_drafted(
    model: str | Path, jobs: list[dict], speculative_config: dict, engine: dict
) -> tuple[list[list[dict]], list[list[dict]], dict]:
    """The jobs' results without speculation, with `speculative_config` drafting on every step
    (the back-off off), and the drafting engine's metrics: two engines."""
    plain = run_engine_job(model, jobs, engine=engine)
    drafted, metrics = run_engine_job(
        model,
        jobs,
        engine={**engine, "disable_log_stats": False, "speculative_config": speculative_config},
        with_metrics=True,
        env={"VLLM_METAL_SPEC_BACKOFF": "0"},
    )
    return plain, drafted, metrics


@functools.cache
def _vllm_cpu_results(model: str, spec: str) -> str:
    return json.dumps(run_engine_job(model, json.loads(spec), backend="cpu"))


def vllm_cpu_job(model: str | Path, jobs: list[dict]) -> list[list[dict]]:
    """`jobs` on vLLM's own CPU backend, run once per session for the same model and jobs (the
    oracle several backends' tests compare with)."""
    return json.loads(_vllm_cpu_results(str(model), json.dumps(jobs)))


# A JSON schema a random model can be held to by a grammar (short name, bounded age).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def kv_block_bytes(model: str | Path, dtype_bytes: int = 4) -> int:
    """Bytes of one 16-token KV block over every layer of a tiny checkpoint (K and V): what
    `kv_cache_memory_bytes` pays per block, to size a pool that forces preemption."""
    config = json.loads((Path(model) / "config.json").read_text())
    config = config.get("text_config", config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * 16 * dtype_bytes


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Deterministic prompts of ordinary (non-special) token ids of the tiny tokenizer."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(16, 700, size=n).tolist() for n in lengths]


def greedy(max_tokens: int, **extra) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **extra}


def tokens(batch: list[dict]) -> list[list[int]]:
    """First sample's token ids of every request in a job result."""
    return [r["outputs"][0]["token_ids"] for r in batch]


def assert_logprobs_match_hf(model: str | Path, prompts: list[list[int]], batch: list[dict],
                             tol: float = 1e-3) -> None:  # fmt: skip
    """Each sampled token's logprob in `batch` (requests run with `logprobs=1`) is within `tol`
    of transformers float32's for that token after the prompt and the tokens before it."""
    from tests.fixtures.oracles import hf_logprobs

    for prompt, result in zip(prompts, batch):
        sample = result["outputs"][0]
        ref = hf_logprobs(model, prompt + sample["token_ids"])
        for step, token in enumerate(sample["token_ids"]):
            got = sample["logprobs"][step][str(token)]
            want = ref[len(prompt) - 1 + step, token]
            assert abs(got - want) < tol, (model, step, token, got, want)


def errors_and_shift(
    model: str | Path,
    prompts: list[list[int]],
    batch: list[dict],
    oracle: Callable[[list[int], list[int]], np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """Per token sampled in `batch` (requests run with `logprobs=1`): |engine logprob - the
    oracle's| (`oracle(prompt, ids)`: log-softmax rows of `ids`, the prompt and the sampled
    tokens) and |engine logprob - transformers float32's| (how far a cache format moves it)."""
    from tests.fixtures.oracles import hf_logprobs

    errors, moved = [], []
    for prompt, result in zip(prompts, batch):
        sample = result["outputs"][0]
        ids = prompt + sample["token_ids"]
        ref, plain = oracle(prompt, ids), hf_logprobs(model, ids)
        for step, token in enumerate(sample["token_ids"]):
            got, row = sample["logprobs"][step][str(token)], len(prompt) - 1 + step
            errors.append(abs(got - ref[row, token]))
            moved.append(abs(got - plain[row, token]))
    return np.asarray(errors), np.asarray(moved)
