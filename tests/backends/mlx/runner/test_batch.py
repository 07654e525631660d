"""Packed varlen batches match the DESIGN contract for hand-built vLLM schedules: positions
p = seq_lens - q_len + i, slot = block_id * block_size + p % block_size, tokens from the prompt
and the sampled outputs, one slot mapping per KV-cache group, discard and prompt-logprob rows."""

from __future__ import annotations

import numpy as np
from numpy.testing import assert_array_equal
from vllm.sampling_params import SamplingParams

from tests.backends.mlx.runner.schedules import Cached, new_req, sample, schedule, span, step
from vllm_metal.backends.mlx.runner.batch import prefill_batch
from vllm_metal.backends.mlx.runner.prompt_logprobs import prompt_logprob_rows
from vllm_metal.backends.mlx.runner.request_state import RequestStates


def test_single_chunk_prefills_pack_back_to_back(states):
    a, b = span(100, 5), span(200, 3)
    packed = step(
        states,
        schedule({"a": 5, "b": 3}, new=[new_req("a", a, [[2, 6]]), new_req("b", b, [[4]])]),
    )
    assert packed.req_ids == ["a", "b"]
    assert_array_equal(packed.num_scheduled, [5, 3])
    assert_array_equal(packed.cu_seqlens_q, [0, 5, 8])
    assert_array_equal(packed.token_ids, a + b)
    assert_array_equal(packed.positions, [0, 1, 2, 3, 4, 0, 1, 2])
    assert_array_equal(packed.seq_lens, [5, 3])
    # a: block 2 holds positions 0-3, block 6 position 4; b: block 4.
    assert_array_equal(packed.slot_mappings[0], [8, 9, 10, 11, 24, 16, 17, 18])
    table = packed.block_tables[0]
    assert table.shape == (2, 2) and table.dtype == np.int32
    assert_array_equal(table[0], [2, 6])
    assert table[1, 0] == 4
    assert_array_equal(packed.logits_indices, [4, 7])
    assert_array_equal(packed.discard, [False, False])
    assert packed.num_tokens == 8


def test_chunked_prefill_resumes_where_the_last_chunk_stopped(states):
    prompt = span(100, 10)
    first = step(states, schedule({"a": 6}, new=[new_req("a", prompt, [[7, 3]])]))
    assert_array_equal(first.token_ids, prompt[:6])
    assert_array_equal(first.positions, span(0, 6))
    assert_array_equal(first.slot_mappings[0], [28, 29, 30, 31, 12, 13])
    assert_array_equal(first.seq_lens, [6])
    assert_array_equal(first.logits_indices, [5])
    assert_array_equal(first.discard, [True])
    sample(states, {})

    second = step(states, schedule({"a": 4}, cached=[Cached("a", 6, 0, ([9],))]))
    assert_array_equal(second.token_ids, prompt[6:])
    assert_array_equal(second.positions, [6, 7, 8, 9])
    assert_array_equal(second.slot_mappings[0], [14, 15, 36, 37])
    assert_array_equal(second.seq_lens, [10])
    assert_array_equal(second.cu_seqlens_q, [0, 4])
    assert_array_equal(second.block_tables[0], [[7, 3, 9]])
    assert_array_equal(second.discard, [False])


def test_prefix_cache_hit_computes_only_the_uncached_tail(states):
    prompt = span(200, 10)
    packed = step(states, schedule({"b": 2}, new=[new_req("b", prompt, [[7, 3, 9]], 8)]))
    assert_array_equal(packed.token_ids, [208, 209])
    assert_array_equal(packed.positions, [8, 9])
    assert_array_equal(packed.slot_mappings[0], [36, 37])
    assert_array_equal(packed.seq_lens, [10])
    assert_array_equal(packed.cu_seqlens_q, [0, 2])
    assert_array_equal(packed.discard, [False])


def test_decode_feeds_the_last_sampled_token_into_appended_blocks(states):
    step(states, schedule({"a": 7}, new=[new_req("a", span(100, 7), [[5, 2]])]))
    sample(states, {"a": 500})

    packed = step(states, schedule({"a": 1}, cached=[Cached("a", 7, 1)]))
    assert_array_equal(packed.token_ids, [500])
    assert_array_equal(packed.positions, [7])
    assert_array_equal(packed.slot_mappings[0], [11])  # block 2, offset 3
    assert_array_equal(packed.seq_lens, [8])
    sample(states, {"a": 501})

    packed = step(states, schedule({"a": 1}, cached=[Cached("a", 8, 2, ([9],))]))
    assert_array_equal(packed.token_ids, [501])
    assert_array_equal(packed.positions, [8])
    assert_array_equal(packed.slot_mappings[0], [36])  # new block 9, offset 0
    assert_array_equal(packed.seq_lens, [9])
    assert_array_equal(packed.block_tables[0], [[5, 2, 9]])
    assert_array_equal(packed.discard, [False])


