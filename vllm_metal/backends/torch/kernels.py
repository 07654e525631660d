"""Torch custom ops over this project's CPU paged-attention, KV-cache-write, rotary-embedding and
causal-convolution kernels: what the torch backend's attention (`attention.py`), rotary layers
(`rotary.py`) and short convolutions (`short_conv.py`) call.
On `cpu` tensors they run the native drivers below; on `mps` tensors (a Mac), until the Metal
kernels take torch tensors, the same contracts in plain torch ops (`torch_ops.py`, the ops'
kernels for the "MPS" dispatch key).

On `cpu`, ``torch.ops.vllm_metal.paged_attention`` and ``torch.ops.vllm_metal.reshape_and_cache``
run the C++ drivers that the MLX ops' CPU bodies run (csrc/ops/attention/cpu.h,
csrc/ops/cache/cpu.h), through ``_C.paged_attention_into`` and ``_C.reshape_and_cache_into``
(csrc/dlpack_ops.cpp). Those take the tensors through DLPack without copying them, check every
shape, dtype, device and layout relation (ValueError naming the argument) and release the GIL
while the kernel runs. ``torch.ops.vllm_metal.rotary_embedding`` rotates query and key rows in
place (``_C.rotary_embedding_into``, csrc/ops/rope/), as vllm_metal.ops.rotary_embedding computes
them. ``torch.ops.vllm_metal.causal_conv1d`` convolves packed sequences from their windows and
updates the windows in place (``_C.causal_conv1d_into``, csrc/ops/short_conv/). The ops are
registered with a schema and a fake implementation, so a tracer sees them as opaque calls that
mutate ``out`` (attention, convolution), the two pools (cache write), query and key (rope) or the
windows (convolution).

What they compute is vllm_metal.ops.paged_attention's and vllm_metal.ops.reshape_and_cache's
contract, on tensors laid out as those take them: query ``[T, Hq, D]`` and key/value rows
``[T, Hkv, D]`` with any strides; the pools ``[num_blocks, block_size, Hkv, D]`` with any block and
slot strides (e.g. views of one allocation per block page), their heads packed ``D`` apart for
attention; block tables, sequence lengths and query offsets int32; slots int64 (negative: skipped).
"""

import functools
from types import ModuleType

import torch
from torch.utils.dlpack import to_dlpack
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_metal._logging import init_logger
from vllm_metal.backends.torch import torch_ops

logger = init_logger(__name__)

NAMESPACE = "vllm_metal"

# The extension takes DLPack capsules as well as tensors. torch's C-level export costs ~0.4 us a
# tensor, Tensor.__dlpack__ (what nanobind calls on a tensor) ~2.5 us: with seven or more tensors a
# call, that is most of the op's fixed cost on a decode step.
_capsule = to_dlpack


@functools.cache
def _native() -> ModuleType:
    """The extension, loaded (and checked against this package's ops ABI) on first use."""
    try:
        from vllm_metal.ops import _native
    except ImportError as exc:
        raise RuntimeError(
            f"the torch backend's kernels need the native extension vllm_metal._C: {exc}"
        ) from exc
    native = _native._C
    # These ops run between torch's matmuls, whose OpenMP threads keep spinning on the cores for
    # a while after each one: the kernels take torch's thread count and run on that same team
    # rather than on the extension's own threads, which would compete with them.
    native.set_num_threads(torch.get_num_threads())
    on_openmp = native.use_host_openmp(True)
    logger.info(
        "torch backend kernels: %d thread(s), %s",
        native.num_threads(),
        "on torch's OpenMP team" if on_openmp else "on the extension's thread pool",
    )
    return native


