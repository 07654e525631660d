"""The torch backend's three kernels in plain torch ops, for tensors the C++ CPU drivers cannot take
(`mps`): kernels.py registers them as the "MPS" implementations of ``torch.ops.vllm_metal.*``.

Same contracts as the native ops (vllm_metal.ops.paged_attention, reshape_and_cache and
rotary_embedding, on tensors laid out as kernels.py describes); math in float32, results in the
inputs' dtype. Nothing here is specific to a device, so the tests run these bodies on `cpu` and
compare them with the native ops. They check no more than torch itself does: the arguments are
the ones the torch backend's layers pass (checked by the native ops on `cpu`).

Attention runs a step's query rows in a few batched calls rather than one per sequence: each
sequence's rows (split into chunks when its keys are long) are a work item that gathers the key
blocks its rows can see; items of similar size are padded to one shape and attend together under
an explicit position mask, through ``scaled_dot_product_attention`` or, with a softcap or sinks,
an explicit softmax. Per call it reads the sequence lengths and query offsets on the host once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Float32 elements a batched attention call may hold in padded logits and gathered keys and values
# (128 MiB); one sequence whose keys alone exceed it still runs as one call.
BATCH_ELEMENTS = 1 << 25
# A group of work items is padded to at most twice their own size (plus this many elements).
PADDING_SLACK = 1 << 20


@dataclass(frozen=True)
class _Item:
    """Query rows ``token .. token + rows - 1`` of sequence ``seq``, at positions from
    ``position``, seeing keys ``key_start .. key_end - 1`` held in table columns
    ``block .. block + blocks - 1``."""

    seq: int
    token: int
    rows: int
    position: int
    key_start: int
    key_end: int
    block: int
    blocks: int


def _work_items(
    lens: list[int],
    cu: list[int],
    block_size: int,
    sliding_window: int,
    num_heads: int,
    kv_row: int,
) -> list[_Item]:
    """Every sequence's query rows, split into chunks whose logits and keys fit in
    BATCH_ELEMENTS (at least one row a chunk)."""
    items = []
    for s, seq_len in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        if end <= start:
            continue
        span = (-(-seq_len // block_size) + 1) * block_size  # keys any chunk gathers, at most
        rows_per_chunk = max(1, (BATCH_ELEMENTS // span - 2 * kv_row) // num_heads)
        first = seq_len - (end - start)  # position of the sequence's first query row
        for token in range(start, end, rows_per_chunk):
            rows = min(rows_per_chunk, end - token)
            position = first + token - start
            key_start = max(0, position - sliding_window + 1) if sliding_window > 0 else 0
            key_end = position + rows
            block = key_start // block_size
            blocks = -(-key_end // block_size) - block
            items.append(_Item(s, token, rows, position, key_start, key_end, block, blocks))
    return items


def _groups(items: list[_Item], block_size: int, num_heads: int, kv_row: int) -> list[list[_Item]]:
    """The items in batches of similar shapes (few rows with few rows, short keys with short
    keys), each padded to at most BATCH_ELEMENTS and about twice its items' own size."""

    def cost(rows: int, blocks: int) -> int:
        return blocks * block_size * (num_heads * rows + 2 * kv_row)

    groups: list[list[_Item]] = []
    current: list[_Item] = []
    rows = blocks = useful = 0
    for item in sorted(items, key=lambda i: (i.rows, i.blocks)):
        new_useful = useful + cost(item.rows, item.blocks)
        padded = (len(current) + 1) * cost(max(rows, item.rows), max(blocks, item.blocks))
        if current and (padded > BATCH_ELEMENTS or padded > 2 * new_useful + PADDING_SLACK):
            groups.append(current)
            current, rows, blocks, new_useful = [], 0, 0, cost(item.rows, item.blocks)
        current.append(item)
        rows, blocks, useful = max(rows, item.rows), max(blocks, item.blocks), new_useful
    if current:
        groups.append(current)
    return groups