def test_resumed_request_recomputes_prompt_and_outputs_in_replacement_blocks(states):
    a, b = span(100, 6), span(200, 3)
    step(
        states, schedule({"a": 6, "b": 3}, new=[new_req("a", a, [[1, 2]]), new_req("b", b, [[3]])])
    )
    sample(states, {"a": 500, "b": 600})
    step(states, schedule({"a": 1, "b": 1}, cached=[Cached("a", 6, 1), Cached("b", 3, 1)]))
    sample(states, {"a": 501, "b": 601})

    # a is preempted: vLLM frees its blocks and stops scheduling it.
    packed = step(states, schedule({"b": 1}, cached=[Cached("b", 4, 2, ([8],))]))
    assert packed.req_ids == ["b"]
    assert_array_equal(packed.token_ids, [601])
    assert_array_equal(packed.slot_mappings[0], [32])
    sample(states, {"b": 602})

    resumed = Cached("a", 0, 2, ([6, 11],), resumed=True)
    packed = step(states, schedule({"b": 1, "a": 8}, cached=[Cached("b", 5, 3), resumed]))
    assert packed.req_ids == ["b", "a"]  # the decode first
    assert_array_equal(packed.cu_seqlens_q, [0, 1, 9])
    assert_array_equal(packed.token_ids, [602] + a + [500, 501])
    assert_array_equal(packed.positions, [5] + span(0, 8))
    assert_array_equal(packed.seq_lens, [6, 8])
    # b: block 8 offset 1; a: its replacement blocks 6 and 11 only, from position 0.
    assert_array_equal(packed.slot_mappings[0], [33, 24, 25, 26, 27, 44, 45, 46, 47])
    assert_array_equal(packed.block_tables[0][1], [6, 11])
    assert_array_equal(packed.logits_indices, [0, 8])
    assert_array_equal(packed.discard, [False, False])


def test_each_kv_cache_group_gets_its_own_slot_mapping(vllm_config):
    states = RequestStates(vllm_config, [16, 16])
    prompt = span(100, 40)
    first = step(states, schedule({"a": 20}, new=[new_req("a", prompt, [[3, 7], [12, 1]])]))
    assert_array_equal(first.positions, span(0, 20))
    assert_array_equal(first.slot_mappings[0], span(48, 16) + span(112, 4))
    assert_array_equal(first.slot_mappings[1], span(192, 16) + span(16, 4))
    assert_array_equal(first.block_tables[0], [[3, 7]])
    assert_array_equal(first.block_tables[1], [[12, 1]])
    assert first.slot_mappings[0].dtype == np.int64
    sample(states, {})

    second = step(states, schedule({"a": 20}, cached=[Cached("a", 20, 0, ([9], [4]))]))
    assert_array_equal(second.token_ids, prompt[20:])
    assert_array_equal(second.positions, span(20, 20))
    assert_array_equal(second.slot_mappings[0], span(116, 12) + span(144, 8))
    assert_array_equal(second.slot_mappings[1], span(20, 12) + span(64, 8))
    assert_array_equal(second.block_tables[0], [[3, 7, 9]])
    assert_array_equal(second.block_tables[1], [[12, 1, 4]])
    assert_array_equal(second.seq_lens, [40])


def test_discard_marks_only_rows_that_stop_inside_the_prompt(states):
    a, b, c, d = span(100, 4), span(200, 10), span(300, 6), span(400, 9)
    step(states, schedule({"a": 4, "c": 3}, new=[new_req("a", a, [[1]]), new_req("c", c, [[4]])]))
    sample(states, {"a": 500})

    packed = step(
        states,
        schedule(
            {"a": 1, "c": 3, "b": 9, "d": 1},
            new=[new_req("b", b, [[2, 3, 10]]), new_req("d", d, [[7, 8, 9]], 8)],
            cached=[Cached("a", 4, 1, ([6],)), Cached("c", 3, 0, ([5],))],
        ),
    )
    # decode, then the one-token prefix-cache tail, then the chunk with context, then the new
    # prefill (vLLM's decode / short extend / long extend / prefill order).
    assert packed.req_ids == ["a", "d", "c", "b"]
    assert_array_equal(packed.cu_seqlens_q, [0, 1, 2, 5, 14])
    assert_array_equal(packed.token_ids, [500, 408, 303, 304, 305] + b[:9])
    assert_array_equal(packed.positions, [4, 8, 3, 4, 5] + span(0, 9))
    assert_array_equal(packed.seq_lens, [5, 9, 6, 9])
    assert_array_equal(packed.slot_mappings[0], [24, 36, 19, 20, 21] + span(8, 8) + [40])
    assert_array_equal(packed.logits_indices, [0, 1, 4, 13])
    assert_array_equal(packed.discard, [False, False, False, True])  # b stops one token short


