"""The pure-MLX paged attention the op runs where the native kernels cannot (no Metal GPU for them,
or no `_C`): one graph for the whole batch, no Python loop over sequences.

The query rows are cut into tiles, each a run of rows of one sequence: decode rows (sequences with
one query token) are tiles of one row, longer query runs tiles of up to ``TILE`` rows. Each tile
gathers the blocks of its sequence that its last row can see, and one fused attention call covers
every tile of a kind (`mx.fast.scaled_dot_product_attention`: softmax in float32, products in
the inputs' dtype). Where the tiles sit is worked out on the host from ``cu_seqlens_q`` and
``seq_lens`` once per step (`plan`), not per layer: every layer of a step passes the same arrays.
A decode step (`decode`: one query row per sequence) needs no plan: each row is its sequence's
tile and reads every block of its table row, so nothing is read on the host and the call can be
traced by `mx.compile`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from vllm_metal.ops.fp8 import KVQuant

# Query rows per tile of a sequence with several query tokens (prefill chunks, verified drafts).
TILE = 64
_PLANS_KEPT = 8  # one step's groups (sliding + full) with room to spare


@dataclass
class _Tiles:
    rows: mx.array  # [n, C] packed query row of each tile row (T, a zero row, for padding)
    positions: np.ndarray  # [n, C] position of each tile row (0 for padding)
    key_blocks: mx.array  # [n, num_blocks] the pool blocks each tile reads
    key_lens: np.ndarray  # [n] keys a tile may read: its sequence's length
    masks: dict = field(
        default_factory=dict
    )  # sliding window -> ([n, 1, C, L] visible, [n, L, 1, 1])


@dataclass
class Plan:
    """Where every query row of one step goes: tiles of one row and tiles of several, and the
    row of the tiles' concatenated output each packed token takes back."""

    groups: list[_Tiles]
    source: mx.array  # [T] rows of concat(tile outputs..., one zero row)


_plans: dict[tuple[int, ...], tuple[tuple[mx.array, ...], Plan]] = {}


def plan_for(
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    num_tokens: int,
    block_size: int,
) -> Plan:
    """The step's `Plan`, made once for these (immutable) arrays and reused by later calls with
    the same ones; the arrays are held so that their ids stay theirs."""
    key = (id(block_tables), id(seq_lens), id(cu_seqlens_q), num_tokens, block_size)
    hit = _plans.get(key)
    if hit is not None:
        return hit[1]
    made = make_plan(block_tables, seq_lens, cu_seqlens_q, num_tokens, block_size)
    if len(_plans) >= _PLANS_KEPT:
        del _plans[next(iter(_plans))]
    _plans[key] = ((block_tables, seq_lens, cu_seqlens_q), made)
    return made


def make_plan(
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    num_tokens: int,
    block_size: int,
) -> Plan:
    cu = np.asarray(cu_seqlens_q).astype(np.int64)
    lens = np.asarray(seq_lens).astype(np.int64)
    q_lens = np.diff(cu)
    source = np.full(num_tokens, -1, dtype=np.int64)
    groups: list[_Tiles] = []
    offset = 0
    for picked in (np.nonzero(q_lens == 1)[0], np.nonzero(q_lens > 1)[0]):
        if picked.size == 0:
            continue
        width = int(min(TILE, q_lens[picked].max()))
        per_seq = -(-q_lens[picked] // width)
        seqs = np.repeat(picked, per_seq)
        first = (
            np.arange(per_seq.sum()) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
        ) * width
        row_in_seq = first[:, None] + np.arange(width)[None, :]
        live = row_in_seq < q_lens[seqs][:, None]
        rows = np.where(live, cu[seqs][:, None] + row_in_seq, num_tokens)
        positions = np.where(live, (lens - q_lens)[seqs][:, None] + row_in_seq, 0)
        num_blocks = min(math.ceil((int(positions.max()) + 1) / block_size), block_tables.shape[1])
        source[rows[live]] = offset + np.nonzero(live.ravel())[0]
        offset += rows.size
        groups.append(
            _Tiles(
                rows=mx.array(rows.astype(np.int32)),
                positions=positions,
                key_blocks=block_tables[mx.array(seqs.astype(np.int32)), :num_blocks],
                key_lens=lens[seqs],
            )
        )
    source[source < 0] = offset  # tokens outside every sequence read the zero row
    return Plan(groups, mx.array(source.astype(np.int32)))


def _masks(tiles: _Tiles, num_keys: int, sliding_window: int | None) -> tuple[mx.array, mx.array]:
    """Which keys each tile row sees (`[n, 1, C, L]`), and which gathered keys are the
    sequence's at all (`[n, L, 1, 1]`: the rest are unwritten slots, zeroed before use)."""
    cached = tiles.masks.get(sliding_window)
    if cached is None:
        key_pos = np.arange(num_keys)[None, None, :]
        query_pos = tiles.positions[:, :, None]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        written = np.arange(num_keys)[None, :] < tiles.key_lens[:, None]
        cached = (mx.array(visible[:, None]), mx.array(written[:, :, None, None]))
        tiles.masks[sliding_window] = cached
    return cached


def paged_attention(
    query: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
    quant: KVQuant | None = None,
    uniform: int | None = None,
) -> mx.array:
    """vllm_metal.ops.paged_attention on validated arguments (without ``key_ends``); ``quant``:
    the pools hold fp8 bytes, dequantized to the query's dtype as they are gathered;
    ``uniform``: every sequence has that many query rows (`decode_attention`)."""
    if uniform is not None:
        return decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale=scale,
            sliding_window=sliding_window, softcap=softcap, sinks=sinks, quant=quant,
            rows=uniform,
        )  # fmt: skip
    num_tokens, num_heads, head_size = query.shape
    block_size = key_cache.shape[1]
    steps = plan_for(block_tables, seq_lens, cu_seqlens_q, num_tokens, block_size)
    padded = mx.concatenate([query, mx.zeros((1, num_heads, head_size), query.dtype)])
    outputs = []
    for tiles in steps.groups:
        n, width = tiles.positions.shape
        num_keys = tiles.key_blocks.shape[1] * block_size
        visible, written = _masks(tiles, num_keys, sliding_window)
        q = padded[tiles.rows].transpose(0, 2, 1, 3)  # [n, Hq, C, D]
        kv = _gather(key_cache, value_cache, tiles.key_blocks, written, quant, query.dtype)
        out = _attend(q, *kv, visible, scale, softcap, sinks)
        outputs.append(out.transpose(0, 2, 1, 3).reshape(n * width, num_heads, head_size))
    outputs.append(mx.zeros((1, num_heads, head_size), query.dtype))
    return mx.concatenate(outputs)[steps.source]


