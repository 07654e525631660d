"""Device facts of the MLX backend: which MLX device computes, memory, sync and seeding."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from vllm_metal import envs
from vllm_metal.backends import BackendUnavailableError
from vllm_metal.backends.kernel_facts import PagedKernelFacts
from vllm_metal.host import physical_memory_bytes

if TYPE_CHECKING:
    import mlx.core as mx
    from vllm.config import VllmConfig

    from vllm_metal.backends.protocol import ModelRunner


def gpu_api() -> str | None:
    """The API of MLX's GPU here: 'metal' (Apple), 'cuda' (MLX's CUDA backend, which runs the
    same graphs on an NVIDIA GPU: a stand-in for measuring the engine) or None."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def device_kind() -> str:
    """'gpu' or 'cpu': the MLX device the runner computes on (VLLM_METAL_DEVICE may force it).
    Any MLX GPU counts; the native kernels run on Metal only, and elsewhere the ops run their
    pure-MLX versions (`vllm_metal.ops._backend`)."""
    wanted = envs.VLLM_METAL_DEVICE
    has_gpu = gpu_api() is not None
    if wanted == "gpu" and not has_gpu:
        raise BackendUnavailableError(
            "VLLM_METAL_DEVICE=gpu but MLX reports no GPU (Metal or CUDA) on this machine"
        )
    if wanted == "cpu" or not has_gpu:
        return "cpu"
    return "gpu"


def compute_dtype(storage_dtype: mx.Dtype) -> mx.Dtype:
    """The dtype the model computes in, for a checkpoint served (and KV-cached) in `storage_dtype`.

    On the GPU that is the dtype itself. On MLX's CPU device half-precision matmuls run MLX's own
    loops while float32 ones run on the BLAS, several times faster, so the weights are held in
    float32 there (their bytes count against the KV budget like any weights); the KV cache keeps
    the dtype vLLM sized it for.
    """
    import mlx.core as mx

    if device_kind() == "cpu":
        return mx.float32
    return storage_dtype


def dense_on_this_device() -> bool:
    """Whether MLX-quantized layers are better served dense here (the CPU device, whose quantized
    matmul is MLX's own loop; see `models.loaders.safetensors._dequantize`)."""
    return device_kind() == "cpu"


class MLXBackend(PagedKernelFacts):
    name = "mlx"
    async_scheduling = True
    opaque_attention_op = True

    def torch_device_type(self) -> str:
        # MLX owns the accelerator: vLLM's tensors (sampling, pooling, grammars) stay on the host.
        return "cpu"

    def attention_backend(self) -> str:
        # vLLM asks while it builds its config; the MLX runner runs no vLLM attention layer, so
        # this only has to name a backend that imports on this host.
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        return AttentionBackendEnum.CPU_ATTN.get_path()

    def register_kernel_overrides(self) -> None:
        return None  # the spec decoder registers its kernels when it is built

    def import_kernels(self) -> None:
        return None  # the native extension is loaded by vllm_metal.ops when first needed

    def configure_hybrid(self, vllm_config: VllmConfig) -> None:
        from vllm_metal.kv import state

        state.align_block_size(vllm_config)

    def init_device(self) -> str:
        import mlx.core as mx

        from vllm_metal.backends.mlx import blas

        kind = device_kind()
        mx.set_default_device(mx.gpu if kind == "gpu" else mx.cpu)
        if kind == "cpu":
            blas.report()  # the process that runs the model says which BLAS its matmuls use
            blas.leave_the_cores_to_mlx()  # before torch's first parallel op in this process
        return self.device_description()

    def device_description(self) -> str:
        kind = device_kind()
        return f"MLX gpu ({gpu_api()})" if kind == "gpu" else f"MLX {kind}"

    def total_memory_bytes(self) -> int:
        """Unified memory Metal may use on a Mac, the GPU's memory under MLX's CUDA backend,
        physical RAM elsewhere."""
        import mlx.core as mx

        if mx.metal.is_available():
            info = mx.device_info()
            # MLX reports Metal's recommended working set: the ceiling for wired buffers.
            for key in ("max_recommended_working_set_size", "memory_size"):
                if info.get(key):
                    return int(info[key])
        if gpu_api() == "cuda" and device_kind() == "gpu":
            info = mx.device_info()
            for key in ("total_memory", "memory_size"):
                if info.get(key):
                    return int(info[key])
        return physical_memory_bytes()

    def active_memory_bytes(self) -> int:
        import mlx.core as mx

        return int(mx.get_active_memory())

    def synchronize(self) -> None:
        import mlx.core as mx

        mx.synchronize()

    def release_cached_memory(self) -> None:
        import mlx.core as mx

        gc.collect()
        mx.clear_cache()

    def seed(self, seed: int) -> None:
        import mlx.core as mx

        mx.random.seed(seed)

    def make_runner(self, vllm_config: VllmConfig) -> ModelRunner:
        # One runner for every model kind; it picks the kind and the output stage itself.
        from vllm_metal.backends.mlx.runner.model_runner import MLXModelRunner

        return MLXModelRunner(vllm_config)


MLX_BACKEND = MLXBackend()