def _paged_attention_impl(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> None:
    # The extension takes contiguous index arrays and float32 sinks (no-ops when they already are).
    _native().paged_attention_into(
        _capsule(out),
        _capsule(query),
        _capsule(key_cache),
        _capsule(value_cache),
        _capsule(block_tables.contiguous()),
        _capsule(seq_lens.contiguous()),
        _capsule(cu_seqlens_q.contiguous()),
        scale,
        sliding_window,
        softcap,
        None if sinks is None else _capsule(sinks.to(torch.float32).contiguous()),
    )


def _reshape_and_cache_impl(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _native().reshape_and_cache_into(
        _capsule(key),
        _capsule(value),
        _capsule(key_cache),
        _capsule(value_cache),
        _capsule(slot_mapping.contiguous()),
    )


def _rotary_embedding_impl(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    _native().rotary_embedding_into(
        _capsule(positions.contiguous()),
        _capsule(query),
        None if key is None else _capsule(key),
        _capsule(cos_sin_cache.contiguous()),
        is_neox,
    )


def _causal_conv1d_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    silu: bool,
) -> None:
    _native().causal_conv1d_into(
        _capsule(x),
        _capsule(weight),
        None if bias is None else _capsule(bias),
        _capsule(conv_state),
        _capsule(state_indices),
        None if has_state is None else _capsule(has_state),
        _capsule(cu_seqlens),
        _capsule(out),
        silu,
    )


def _no_output(*args: object) -> None:
    """Fake implementation: the ops only mutate their arguments."""


# Operators live as long as their library object; a re-executed module keeps the first one.
_LIB = globals().get("_LIB") or torch.library.Library(NAMESPACE, "FRAGMENT")


def _register() -> None:
    """Defines the ops with their CPU kernels (the C++ drivers) and their MPS kernels (plain
    torch, `torch_ops`), unless this process already has them: the dispatcher picks by the
    tensors' device."""
    for name, impl, mutates, torch_impl in (
        ("paged_attention", _paged_attention_impl, ["out"], torch_ops.paged_attention),
        (
            "reshape_and_cache",
            _reshape_and_cache_impl,
            ["key_cache", "value_cache"],
            torch_ops.reshape_and_cache,
        ),
        ("rotary_embedding", _rotary_embedding_impl, ["query", "key"], torch_ops.rotary_embedding),
        ("causal_conv1d", _causal_conv1d_impl, ["conv_state", "out"], torch_ops.causal_conv1d),
    ):
        if not hasattr(getattr(torch.ops, NAMESPACE), name):
            direct_register_custom_op(
                name,
                impl,
                mutates_args=mutates,
                fake_impl=_no_output,
                target_lib=_LIB,
                dispatch_key="CPU",
            )
            # A second kernel of the op just defined (no schema: `impl` only adds a kernel).
            _LIB.impl(name, torch_impl, dispatch_key="MPS")


_register()


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Writes the paged attention of ``query`` into ``out`` (``[T, Hq, D]``, contiguous, query's
    dtype). ``sliding_window`` and ``softcap`` None (or 0) disable them; ``sinks`` ``[Hq]`` adds
    one logit per query head."""
    torch.ops.vllm_metal.paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        float(scale),
        int(sliding_window or 0),
        float(softcap or 0.0),
        sinks,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes row ``t`` of ``key``/``value`` into the pools at slot ``slot_mapping[t]``, in place;
    negative slots (padding) are skipped."""
    torch.ops.vllm_metal.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotates ``query [T, Hq, D]`` and ``key [T, Hkv, D]`` (or None) in place at ``positions``:
    the first ``rotary_dim`` (``cos_sin_cache``'s width: cos halves, then sin halves) elements of
    each head, GPT-NeoX halves or GPT-J pairs (``is_neox``); the rest pass through."""
    torch.ops.vllm_metal.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    *,
    silu: bool = False,
) -> None:
    """The causal depthwise convolution of each sequence of ``x`` continued from its window, the
    windows updated in place.

    ``x`` ``[T, C]`` packs ``S`` sequences by ``cu_seqlens`` (``[S+1]`` int32); ``weight``
    ``[C, K]``; ``bias`` ``[C]`` or None; ``conv_state`` ``[N, K-1, C]`` a pool of windows (any
    stride between them); sequence ``s`` continues from window ``state_indices[s]`` (``[S]``
    int32, distinct) or from zeros where ``has_state[s]`` (``[S]`` bool, None: all) is false. With
    ``u`` that window followed by the sequence's tokens,
    ``out[t, c] = act(bias[c] + sum_j weight[c, j] * u[t + j, c])`` (float32 sums; ``act`` SiLU
    when ``silu``, else the identity), written into ``out`` ``[T, C]``; afterwards the window
    holds the last ``K-1`` entries of ``u``. All of one dtype.

    ``torch.ops.vllm_metal.causal_conv1d`` runs the C++ CPU driver on `cpu` tensors and
    `torch_ops.causal_conv1d` on `mps` ones; windows whose rows are not contiguous (vLLM's "DS" conv
    state layout) take `torch_ops.causal_conv1d` on `cpu` too.
    """
    args = (
        x.contiguous(),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        conv_state,
        state_indices.to(torch.int32).contiguous(),
        None if has_state is None else has_state.contiguous(),
        cu_seqlens.to(torch.int32).contiguous(),
        out,
        silu,
    )
    rows_contiguous = conv_state.stride(-1) == 1 and conv_state.stride(-2) == conv_state.shape[-1]
    if x.device.type == "cpu" and not rows_contiguous:
        torch_ops.causal_conv1d(*args)
    else:
        torch.ops.vllm_metal.causal_conv1d(*args)