def paged_attention(
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
    """torch.ops.vllm_metal.paged_attention: the attention of ``query`` written into ``out``
    (``sliding_window`` and ``softcap`` 0 disable them)."""
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    host = torch.cat((seq_lens.to(torch.int64), cu_seqlens_q.to(torch.int64))).tolist()
    lens, cu = host[:num_seqs], host[num_seqs:]
    out[cu[-1] :].zero_()  # tokens outside every sequence
    kv_row = num_kv_heads * head_size
    items = _work_items(lens, cu, block_size, sliding_window, num_heads, kv_row)
    for group in _groups(items, block_size, num_heads, kv_row):
        _attend(
            group,
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            scale,
            sliding_window,
            softcap,
            sinks,
        )


def _attend(
    items: list[_Item],
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> None:
    """The attention of one batch of work items, padded to ``n`` items of ``q`` rows over ``k``
    keys; written into ``out`` at the items' own rows."""
    device = query.device
    num_heads, head_size = query.shape[1], query.shape[2]
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    group = num_heads // num_kv_heads
    n = len(items)
    q = max(i.rows for i in items)
    nb = max(i.blocks for i in items)
    k = nb * block_size

    # Per item (host, one copy to the device): sequence, rows, first token, first position,
    # visible keys, first table column.
    table = torch.tensor(
        [(i.seq, i.rows, i.token, i.position, i.key_start, i.key_end, i.block) for i in items],
        dtype=torch.int64,
    )
    # Packed rows of the padded [n * q] layout that are real rows, and their tokens.
    row = torch.arange(q)
    real = (row[None, :] < table[:, 1:2]).flatten().nonzero().squeeze(1)
    tokens = (table[:, 2:3] + row[None, :]).flatten()[real]
    table, real, tokens = (t.to(device) for t in (table, real, tokens))
    seq, rows, token, position, key_start, key_end, block = table.unbind(1)

    # Padding rows repeat their item's last row (finite, never written back).
    row = torch.minimum(torch.arange(q, device=device)[None, :], rows[:, None] - 1)
    query_pos = position[:, None] + row  # [n, q]
    key_pos = block[:, None] * block_size + torch.arange(k, device=device)[None, :]  # [n, k]

    # Keys and values [n, Hkv, k, D] in float32; slots no row may see (past a context's end,
    # the padding of a short item, blocks of other sequences) zeroed, as they may hold anything.
    columns = block[:, None] + torch.arange(nb, device=device)[None, :]
    columns = columns.clamp_(max=block_tables.shape[1] - 1)
    blocks = block_tables[seq[:, None], columns].long().clamp_(0, num_blocks - 1).flatten()
    unseen = ((key_pos < key_start[:, None]) | (key_pos >= key_end[:, None]))[:, :, None, None]

    def gather(pool: torch.Tensor) -> torch.Tensor:
        rows_ = pool.index_select(0, blocks).view(n, k, num_kv_heads, head_size)
        return rows_.float().masked_fill(unseen, 0.0).transpose(1, 2)

    keys, values = gather(key_cache), gather(value_cache)

    # Queries [n, Hkv, group * q, D]: query head h = kv * group + g reads KV head kv.
    queries = query.index_select(0, (token[:, None] + row).flatten()).float()
    queries = queries.view(n, q, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    queries = queries.reshape(n, num_kv_heads, group * q, head_size)

    visible = key_pos[:, None, :] <= query_pos[:, :, None]  # [n, q, k]
    if sliding_window > 0:
        visible &= key_pos[:, None, :] > query_pos[:, :, None] - sliding_window
    mask = visible[:, None, None].expand(n, 1, group, q, k).reshape(n, 1, group * q, k)

    if softcap <= 0 and sinks is None:
        result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    else:
        logits = (queries @ keys.transpose(-1, -2)) * scale
        if softcap > 0:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits.masked_fill(~mask, float("-inf"))
        if sinks is None:
            probs = logits.softmax(-1)
        else:
            sink = sinks.to(device=device, dtype=torch.float32).view(num_kv_heads, group, 1, 1)
            sink = sink.expand(num_kv_heads, group, q, 1).reshape(1, num_kv_heads, group * q, 1)
            sink = sink.expand(n, num_kv_heads, group * q, 1)
            probs = torch.cat((sink, logits), dim=-1).softmax(-1)[..., 1:]
        result = probs @ values

    # [n, Hkv, group, q, D] -> [n * q, Hq, D], real rows only, into out.
    result = result.view(n, num_kv_heads, group, q, head_size).permute(0, 3, 1, 2, 4)
    result = result.reshape(n * q, num_heads, head_size).index_select(0, real)
    out.index_copy_(0, tokens, result.to(out.dtype))


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """torch.ops.vllm_metal.reshape_and_cache: row ``t`` of ``key``/``value`` written into the
    pools (any block stride) at slot ``slot_mapping[t]``; negative slots skipped."""
    block_size = key_cache.shape[1]
    tokens = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping.index_select(0, tokens).long()
    where = (torch.div(slots, block_size, rounding_mode="floor"), slots % block_size)
    key_cache.index_put_(where, key.index_select(0, tokens))
    value_cache.index_put_(where, value.index_select(0, tokens))


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """torch.ops.vllm_metal.rotary_embedding: ``query`` and ``key`` (or None) rotated in place,
    positions clamped into the cache's rows."""
    max_position, rotary_dim = cos_sin_cache.shape
    half = rotary_dim // 2
    index = positions.long().clamp(0, max_position - 1)
    rows = cos_sin_cache.index_select(0, index).float()[:, None, :]  # [T, 1, R]
    cos, sin = rows[..., :half], rows[..., half:]
    for x in (query, key):
        if x is None:
            continue
        if is_neox:
            x1, x2 = x[..., :half], x[..., half:rotary_dim]
        else:
            x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        a, b = x1.float(), x2.float()
        # Both results before either write: for float32, a and b are the views themselves.
        o1, o2 = a * cos - b * sin, b * cos + a * sin
        x1.copy_(o1)
        x2.copy_(o2)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    silu: bool = False,
) -> None:
    """`kernels.causal_conv1d` in torch ops (any device, any layout): every sequence's window and tokens
    laid side by side in one buffer, each output row gathering its ``K`` inputs from it."""
    num_seqs = state_indices.shape[0]
    channels, width = weight.shape
    keep = width - 1
    indices = state_indices.to(torch.long)
    windows = conv_state[indices].to(x.dtype)  # [S, K-1, C]
    if has_state is not None:
        windows = torch.where(has_state.view(-1, 1, 1), windows, torch.zeros_like(windows))
    buffer = torch.cat([windows.reshape(num_seqs * keep, channels), x])
    cu = cu_seqlens.to(torch.long)
    lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=x.device), lens)
    local = torch.arange(x.shape[0], device=x.device) - cu[:-1][seq]

    def rows(s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Buffer row of entry ``u`` of sequence ``s``'s window-then-tokens."""
        return torch.where(u < keep, s * keep + u, num_seqs * keep + cu[:-1][s] + u - keep)

    taps = rows(seq[:, None], local[:, None] + torch.arange(width, device=x.device))  # [T, K]
    y = (buffer[taps].float() * weight.float().t()[None]).sum(dim=1)
    if bias is not None:
        y = y + bias.float()
    if silu:
        y = torch.nn.functional.silu(y)
    out.copy_(y.to(out.dtype))
    tail = lens[:, None] + torch.arange(keep, device=x.device)  # the last K-1 entries of each u
    every = torch.arange(num_seqs, device=x.device)[:, None]
    conv_state[indices] = buffer[rows(every, tail)].to(conv_state.dtype)
