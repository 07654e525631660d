"""Where an in-process engine's steps go (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so that the
engine core runs in the calling process): `PhaseTimers` splits a step's wall time by wrapping
the runner's and engine's methods, `profiled` gives a cProfile of one call."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

# `PhaseTimers.summary`'s keys, in a step's order, with the reports' column names.
PHASES = (("graph_build_ms", "graph build"), ("host_other_ms", "host, outside the graph"),
          ("submit_ms", "submit (mx.async_eval)"), ("wait_ms", "wait for logits"),
          ("sample_ms", "sampling"), ("draft_ms", "drafting"),
          ("engine_other_ms", "engine around the runner"), ("step_ms", "whole step"))  # fmt: skip


class PhaseTimers:
    """Wall time of a step's phases, by wrapping the runner's and engine's methods: graph build
    (the model state's `hidden_states` and `logits`: the forward's own Python), host other (the
    rest of `execute_model`: request state, packing, metadata), submit (`mx.async_eval`), wait
    (the logits, or the tokens sampled on the device, reaching the host), sampling (vLLM's
    sampler and the write-back: the rest of `sample_step`), drafting under speculative decoding
    (`SpecDecoder.after_step`: the drafter's proposal, its own waits included) and the engine
    around them (scheduler, output processing: the rest of `LLMEngine.step`). Under async
    scheduling `execute_model` first samples the step before it; that sampling (and drafting)
    counts as sampling (and drafting), not as the step's build."""

    def __init__(self) -> None:
        self.records: dict[str, float] = {}
        self.steps = 0
        self._depth: list[str] = []
        self.kinds = StepKinds()
        self.drafts = DraftCalls()

    def timed(self, name: str, fn: Any) -> Any:
        timers = self

        def call(*args: Any, **kwargs: Any) -> Any:
            timers._depth.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
                timers._depth.pop()
                timers.records[name] = timers.records.get(name, 0.0) + seconds
                if name in ("sample_step", "draft") and "execute_model" in timers._depth:
                    key = f"{name}_in_execute"
                    timers.records[key] = timers.records.get(key, 0.0) + seconds
                if name == "execute_model":
                    timers.steps += 1

        return call

    def install(self) -> None:
        import mlx.core as mx
        from vllm.v1.engine.llm_engine import LLMEngine

        from vllm_metal.backends.mlx.runner import model_runner, sample
        from vllm_metal.backends.mlx.runner.model_states import decoder, interface
        from vllm_metal.backends.mlx.runner.spec_decode import verify
        from vllm_metal.backends.mlx.runner.spec_decode.decoder import SpecDecoder

        LLMEngine.step = self.timed("engine_step", LLMEngine.step)
        sample.sample_step = self.timed("sample_step", sample.sample_step)
        sample.to_torch = self.timed("wait", sample.to_torch)
        for module in (sample, verify):  # the tokens (or verdicts) drawn on the device
            if hasattr(module, "to_host"):
                module.to_host = self.timed("wait", module.to_host)
        SpecDecoder.after_step = self.timed("draft", SpecDecoder.after_step)
        self.drafts.install()
        runner = model_runner.MLXModelRunner
        runner.execute_model = self.kinds.wrap(self.timed("execute_model", runner.execute_model))
        submit = self.timed("submit", mx.async_eval)
        plain = mx.async_eval
        # The step's own submit: not a drafter's, which counts as drafting.
        mx.async_eval = lambda *a: (
            submit if "execute_model" in self._depth and "draft" not in self._depth else plain
        )(*a)
        for cls in (interface.ModelState, decoder.DecoderState):
            for attr in ("hidden_states", "logits"):
                if attr in vars(cls):
                    setattr(cls, attr, self.timed("graph", vars(cls)[attr]))

    def reset(self) -> None:
        self.records, self.steps = {}, 0
        self.kinds.reset()
        self.drafts.reset()

    def summary(self) -> dict[str, float]:
        """Mean ms per model step of each phase over a round (its prefill steps included: one or
        two of the round's hundreds)."""
        r = {k: v * 1e3 / max(1, self.steps) for k, v in self.records.items()}
        get = lambda k: r.get(k, 0.0)
        graph = get("graph")
        inside = get("sample_step_in_execute") + get("draft_in_execute")
        build = get("execute_model") - get("submit") - inside
        return {
            "graph_build_ms": round(graph, 3),
            "host_other_ms": round(build - graph, 3),
            "submit_ms": round(get("submit"), 3),
            "wait_ms": round(get("wait"), 3),
            "sample_ms": round(get("sample_step") - get("wait"), 3),
            "draft_ms": round(get("draft"), 3),
            "engine_other_ms": round(
                get("engine_step") - build - get("submit") - get("sample_step") - get("draft"),
                3,
            ),
            "step_ms": round(get("engine_step"), 3),
            "steps": self.steps,
            "kinds": self.kinds.summary(),
            "drafts": self.drafts.summary(),
        }


class StepKinds:
    """Each model step by kind, with the wall time from its start to the next step's start
    (what it costs the stream, whatever overlaps): a decode step that verifies drafts or not,
    one whose tokens went in on the device from the step before (`carried in`: built one
    ahead), one run through the compiled forward (`traced`: a shape traced for the first
    time), or a step with prefill rows."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self._last: tuple[str, float] | None = None

    def wrap(self, execute_model: Any) -> Any:
        kinds = self

        def call(runner: Any, *args: Any, **kwargs: Any) -> Any:
            pipeline = getattr(runner.output, "pipeline", None)
            compiled = getattr(runner.state, "compiled", None)

            def counts() -> tuple:  # (steps carried one ahead, steps run compiled) so far
                return (
                    None if pipeline is None else pipeline.carried_steps,
                    None if compiled is None else compiled.steps,
                )

            before = counts()
            started = time.perf_counter()
            try:
                return execute_model(runner, *args, **kwargs)
            finally:
                executed = None if pipeline is None else pipeline.executed
                if executed is not None:
                    kind = kind_of(executed.packed, before, counts())
                    kinds._add(kind + (", traced" if executed.traced else ""), started)

        return call

    def _add(self, kind: str, started: float) -> None:
        if self._last is not None:
            last_kind, last_started = self._last
            self.seconds.setdefault(last_kind, []).append(started - last_started)
        self._last = (kind, started)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per kind: its steps and their mean, median and longest ms (the round's last step,
        with no next one, left out): a mean well above the median is a few slow steps."""
        return spread(self.seconds)


class DraftCalls:
    """A head drafter's proposals (`HeadDrafter.propose`: EAGLE-3 and MTP heads) by what they
    ran: the rows of the head's first pass (each row's new positions after those it deferred
    while it did not draft, `HeadDrafter._catch_up`), and whether a row then drafted; or no
    pass at all (every row deferred); and whether its compiled chain traced a new shape
    (`CompiledChain.traces`). Tells a drafting call slow because its first pass caught up over
    many positions (a shape met rarely), or because it traced, from every drafting call being
    slow."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self._rows: int | None = None

    def install(self) -> None:
        from vllm_metal.backends.mlx.runner.spec_decode.head import HeadDrafter

        calls, catch_up, propose = self, HeadDrafter._catch_up, HeadDrafter.propose

        def first_pass(drafter: Any, *args: Any, **kwargs: Any) -> Any:
            packed, inputs = catch_up(drafter, *args, **kwargs)
            calls._rows = packed.num_tokens
            return packed, inputs

        def timed(drafter: Any, step: Any, states: Any, sampled: Any, caps: Any) -> Any:
            calls._rows = None
            traces = drafter.chain.traces if drafter.chain is not None else 0
            started = time.perf_counter()
            try:
                return propose(drafter, step, states, sampled, caps)
            finally:
                seconds = time.perf_counter() - started
                kind = "no head pass" if calls._rows is None else _rows_label(calls._rows)
                if calls._rows is not None and caps.any():
                    kind += ", drafting"
                if drafter.chain is not None and drafter.chain.traces != traces:
                    kind += ", chain traced"
                calls.seconds.setdefault(kind, []).append(seconds)

        HeadDrafter._catch_up, HeadDrafter.propose = first_pass, timed

    def summary(self) -> dict[str, dict[str, float]]:
        """Per kind of call: how many, and their mean, median and longest ms."""
        return spread(self.seconds)


def _rows_label(rows: int) -> str:
    """'first pass of N rows' up to 4 rows, else of a range (5-8, 9-16, ...)."""
    if rows <= 4:
        return f"first pass of {rows} rows"
    top = 1 << (rows - 1).bit_length()
    return f"first pass of {top // 2 + 1}-{top} rows"


def spread(seconds: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per key: the count of its times and their mean, median and longest ms."""
    return {
        key: {
            "steps": len(s),
            "ms": round(sum(s) * 1e3 / len(s), 3),
            "median_ms": round(statistics.median(s) * 1e3, 3),
            "max_ms": round(max(s) * 1e3, 3),
        }
        for key, s in sorted(seconds.items())
    }


def kind_of(packed: Any, before: tuple, after: tuple) -> str:
    """'prefill', or 'decode' / 'verify' with ', carried in' and ', compiled' where they hold."""
    if not packed.decodes_only:
        return "prefill"
    kind = "verify" if packed.num_draft_tokens.any() else "decode"
    if before[0] is not None and after[0] > before[0]:
        kind += ", carried in"
    if before[1] is not None and after[1] > before[1]:
        kind += ", compiled"
    return kind


def profiled(run: Callable[[], Any], top: int = 25, cumulative: int = 45) -> str:
    """`run()` under cProfile: its `top` functions by own time, then `cumulative` by time
    with their callees."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(cumulative)
    return text.getvalue()
