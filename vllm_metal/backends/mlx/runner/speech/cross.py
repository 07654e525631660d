"""Cross-attention inputs of one encoder-decoder step, from the packed batch.

vLLM gives each request of an encoder-decoder model a second KV-cache group (`CrossAttentionSpec`)
whose blocks hold the encoder's K/V, one slot per encoder position. On the step that encodes a
request (`SchedulerOutput.scheduled_encoder_inputs`), its encoder states are written into those
slots; every decoder token of every later step attends to all of them. Cross-attention is not
causal, so each packed decoder token is given to the paged attention op as its own one-query
sequence whose context is its request's whole encoder length.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_metal.backends.mlx.runner.batch import PackedBatch, ranges
from vllm_metal.kv.paged_cache import GroupTables, StepMetadata


@dataclass
class CrossInputs:
    """Host arrays of a step's cross-attention, moved to the device by `device_views`."""

    block_tables: np.ndarray  # [T, max_blocks] int32: each token's request's cross blocks
    seq_lens: np.ndarray  # [T] int32: each token's request's encoder length
    slot_mapping: np.ndarray  # [sum of encoded lengths] int64: where encoded states go
    encoded_lens: np.ndarray  # [N]: the encoder length of each request encoded this step

    def device_views(self, positions: np.ndarray) -> tuple[StepMetadata, GroupTables]:
        num_tokens = len(self.seq_lens)
        meta = StepMetadata(
            positions=mx.array(positions),
            seq_lens=mx.array(self.seq_lens),
            cu_seqlens_q=mx.arange(num_tokens + 1, dtype=mx.int32),
            groups=[],
        )
        tables = GroupTables(
            block_tables=mx.array(self.block_tables), slot_mapping=mx.array(self.slot_mapping)
        )
        return meta, tables


def cross_inputs(
    packed: PackedBatch,
    cross_table: np.ndarray,
    encoder_lens: np.ndarray,
    encoded_rows: np.ndarray,
    block_size: int,
) -> CrossInputs:
    """`cross_table`: the cross group's block table rows of the batch (`[S, >= blocks]`);
    `encoder_lens [S]`: each request's encoder length; `encoded_rows`: rows encoded this step,
    in the order their states are packed."""
    num_reqs = len(packed.req_ids)
    max_blocks = max(1, -(-int(encoder_lens.max(initial=1)) // block_size))
    table = np.ascontiguousarray(cross_table[:num_reqs, :max_blocks], dtype=np.int32)
    row_of_token = np.repeat(np.arange(num_reqs), packed.num_scheduled)

    lens = encoder_lens[encoded_rows].astype(np.int64)
    rows = np.repeat(encoded_rows, lens)
    positions = ranges(lens)
    slots = table[rows, positions // block_size].astype(np.int64) * block_size
    return CrossInputs(
        block_tables=table[row_of_token],
        seq_lens=encoder_lens[row_of_token].astype(np.int32),
        slot_mapping=slots + positions % block_size,
        encoded_lens=lens,
    )
