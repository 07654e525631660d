"""Proves the worker keeps to its side of the seams: it sizes the KV cache from what the backend and
the runner report (the explicit size, the utilization budget, the one-request refusal), and passes
sleep, discard, LoRA and lifecycle calls through the `ModelRunner` protocol unchanged, and keeps
a step's async output from being read while the next step runs, in
milliseconds: a stub backend and a stub runner stand in for the device, vLLM's config is real."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import AsyncModelRunnerOutput

from vllm_metal.backends.protocol import RunnerMemory
from vllm_metal.worker import HEADROOM_BYTES, MetalWorker

GIB = 2**30
BLOCK = 16


class StubBackend:
    """The device facts a test chooses; records what the worker asks of it."""

    name = "stub"

    def __init__(self, total: int = 4 * GIB, active: list[int] | None = None):
        self.total = total
        self.active = list(active or [0])  # successive answers of active_memory_bytes()
        self.calls: list[tuple] = []

    def total_memory_bytes(self) -> int:
        return self.total

    def active_memory_bytes(self) -> int:
        return self.active.pop(0) if len(self.active) > 1 else self.active[0]

    def release_cached_memory(self) -> None:
        self.calls.append(("release",))

    def seed(self, seed: int) -> None:
        self.calls.append(("seed", seed))

    def kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]

    def synchronize(self) -> None:
        self.calls.append(("synchronize",))


class StubRunner:
    """A runner with fixed memory figures and one full-attention layer per name."""

    def __init__(self, weights: int = GIB // 2, peak: int = GIB // 4, layers: int = 2):
        self.weights, self.peak, self.layers = weights, peak, layers
        self.loaded = True
        self.calls: list[tuple] = []

    def profile_run(self) -> int:
        self.calls.append(("profile_run",))
        return self.peak

    def memory(self) -> RunnerMemory:
        return RunnerMemory(weights=self.weights, kv_cache=0)

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16
        )
        return {f"model.layers.{i}.self_attn": spec for i in range(self.layers)}

    def is_loaded(self) -> bool:
        return self.loaded

    def warm_up(self) -> None:
        self.calls.append(("warm_up",))

    def __getattr__(self, name: str):
        # sleep, wake_up, discard, add_lora, ...: record the call and answer with a marker.
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, *args))
            return f"{name}-result"

        return call


@pytest.fixture(scope="module")
def vllm_config_factory(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    model = tiny_model_dir("qwen3")

    def make(**kwargs):
        return EngineArgs(model=str(model), max_model_len=256, **kwargs).create_engine_config()

    return make


def _worker(config, backend: StubBackend, runner: StubRunner) -> MetalWorker:
    worker = MetalWorker(config, local_rank=0, rank=0, distributed_init_method="tcp://unused")
    worker.backend = backend
    worker.model_runner = runner
    return worker


def _page_bytes(runner: StubRunner) -> int:
    return sum(spec.page_size_bytes for spec in runner.get_kv_cache_spec().values())


def test_an_explicit_kv_cache_size_is_used_without_profiling(vllm_config_factory) -> None:
    runner = StubRunner()
    worker = _worker(vllm_config_factory(kv_cache_memory_bytes=96 * 2**20), StubBackend(), runner)
    assert worker.determine_available_memory() == 96 * 2**20
    assert ("profile_run",) not in runner.calls


def test_the_budget_is_utilization_minus_weights_and_the_activation_peak(
    vllm_config_factory,
) -> None:
    # A 4 GiB device at 0.5 utilization: 2 GiB - 0.5 GiB weights - 0.25 GiB peak. The host's free
    # memory (this machine has more than 2 GiB free) does not bind.
    config = vllm_config_factory(gpu_memory_utilization=0.5)
    runner = StubRunner(weights=GIB // 2, peak=GIB // 4)
    worker = _worker(config, StubBackend(total=4 * GIB), runner)
    from vllm_metal.host import available_memory_bytes

    free_bound = available_memory_bytes() - GIB // 4 - HEADROOM_BYTES
    assert free_bound > GIB + GIB // 4, "the host needs 1.75 GiB free for this test"
    assert worker.determine_available_memory() == GIB + GIB // 4
    assert runner.calls.count(("profile_run",)) == 1


def test_a_budget_that_cannot_hold_one_request_is_refused_with_the_flags(
    vllm_config_factory,
) -> None:
    config = vllm_config_factory(gpu_memory_utilization=0.2)
    # 0.2 of 1 GiB minus 200 MiB of weights and the peak leaves nothing.
    runner = StubRunner(weights=200 * 2**20, peak=10 * 2**20)
    worker = _worker(config, StubBackend(total=GIB), runner)
    with pytest.raises(ValueError, match="max_model_len=256") as refused:
        worker.determine_available_memory()
    for flag in ("--max-model-len", "--gpu-memory-utilization", "--kv-cache-memory-bytes"):
        assert flag in str(refused.value)


def test_one_request_and_one_block_are_sized_from_the_runner_specs(vllm_config_factory) -> None:
    runner = StubRunner(layers=3)
    worker = _worker(vllm_config_factory(), StubBackend(), runner)
    page = 2 * BLOCK * 2 * 64 * 2  # K and V, 16 tokens, 2 heads of 64, float16
    assert worker.get_cache_block_size_bytes() == 3 * page == _page_bytes(runner)
    assert worker._one_request_kv_bytes() == 3 * (256 // BLOCK) * page


def test_sleep_and_discard_reach_the_runner_and_release_the_device_cache(
    vllm_config_factory,
) -> None:
    runner = StubRunner()
    backend = StubBackend(active=[3 * GIB, 1 * GIB, 1 * GIB, 1 * GIB // 2])
    worker = _worker(vllm_config_factory(), backend, runner)
    worker.sleep(2)
    worker.discard(["kv_cache"])
    worker.wake_up(["weights"])
    assert [c for c in runner.calls if c[0] in ("sleep", "discard", "wake_up")] == [
        ("sleep", 2),
        ("discard", ("kv_cache",)),  # a tuple, whatever vLLM passed
        ("wake_up", ["weights"]),
    ]
    assert backend.calls.count(("release",)) == 2


def test_lora_calls_pass_through_with_their_results(vllm_config_factory) -> None:
    runner = StubRunner()
    worker = _worker(vllm_config_factory(), StubBackend(), runner)
    request = object()
    assert worker.add_lora(request) == "add_lora-result"
    assert worker.remove_lora(3) == "remove_lora-result"
    assert worker.pin_lora(4) == "pin_lora-result"
    assert worker.list_loras() == "list_loras-result"
    assert runner.calls == [
        ("add_lora", request),
        ("remove_lora", 3),
        ("pin_lora", 4),
        ("list_loras",),
    ]


def test_warm_up_restores_the_seeded_streams(vllm_config_factory) -> None:
    runner = StubRunner()
    backend = StubBackend()
    worker = _worker(vllm_config_factory(seed=7), backend, runner)
    worker.compile_or_warm_up_model()
    assert runner.calls == [("warm_up",)]
    assert backend.calls == [("seed", 7)]  # after the warm-up's dummy steps


def test_health_needs_a_loaded_model(vllm_config_factory) -> None:
    runner = StubRunner()
    worker = _worker(vllm_config_factory(), StubBackend(), runner)
    worker.check_health()
    runner.loaded = False
    with pytest.raises(RuntimeError, match="no model loaded"):
        worker.check_health()


def test_shutdown_reaches_the_runner_then_frees_the_device_cache(vllm_config_factory) -> None:
    runner = StubRunner()
    backend = StubBackend()
    worker = _worker(vllm_config_factory(), backend, runner)
    worker.shutdown()
    assert runner.calls == [("shutdown",)]
    assert backend.calls == [("release",)]


def test_data_parallel_replicas_on_one_host_split_the_budget(vllm_config_factory) -> None:
    # Two replicas of a 4 GiB device at 0.5 utilization: 1 GiB each, minus weights and peak.
    config = vllm_config_factory(gpu_memory_utilization=0.5, data_parallel_size=2)
    worker = _worker(config, StubBackend(total=4 * GIB), StubRunner(GIB // 2, GIB // 4))
    assert worker.determine_available_memory() == GIB // 4


class _SlowStepRunner(StubRunner):
    """A runner whose step waits for `release` and whose output records when it is read."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.events: list[str] = []

    def execute_model(self, scheduler_output) -> None:
        self.events.append("step started")
        self.release.wait(5)
        self.events.append("step done")

    def sample_tokens(self, grammar_output):
        runner = self

        class Output(AsyncModelRunnerOutput):
            def get_output(self):
                runner.events.append("output read")
                return "output"

        return Output()


def test_an_async_output_is_read_between_steps_not_during_one(vllm_config_factory) -> None:
    # vLLM's multiprocessing executor reads a step's output on its own thread while the next
    # step runs on the main thread; the worker keeps the two apart.
    runner = _SlowStepRunner()
    worker = _worker(vllm_config_factory(), StubBackend(), runner)
    output = worker.sample_tokens(None)
    step = threading.Thread(target=worker.execute_model, args=(None,))
    step.start()
    while not runner.events:
        time.sleep(0.01)
    reader = threading.Thread(target=output.get_output)
    reader.start()
    time.sleep(0.2)
    runner.release.set()
    step.join(5)
    reader.join(5)
    assert runner.events == ["step started", "step done", "output read"]
