"""rotary_embedding: vLLM's rotary position embedding (RotaryEmbedding.forward_native) of the
query and key heads of a step, both styles, partial rotary dims.

Defined (docstring) and validated here once; implemented by reference.py (and natively where the
extension provides it).
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.ops import _backend
from vllm_metal.ops import _validate as v
from vllm_metal.ops.rope import reference


def rotary_embedding(
    positions: mx.array,
    query: mx.array,
    key: mx.array,
    cos_sin_cache: mx.array,
    is_neox: bool,
) -> tuple[mx.array, mx.array]:
    """Rotates the first ``rotary_dim`` elements of every query and key head by its token's
    position.

    ``positions`` ``[T]`` int32 or int64; ``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hkv, D]``
    of one float dtype (any strides); ``cos_sin_cache`` ``[max_position, rotary_dim]``, float32
    or the dtype of ``query``, row ``p`` holding ``cos(p * f_i)`` for ``i < rotary_dim / 2`` and
    then ``sin(p * f_i)``; ``rotary_dim`` even, ``2 <= rotary_dim <= D``.

    With ``c, s`` the two halves of row ``positions[t]``, each head ``x`` of token ``t`` gets
    ``x1' = x1 * c - x2 * s`` and ``x2' = x2 * c + x1 * s`` (in float32), where ``(x1, x2)`` are
    the halves ``x[:R/2]``, ``x[R/2:R]`` when ``is_neox`` and the interleaved pairs ``x[0:R:2]``,
    ``x[1:R:2]`` (GPT-J style) otherwise, written back to the same elements; ``x[R:]`` passes
    through unchanged. Returns ``(query, key)`` rotated, new arrays of the dtype of ``query``.

    Positions outside ``[0, max_position)`` are clamped into it (never an error, never read out
    of bounds): a negative position uses row 0, a too-large one the last row.
    """
    check_rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    native = _backend.native()
    impl = native if native is not None and hasattr(native, "rotary_embedding") else reference
    return impl.rotary_embedding(positions, query, key, cos_sin_cache, bool(is_neox))


def check_rotary_embedding(
    positions: object, query: object, key: object, cos_sin_cache: object, is_neox: object
) -> None:
    """Raises ValueError (naming the argument) unless the shapes and dtypes fit together."""
    (t,) = v.shape("positions", positions, 1, "[num_tokens]")
    if positions.dtype not in (mx.int32, mx.int64):
        v.fail(f"positions must be int32 or int64, got {v.dtype_name(positions.dtype)}")
    qt, _, d = v.shape("query", query, 3, "[num_tokens, num_heads, head_size]")
    if qt != t:
        v.fail(
            f"query must have shape [num_tokens = {t}, num_heads, head_size], "
            f"got {tuple(query.shape)}"
        )
    v.float_dtype("query", query)
    kt, _, kd = v.shape("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    if (kt, kd) != (t, d):
        v.fail(f"key must have shape [{t}, num_kv_heads, {d}], got {tuple(key.shape)}")
    v.same_dtype("key", key, "query", query)
    max_position, rotary_dim = v.shape(
        "cos_sin_cache", cos_sin_cache, 2, "[max_position, rotary_dim]"
    )
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > d:
        v.fail(
            f"cos_sin_cache must have shape [max_position, rotary_dim] with rotary_dim even and "
            f"in [2, head_size = {d}], got {tuple(cos_sin_cache.shape)}"
        )
    if max_position < 1:
        v.fail("cos_sin_cache must have at least one row (max_position >= 1)")
    if cos_sin_cache.dtype not in (mx.float32, query.dtype):
        v.fail(
            f"cos_sin_cache must be float32 or the dtype of query "
            f"({v.dtype_name(query.dtype)}), got {v.dtype_name(cos_sin_cache.dtype)}"
        )
    if not isinstance(is_neox, bool):
        v.fail(f"is_neox must be a bool, got {type(is_neox).__name__}")
