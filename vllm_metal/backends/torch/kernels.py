"""Torch custom ops over this project's CPU paged-attention, KV-cache-write and rotary-embedding
kernels: what the torch backend's attention (`attention.py`) and rotary layers (`rotary.py`) call.
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
them. The ops are registered with a schema and a fake implementation, so a tracer sees them as
opaque calls that mutate ``out`` (attention), the two pools (cache write) or query and key (rope).

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

from vllm_metal.backends.torch import torch_ops

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
    return _native._C


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