def test_prompt_logprob_rows_follow_the_prompt_across_chunks(states):
    logprobs = SamplingParams(temperature=0.0, prompt_logprobs=2)
    step(states, schedule({"a": 4}, new=[new_req("a", span(100, 4), [[1]])]))
    sample(states, {"a": 500})

    packed = step(
        states,
        schedule(
            {"a": 1, "p": 6},
            new=[new_req("p", span(200, 10), [[2, 3]], params=logprobs)],
            cached=[Cached("a", 4, 1, ([5],))],
        ),
    )
    assert packed.req_ids == ["a", "p"]
    rows = prompt_logprob_rows(states, packed)
    assert rows.keys() == {"p"}  # a did not ask
    # positions 0-5, each followed by a prompt token: packed rows 1-6
    assert_array_equal(rows["p"], [1, 2, 3, 4, 5, 6])
    sample(states, {"a": 501})

    packed = step(
        states, schedule({"a": 1, "p": 4}, cached=[Cached("a", 5, 2), Cached("p", 6, 0, ([4],))])
    )
    assert packed.req_ids == ["a", "p"]
    rows = prompt_logprob_rows(states, packed)
    # positions 6-9: the last one is followed by the first sampled token, not a prompt token
    assert_array_equal(rows["p"], [1, 2, 3])
    assert rows["p"].dtype == np.int32


def test_prefill_batch_is_one_sequence_in_blocks_from_zero():
    packed = prefill_batch(num_tokens=6, block_size=4, num_groups=2, vocab_size=768)
    assert packed.req_ids == ["dummy"]
    assert_array_equal(packed.cu_seqlens_q, [0, 6])
    assert_array_equal(packed.positions, span(0, 6))
    assert_array_equal(packed.seq_lens, [6])
    assert len(packed.block_tables) == len(packed.slot_mappings) == 2
    for table, slots in zip(packed.block_tables, packed.slot_mappings):
        assert_array_equal(table, [[0, 1]])
        assert_array_equal(slots, [0, 1, 2, 3, 4, 5])  # blocks 0 and 1, in order
    assert_array_equal(packed.logits_indices, [5])
    assert_array_equal(packed.discard, [False])
    assert packed.token_ids.shape == (6,) and packed.token_ids.max() < 768


def test_a_windowed_groups_table_names_the_null_block_where_the_window_has_passed():
    """Blocks wholly before the window of a request's first row in the step read as block 0 (vLLM
    frees them; freed, they may hold another group's pages); the full group's table, and every
    slot written, are unchanged."""
    from vllm_metal.backends.mlx.runner.batch import pack_batch

    tables = [np.arange(1, 25, dtype=np.int32).reshape(2, 12)] * 2  # 12 blocks of 4 per request
    windows = [None, 8]
    # Request a decodes at position 21 (its window: keys 14..21), b prefills 6..9 (keys 0..9).
    packed = pack_batch(
        ["a", "b"],
        {"a": 1, "b": 4},
        np.array([21, 6]),
        np.array([22, 10]),
        np.zeros((2, 48), dtype=np.int32),
        tables,
        [4, 4],
        windows=windows,
    )
    full, windowed = packed.block_tables
    assert_array_equal(full, tables[0][:, :6])
    assert_array_equal(windowed[0], [0, 0, 0, 4, 5, 6])  # blocks 0-2 (keys 0..11) passed
    assert_array_equal(windowed[1], tables[1][1, :6])
    assert_array_equal(packed.slot_mappings[1], packed.slot_mappings[0])
    assert_array_equal(
        packed.slot_mappings[1], [6 * 4 + 1, 14 * 4 + 2, 14 * 4 + 3, 15 * 4, 15 * 4 + 1]
    )
