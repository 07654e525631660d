"""vLLM's V1 GPU model runner, made to run on a torch device that is not CUDA (`cpu`, `mps`).

vLLM's V1 runner (`vllm.v1.worker.gpu_model_runner.GPUModelRunner`) does the request bookkeeping,
input preparation, attention metadata, sampling (vLLM's sampler: every `SamplingParams` field),
structured outputs and prompt logprobs; Model Runner V2 would need Triton kernels that neither
macOS nor a CPU host has (docs/torch-backend.md). What the V1 runner assumes about CUDA is
replaced here:

- streams and events: placeholders while the runner is built (only async scheduling and
  speculative decoding use them per step, and this backend runs neither);
- host/device buffer pairs: on the `cpu` device one tensor serves as both;
- device synchronisation and the device-to-host copy of sampled ids: plain calls;
- block zeroing (a Triton kernel): not needed, the kernels read no slot past a context length;
- the slot-mapping Triton kernel: `compute_slot_mapping`, registered through the platform;
- vLLM's layers that would launch Triton/CUDA kernels: built as this backend's subclasses
  (`rotary.py`, `short_conv.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from vllm.model_executor.model_loader import get_model
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_metal._logging import init_logger

logger = init_logger(__name__)

# vLLM's slot id of padding tokens (the KV write skips them).
PAD_SLOT_ID = -1


class _NoEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass


class _NoStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextmanager
def _without_cuda_streams() -> Iterator[None]:
    """CUDA stream and event classes replaced while the V1 runner's constructor runs."""
    saved = (torch.Event, torch.cuda.Stream, torch.cuda.Event)
    torch.Event, torch.cuda.Stream, torch.cuda.Event = _NoEvent, _NoStream, _NoEvent
    try:
        yield
    finally:
        torch.Event, torch.cuda.Stream, torch.cuda.Event = saved


class TorchModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        if vllm_config.scheduler_config.async_scheduling:
            raise ValueError(
                "vllm-metal (torch backend): async scheduling needs CUDA events; the platform "
                "turns it off (async_scheduling=False)"
            )
        with _without_cuda_streams():
            super().__init__(vllm_config, device)
        if device.type == "cpu":
            self._share_host_buffers()

    def _share_host_buffers(self) -> None:
        """On the cpu device the 'device' half of each host/device buffer pair is the host half."""
        buffers = [v for v in vars(self).values() if isinstance(v, CpuGpuBuffer)]
        for table in self.input_batch.block_table.block_tables:
            buffers += [v for v in vars(table).values() if isinstance(v, CpuGpuBuffer)]
        for buffer in buffers:
            buffer.gpu = buffer.cpu
        batch = vars(self.input_batch)
        for name, host in list(batch.items()):
            device_name = name.removesuffix("_cpu_tensor")
            if device_name != name and isinstance(batch.get(device_name), torch.Tensor):
                setattr(self.input_batch, device_name, host)

    def load_model(self, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("vllm-metal (torch backend): load_format='dummy' is not supported")
        from vllm_metal.backends.torch import rotary, short_conv

        rotary.register()  # before the model's layers are built
        short_conv.register()
        logger.info("Loading %s with vLLM's model classes", self.model_config.model)
        self.model = get_model(vllm_config=self.vllm_config)
        if self.device.type == "cpu":
            from vllm_metal.backends.torch.cpu_gemm import pack_linear_layers

            pack_linear_layers(self.model)

    def get_model(self) -> torch.nn.Module:
        return self.model

    def _sync_device(self) -> None:
        if self.device.type == "mps":
            torch.mps.synchronize()

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        return sampled_token_ids.tolist()

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        return None


def compute_slot_mapping(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    block_table_stride: int,
    slot_mapping: torch.Tensor,
    KV_CACHE_BLOCK_SIZE: int,  # the Triton kernel's parameter names
    TOTAL_CP_WORLD_SIZE: int = 1,
    TOTAL_CP_RANK: int = 0,
    CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,
    PAD_ID: int = PAD_SLOT_ID,
    BLOCK_SIZE: int = 1024,
) -> None:
    """vLLM's `ComputeSlotMappingKernel` in torch ops: token ``t`` of request ``r`` at position
    ``p`` goes to slot ``block_table[r, p // block_size] * block_size + p % block_size``; slots
    ``num_tokens .. max_num_tokens`` are padding."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise ValueError("vllm-metal (torch backend): context parallelism is not supported")
    bs = KV_CACHE_BLOCK_SIZE
    ends = query_start_loc[1:]
    tokens = torch.arange(num_tokens, dtype=ends.dtype, device=ends.device)
    request = torch.searchsorted(ends, tokens, right=True)
    pos = positions[:num_tokens]
    flat = block_table.reshape(-1)
    block = flat[request * block_table_stride + torch.div(pos, bs, rounding_mode="floor")]
    slot_mapping[:num_tokens] = block.to(torch.int64) * bs + pos % bs
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID


def register_kernel_overrides() -> None:
    """Route vLLM's Triton kernels the V1 runner launches every step to torch implementations."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels(
        {"vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping}
    )
