"""The pure-MLX cache write the op runs where the native kernels cannot: one scatter per pool for
the whole step.

``slot_mapping`` is read on the host once per step (`plan`: every layer of a step passes the same
array, which the runner made from host data, so reading it waits for nothing); padding rows are
dropped there, so the scatter writes only rows with a slot and nothing else reads the pools:
MLX then writes into the pools' own memory when nothing else holds them. A caller whose slots are
all in range (`padded=False`: a compiled decode step) skips the plan, reading nothing on the host.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_KEPT = 4
_plans: dict[tuple[int, int], tuple[mx.array, tuple[mx.array | None, mx.array | None]]] = {}


def plan(slot_mapping: mx.array, num_slots: int) -> tuple[mx.array | None, mx.array | None]:
    """(the slots written, the rows written to them: None for all rows in order) for this
    step's ``slot_mapping``; (None, None) when no row has a slot. Made once per array."""
    key = (id(slot_mapping), num_slots)
    hit = _plans.get(key)
    if hit is not None:
        return hit[1]
    slots = np.asarray(slot_mapping).astype(np.int64)
    valid = (slots >= 0) & (slots < num_slots)
    if valid.all():
        made: tuple[mx.array | None, mx.array | None] = (slot_mapping, None)
    elif valid.any():
        rows = np.nonzero(valid)[0]
        made = (mx.array(slots[rows]), mx.array(rows.astype(np.int32)))
    else:
        made = (None, None)
    if len(_plans) >= _KEPT:
        del _plans[next(iter(_plans))]
    _plans[key] = (slot_mapping, made)
    return made


def reshape_and_cache(
    key: mx.array,
    value: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    slot_mapping: mx.array,
    padded: bool = True,
) -> tuple[mx.array, mx.array]:
    """vllm_metal.ops.reshape_and_cache on validated arguments. Returns new pool arrays."""
    if not padded:
        return scatter_rows(key_cache, key, slot_mapping), scatter_rows(
            value_cache, value, slot_mapping
        )
    slots, rows = plan(slot_mapping, key_cache.shape[0] * key_cache.shape[1])
    if slots is None:
        return key_cache, value_cache
    return _write(key_cache, key, slots, rows), _write(value_cache, value, slots, rows)


def scatter_rows(pool: mx.array, values: mx.array, slots: mx.array) -> mx.array:
    """`pool` (`[num_blocks, block_size, ...]`) with row `t` of `values` at slot `slots[t]`,
    every slot in range (nothing is read on the host). A new array."""
    return _write(pool, values, slots, None)


def _write(pool: mx.array, values: mx.array, slots: mx.array, rows: mx.array | None) -> mx.array:
    flat = pool.reshape(-1, *pool.shape[2:])
    flat[slots] = values if rows is None else values[rows]
    return flat.reshape(pool.shape)