def decode_attention(
    query: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
    quant: KVQuant | None = None,
    rows: int = 1,
) -> mx.array:
    """`paged_attention` of a step where every sequence has ``rows`` query rows (a decode step at
    one), all on the device: query row ``s * rows + i`` is sequence ``s``'s at position
    ``seq_lens[s] - rows + i`` and gathers every block of ``block_tables[s]``; keys past the
    sequence's length (unwritten slots, padding columns) are zeroed and masked."""
    num_seqs = block_tables.shape[0]
    num_heads, head_size = query.shape[1:]
    num_keys = block_tables.shape[1] * key_cache.shape[1]
    key_pos = mx.arange(num_keys, dtype=mx.int32)[None, None, :]
    query_pos = (seq_lens[:, None] - rows + mx.arange(rows, dtype=mx.int32)[None, :])[..., None]
    visible = key_pos <= query_pos  # [S, rows, L]
    if sliding_window is not None:
        visible = visible & (key_pos > query_pos - sliding_window)
    written = (key_pos[0] < seq_lens[:, None])[:, :, None, None]  # [S, L, 1, 1]
    kv = _gather(key_cache, value_cache, block_tables, written, quant, query.dtype)
    q = query.reshape(num_seqs, rows, num_heads, head_size).transpose(0, 2, 1, 3)
    out = _attend(q, *kv, visible[:, None], scale, softcap, sinks)  # [S, Hq, rows, D]
    return out.transpose(0, 2, 1, 3).reshape(num_seqs * rows, num_heads, head_size)


def _gather(
    key_cache: mx.array,
    value_cache: mx.array,
    key_blocks: mx.array,
    written: mx.array,
    quant: KVQuant | None,
    dtype: mx.Dtype,
) -> list[mx.array]:
    """Keys and values of ``key_blocks`` (`[n, blocks]`) as `[n, Hkv, L, D]`, dequantized to
    ``dtype`` from an fp8 pool; slots not ``written`` (`[n, L, 1, 1]`) read as zeros."""
    n = key_blocks.shape[0]
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    num_keys = key_blocks.shape[1] * block_size
    kv = []
    for pool, read in ((key_cache, "keys"), (value_cache, "values")):
        rows = pool[key_blocks].reshape(n, num_keys, num_kv_heads, head_size)
        if quant is not None:
            rows = getattr(quant, read)(rows, dtype)
        kv.append(mx.where(written, rows, 0).transpose(0, 2, 1, 3))
    return kv


def _attend(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    visible: mx.array,
    scale: float,
    softcap: float | None,
    sinks: mx.array | None,
) -> mx.array:
    """Attention of tiles `[n, Hq, C, D]` over their keys where ``visible`` (`[n, 1, C, L]`)."""
    if softcap is None:
        # The fused call takes sinks in the output's dtype (one rounding of a logit).
        sink = None if sinks is None else sinks.astype(q.dtype)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=visible, sinks=sink)
    return _softcapped(q, k, v, visible, scale, softcap, sinks)


def _softcapped(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    visible: mx.array,
    scale: float,
    softcap: float,
    sinks: mx.array | None,
) -> mx.array:
    """Attention with soft-capped logits, which the fused call does not do: float32 throughout."""
    n, num_heads, width, head_size = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    q = q.astype(mx.float32).reshape(n, num_kv_heads, group, width, head_size)
    logits = (q @ k.astype(mx.float32).swapaxes(-1, -2)[:, :, None]) * scale
    logits = softcap * mx.tanh(logits / softcap)
    logits = mx.where(visible[:, :, None], logits, -mx.inf)
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, num_kv_heads, group, 1, 1)
        sink = mx.broadcast_to(sink, (n, num_kv_heads, group, width, 1))
        probs = mx.softmax(mx.concatenate([sink, logits], axis=-1), axis=-1)[..., 1:]
    else:
        probs = mx.softmax(logits, axis=-1)
    out = probs @ v.astype(mx.float32)[:, :, None]
    return out.reshape(n, num_heads, width, head_size).astype(v.dtype)
