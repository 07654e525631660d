"""The MLX model runner: keeps per-request state across steps and runs one varlen forward per step.

vLLM's scheduler decides what runs; this module turns a `SchedulerOutput` into one packed MLX
forward over the paged KV cache, then samples with vLLM's own `Sampler` (so every
`SamplingParams` field behaves as on vLLM's other backends) and reports a `ModelRunnerOutput`.
Request bookkeeping reuses vLLM's `InputBatch`, which also builds the sampling metadata.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import torch
from vllm.sampling_params import SamplingType
from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    LogprobsTensors,
    ModelRunnerOutput,
)
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from vllm_metal._logging import init_logger
from vllm_metal.runner.batch import PackedBatch, pack_batch
from vllm_metal.runner.model_loader import TORCH_TO_MLX_DTYPE, load_mlx_model, parameter_bytes
from vllm_metal.runner.paged import (
    KVPool,
    PagedLayerCache,
    StepMetadata,
    apply_lm_head,
    install_paged_attention,
    layer_sliding_windows,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

logger = init_logger(__name__)


def attention_layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn"


@dataclass
class _StepState:
    scheduler_output: SchedulerOutput
    packed: PackedBatch
    logits: mx.array  # [S, V] float32, one row per request (being evaluated)
    prompt_logits: dict[str, mx.array]  # req_id -> [n, V] rows for prompt logprobs
    grammar_output: GrammarOutput | None = None
    output: ModelRunnerOutput | None = None


class _PendingOutput(AsyncModelRunnerOutput):
    """A step's output under async scheduling: sampled when the engine asks for it, or when the
    next step needs its tokens, whichever comes first."""

    def __init__(self, runner: MLXModelRunner, step: _StepState):
        self._runner = runner
        self._step = step

    def get_output(self) -> ModelRunnerOutput:
        return self._runner._finish_step(self._step)


class MLXModelRunner:
    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.scheduler_config = vllm_config.scheduler_config
        self.parallel_config = vllm_config.parallel_config

        self.dtype: torch.dtype = self.model_config.dtype
        self.mlx_dtype = TORCH_TO_MLX_DTYPE[self.dtype]
        self.max_model_len = self.model_config.max_model_len
        self.max_num_reqs = self.scheduler_config.max_num_seqs
        self.max_num_tokens = self.scheduler_config.max_num_batched_tokens
        self.block_size = self.cache_config.block_size
        self.vocab_size = self.model_config.get_vocab_size()

        self.num_layers = self.model_config.get_num_layers(self.parallel_config)
        self.num_kv_heads = self.model_config.get_num_kv_heads(self.parallel_config)
        self.head_dim = self.model_config.get_head_size()
        self.sliding_windows = layer_sliding_windows(
            self.model_config.hf_text_config, self.num_layers
        )

        self.device = torch.device("cpu")  # vLLM-side tensors (sampling) live on the host
        self.requests: dict[str, CachedRequestState] = {}
        self.num_prompt_logprobs: dict[str, int] = {}
        self.input_batch = self._make_input_batch(self.block_size)
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)

        self.model: Any = None
        self.weight_bytes = 0
        self.kv_pool: KVPool | None = None
        self._kv_num_blocks = 0
        # Under async scheduling vLLM schedules step N+1 while step N computes: the forward is
        # queued with mx.async_eval and sampled when its output is needed.
        self.async_scheduling = bool(self.scheduler_config.async_scheduling)
        self._step: _StepState | None = None  # executed, waiting for sample_tokens
        self._pending: _StepState | None = None  # sample_tokens returned, not yet sampled

    # ------------------------------------------------------------------ setup

    def _make_input_batch(self, block_size: int) -> InputBatch:
        logits_processors = self.model_config.logits_processors
        custom = tuple(logits_processors) if logits_processors is not None else ()
        return InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_tokens,
            device=self.device,
            vocab_size=self.vocab_size,
            block_sizes=[block_size],
            max_num_blocks_per_req=[math.ceil(self.max_model_len / block_size)],
            logitsprocs=build_logitsprocs(self.vllm_config, self.device, False, False, custom),
            logitsprocs_need_output_token_ids=bool(custom),
            is_pooling_model=False,
            reasoning_config=self.vllm_config.reasoning_config,
        )

    def load_model(self) -> None:
        start = time.perf_counter()
        load_config = self.vllm_config.load_config
        self.model, _, _ = load_mlx_model(
            self.model_config.model,
            self.dtype,
            revision=self.model_config.revision,
            download_dir=load_config.download_dir,
            trust_remote_code=self.model_config.trust_remote_code,
        )
        install_paged_attention(self.model)
        num_model_layers = len(self.model.layers)
        if num_model_layers != self.num_layers:
            raise ValueError(
                f"model={self.model_config.model!r}: the MLX model has {num_model_layers} "
                f"layers but the config says {self.num_layers}"
            )
        self.weight_bytes = parameter_bytes(self.model)
        logger.info("Model loading took %.2f s", time.perf_counter() - start)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        # Sliding-window layers are recorded as full attention: blocks are kept for the whole
        # context and the window is applied inside the attention op.
        spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.dtype,
        )
        return {attention_layer_name(i): spec for i in range(self.num_layers)}

    def kv_bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"vllm-metal expects one KV cache group, got {len(groups)}")
        block_size = groups[0].kv_cache_spec.block_size
        if block_size != self.block_size:
            self.block_size = block_size
            self.input_batch = self._make_input_batch(block_size)
        self._kv_num_blocks = kv_cache_config.num_blocks
        self._allocate_kv_pool()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            kv_cache_config.num_blocks,
            self.block_size,
            self.kv_pool.nbytes / 2**20,
        )

    def _allocate_kv_pool(self) -> None:
        self.kv_pool = KVPool(
            self.num_layers,
            self._kv_num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.mlx_dtype,
        )

    # ------------------------------------------------------------ sleep mode

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache; level 2 also frees the weights (reloaded on wake-up).

        On Apple Silicon CPU and GPU share one memory, so there is no separate host copy to
        offload weights to: level 1 keeps them where they are.
        """
        self.kv_pool = None
        if level >= 2:
            self.model = None
        import gc

        gc.collect()
        mx.clear_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = tags or ["weights", "kv_cache"]
        if "weights" in tags and self.model is None:
            self.load_model()
        if "kv_cache" in tags and self.kv_pool is None and self._kv_num_blocks:
            self._allocate_kv_pool()

    @property
    def is_sleeping(self) -> bool:
        return self.kv_pool is None or self.model is None

    # ------------------------------------------------------------- profiling

    def _dummy_forward(self, num_tokens: int, pool: KVPool) -> None:
        """One prefill of `num_tokens` tokens through `pool` (for profiling and warm-up)."""
        bs = pool.block_size
        num_blocks = math.ceil(num_tokens / bs)
        positions = np.arange(num_tokens, dtype=np.int32)
        table = np.arange(num_blocks, dtype=np.int32)[None, :]
        packed = PackedBatch(
            req_ids=["dummy"],
            num_scheduled=np.array([num_tokens], dtype=np.int32),
            cu_seqlens_q=np.array([0, num_tokens], dtype=np.int32),
            token_ids=(positions % max(2, self.vocab_size - 1)).astype(np.int32),
            positions=positions,
            slot_mapping=positions.astype(np.int64),
            seq_lens=np.array([num_tokens], dtype=np.int32),
            block_tables=table,
            logits_indices=np.array([num_tokens - 1], dtype=np.int32),
            discard=np.array([False]),
        )
        logits, _ = self._forward(packed, pool, {})
        mx.eval(logits)

    def profile_run(self) -> int:
        """Peak bytes a full-size step needs beyond the weights (activations + scratch)."""
        num_tokens = max(1, min(self.max_num_tokens, self.max_model_len))
        pool = KVPool(
            self.num_layers,
            math.ceil(num_tokens / self.block_size),
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.mlx_dtype,
        )
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        self._dummy_forward(num_tokens, pool)
        peak = mx.get_peak_memory() - before
        del pool
        mx.clear_cache()
        return max(0, int(peak))

    def warm_up(self) -> None:
        pool = KVPool(self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim, self.mlx_dtype)
        for n in (1, min(self.block_size, self.max_num_tokens)):
            self._dummy_forward(n, pool)
        del pool
        mx.clear_cache()

    # ------------------------------------------------------------ the step

    def _forward(
        self, packed: PackedBatch, pool: KVPool, prompt_rows: dict[str, np.ndarray]
    ) -> tuple[mx.array, dict[str, mx.array]]:
        meta = StepMetadata(
            positions=mx.array(packed.positions),
            slot_mapping=mx.array(packed.slot_mapping),
            block_tables=mx.array(packed.block_tables),
            seq_lens=mx.array(packed.seq_lens),
            cu_seqlens_q=mx.array(packed.cu_seqlens_q),
        )
        caches = [
            PagedLayerCache(pool, i, meta, self.sliding_windows[i]) for i in range(self.num_layers)
        ]
        inputs = mx.array(packed.token_ids)[:, None]
        hidden = self.model.model(inputs, caches)  # [T, 1, hidden]

        rows = [packed.logits_indices]
        spans: list[tuple[str, int, int]] = []
        offset = len(packed.logits_indices)
        for req_id, r in prompt_rows.items():
            rows.append(r)
            spans.append((req_id, offset, offset + len(r)))
            offset += len(r)
        selected = hidden[mx.array(np.concatenate(rows).astype(np.int32))]
        logits = apply_lm_head(self.model, selected)
        logits = logits.reshape(logits.shape[0], -1).astype(mx.float32)
        num_reqs = len(packed.logits_indices)
        prompt = {req_id: logits[a:b] for req_id, a, b in spans}
        return logits[:num_reqs], prompt

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        # The previous step's tokens are inputs of this one.
        if self._pending is not None:
            self._finish_step(self._pending)
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0 or self.input_batch.num_reqs == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        assert self.kv_pool is not None, "KV cache not initialized"

        batch = self.input_batch
        packed = pack_batch(
            batch.req_ids,
            scheduler_output.num_scheduled_tokens,
            batch.num_computed_tokens_cpu,
            batch.num_tokens_no_spec,
            batch.token_ids_cpu,
            batch.block_table[0].get_numpy_array(),
            self.block_size,
        )
        prompt_rows = self._prompt_logprob_rows(packed)
        logits, prompt_logits = self._forward(packed, self.kv_pool, prompt_rows)
        # Evaluating the cache writes with the logits keeps every step's graph self-contained.
        mx.async_eval(logits, *prompt_logits.values(), *self.kv_pool.arrays())
        self._step = _StepState(
            scheduler_output=scheduler_output,
            packed=packed,
            logits=logits,
            prompt_logits=prompt_logits,
        )
        return None

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        step = self._step
        self._step = None
        if step is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        step.grammar_output = grammar_output
        if self.async_scheduling:
            self._pending = step
            return _PendingOutput(self, step)
        return self._finish_step(step)

    def _finish_step(self, step: _StepState) -> ModelRunnerOutput:
        """Sample a step's tokens and record them (once; later calls return the same output)."""
        if step.output is not None:
            return step.output
        if self._pending is step:
            self._pending = None
        batch = self.input_batch
        logits = _to_torch(step.logits)  # waits for the forward
        if step.grammar_output is not None:
            from vllm.v1.structured_output.utils import apply_grammar_bitmask

            apply_grammar_bitmask(step.scheduler_output, step.grammar_output, batch, logits)

        sampler_output = self.sampler(logits=logits, sampling_metadata=batch.sampling_metadata)

        discard = np.nonzero(step.packed.discard)[0]
        for i in discard:
            # The sampler drew random numbers for a token we drop; rewind so seeded requests
            # see the same stream as on vLLM's other backends.
            gen = batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)

        sampled = sampler_output.sampled_token_ids.tolist()
        for i in discard:
            sampled[int(i)] = []
        for i, token_ids in enumerate(sampled):
            if not token_ids:
                continue
            start = int(batch.num_tokens_no_spec[i])
            end = start + len(token_ids)
            batch.token_ids_cpu[i, start:end] = token_ids
            batch.is_token_ids[i, start:end] = True
            batch.num_tokens_no_spec[i] = end
            self.requests[batch.req_ids[i]].output_token_ids.extend(token_ids)

        logprobs = None
        if sampler_output.logprobs_tensors is not None:
            logprobs = sampler_output.logprobs_tensors.tolists()

        step.output = ModelRunnerOutput(
            req_ids=batch.req_ids.copy(),
            req_id_to_index=batch.req_id_to_index.copy(),
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs_dict=self._prompt_logprobs(step),
        )
        return step.output

    # ------------------------------------------------------- request state

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.num_prompt_logprobs.pop(req_id, None)
            batch.remove_request(req_id)

        if scheduler_output.kv_cache_block_copies and self.kv_pool is not None:
            copies = scheduler_output.kv_cache_block_copies
            self.kv_pool.copy_blocks([c.src_block_id for c in copies], [c.dst_block_id for c in copies])

        # Requests in the persistent batch that were not scheduled this step (paused or
        # preempted) leave the batch; their state stays in self.requests.
        scheduled = scheduler_output.num_scheduled_tokens.keys()
        resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
        for req_id in batch.req_id_to_index.keys() - (scheduled - resumed):
            batch.remove_request(req_id)

        to_add: list[CachedRequestState] = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is None:
                raise ValueError(f"request {new.req_id}: prompt embeddings are not supported")
            params = new.sampling_params
            if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            else:
                generator = None
            if new.req_id in self.requests:  # a streaming session continuing
                batch.remove_request(new.req_id)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                mm_features=new.mm_features,
                sampling_params=params,
                generator=generator,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
                lora_request=new.lora_request,
            )
            self.requests[new.req_id] = state
            if params is not None and params.prompt_logprobs is not None:
                self.num_prompt_logprobs[new.req_id] = (
                    self.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
                )
            to_add.append(state)

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            num_computed = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            num_output = cached.num_output_tokens[i]
            index = batch.req_id_to_index.get(req_id)
            state.num_computed_tokens = num_computed
            if num_output < len(state.output_token_ids):
                # The scheduler dropped tokens (e.g. rejected); keep our copy in step.
                del state.output_token_ids[num_output:]
                if index is not None:
                    batch.num_tokens_no_spec[index] = batch.num_prompt_tokens[index] + num_output
            if req_id in cached.resumed_req_ids:
                assert new_block_ids is not None
                state.block_ids = new_block_ids
            elif new_block_ids is not None:
                for ids, extra in zip(state.block_ids, new_block_ids):
                    ids.extend(extra)
            if index is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = num_computed
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, index)

        for state in to_add:
            batch.add_request(state)
        batch.condense()
        reorder_batch_to_split_decodes_and_prefills(batch, scheduler_output, decode_threshold=1)
        batch.refresh_metadata()

    # ------------------------------------------------------ prompt logprobs

    def _prompt_logprob_rows(self, packed: PackedBatch) -> dict[str, np.ndarray]:
        rows: dict[str, np.ndarray] = {}
        for req_id in self.num_prompt_logprobs:
            index = self.input_batch.req_id_to_index.get(req_id)
            if index is None:
                continue
            state = self.requests[req_id]
            start = int(self.input_batch.num_computed_tokens_cpu[index])
            n = int(packed.num_scheduled[index])
            remaining = state.num_prompt_tokens - (start + 1)
            count = min(n, remaining)
            if count > 0:
                first = int(packed.cu_seqlens_q[index])
                rows[req_id] = np.arange(first, first + count, dtype=np.int32)
        return rows

    def _prompt_logprobs(self, step: _StepState) -> dict[str, LogprobsTensors | None]:
        if not self.num_prompt_logprobs:
            return {}
        out: dict[str, LogprobsTensors | None] = {}
        completed = []
        for req_id, k in self.num_prompt_logprobs.items():
            index = step.packed.req_ids.index(req_id) if req_id in step.packed.req_ids else None
            if index is None:
                continue
            state = self.requests[req_id]
            num_prompt = state.num_prompt_tokens
            tensors = state.in_progress_prompt_logprobs_cpu
            if tensors is None:
                tensors = LogprobsTensors.empty_cpu(num_prompt - 1, k + 1)
                state.in_progress_prompt_logprobs_cpu = tensors
            start = int(step.packed.seq_lens[index] - step.packed.num_scheduled[index])
            n = int(step.packed.num_scheduled[index])
            if n > num_prompt - (start + 1):
                completed.append(req_id)
                out[req_id] = tensors
            rows = step.prompt_logits.get(req_id)
            if rows is None or rows.shape[0] == 0:
                continue
            logits = _to_torch(rows)
            count = logits.shape[0]
            targets = torch.tensor(state.prompt_token_ids[start + 1 : start + 1 + count])
            if self.model_config.logprobs_mode in ("raw_logits", "processed_logits"):
                scores = logits
            else:
                scores = self.sampler.compute_logprobs(logits)
            token_ids, logprobs, ranks, *_ = self.sampler.gather_logprobs(scores, k, targets)
            span = slice(start, start + count)
            tensors.logprob_token_ids[span].copy_(token_ids)
            tensors.logprobs[span].copy_(logprobs)
            tensors.selected_token_ranks[span].copy_(ranks)
        for req_id in completed:
            del self.num_prompt_logprobs[req_id]
            self.requests[req_id].in_progress_prompt_logprobs_cpu = None
        return out


def _to_torch(a: mx.array) -> torch.Tensor:
    # A view of the evaluated MLX buffer where possible (the numpy array keeps it alive).
    return torch.from_numpy(np.asarray(a))
