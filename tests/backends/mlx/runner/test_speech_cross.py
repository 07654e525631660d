"""The cross-attention inputs of an encoder-decoder step (`runner/speech/cross.py`): where the
encoded states of new requests go, and what each decoder token reads."""

from __future__ import annotations

import numpy as np

from vllm_metal.backends.mlx.runner.batch import pack_batch
from vllm_metal.backends.mlx.runner.speech.cross import cross_inputs

BLOCK = 4


def test_a_decode_row_beside_a_request_being_encoded() -> None:
    # Row 0 decodes its 6th token; row 1 starts: a 3-token prompt and a 6-position encoder.
    tokens = np.zeros((2, 16), dtype=np.int32)
    self_tables = np.array([[0, 1, 0], [2, 0, 0]], dtype=np.int32)
    cross_table = np.array([[5, 6, 0], [9, 3, 0]], dtype=np.int32)
    packed = pack_batch(
        ["a", "b"],
        {"a": 1, "b": 3},
        np.array([5, 0]),
        np.array([6, 3]),
        tokens,
        [self_tables, cross_table],
        [BLOCK, BLOCK],
    )
    encoder_lens = np.array([6, 6])
    cross = cross_inputs(packed, cross_table, encoder_lens, np.array([1]), BLOCK)

    # The new request's 6 encoder positions: blocks 9 then 3.
    assert cross.slot_mapping.tolist() == [36, 37, 38, 39, 12, 13]
    # Four decoder tokens, each a one-query sequence over its request's 6 positions.
    assert cross.seq_lens.tolist() == [6, 6, 6, 6]
    assert cross.block_tables.tolist() == [[5, 6], [9, 3], [9, 3], [9, 3]]
    meta, tables = cross.device_views(packed.positions)
    assert np.asarray(meta.cu_seqlens_q).tolist() == [0, 1, 2, 3, 4]
    assert np.asarray(tables.slot_mapping).tolist() == cross.slot_mapping.tolist()


def test_no_request_encoded_writes_nothing() -> None:
    packed = pack_batch(
        ["a"],
        {"a": 1},
        np.array([2]),
        np.array([3]),
        np.zeros((1, 8), dtype=np.int32),
        [np.array([[0]], dtype=np.int32)],
        [BLOCK],
    )
    cross = cross_inputs(
        packed, np.array([[7, 8]]), np.array([5]), np.array([], dtype=np.int64), BLOCK
    )
    assert cross.slot_mapping.size == 0
    assert cross.block_tables.tolist() == [[7, 8]]
    assert cross.seq_lens.tolist() == [5]
