"""When a request that does not draft may leave its head pass for later (`spec_decode/head.py`):
not once a KV block of it would be complete (prefix caching may hand a complete block to another
request, whose drafts read the head's K/V in it), nor past `MAX_DEFERRED` positions. The drafts
after a pause are checked in the engine (`test_eagle3.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from vllm_metal.backends.mlx.runner.spec_decode.head import MAX_DEFERRED, HeadDrafter, _Deferred


def drafter(deferred: dict[str, _Deferred]) -> HeadDrafter:
    d = HeadDrafter(num_kv_heads=1, head_dim=8, kv_dtype=mx.float32)
    d._deferred.update(deferred)
    return d


STATES = SimpleNamespace(block_sizes=[16])


@pytest.mark.parametrize(
    ("deferred", "start", "count", "waits"),
    [
        (None, 20, 1, True),  # position 20 of block [16, 32)
        (None, 31, 1, False),  # 31 completes block [16, 32)
        (None, 0, 15, True),  # a prefill chunk of 15: block [0, 16) not complete
        (None, 0, 16, False),
        ((17, 10), 27, 1, True),  # deferred 17..26, then 27
        ((17, 14), 31, 1, False),  # deferred 17..30, then 31: complete
        ((5, 10), 27, 1, True),  # not contiguous: 27 alone waits
    ],
)
def test_waits_until_a_block_completes(deferred, start, count, waits):
    d = drafter({} if deferred is None else {"r": _Deferred(deferred[0], count=deferred[1])})
    assert d._may_wait("r", start, count, STATES) is waits


def test_waits_for_at_most_max_deferred_positions():
    states = SimpleNamespace(block_sizes=[1 << 20])  # no block completes
    full = drafter({"r": _Deferred(100, count=MAX_DEFERRED - 1)})
    assert full._may_wait("r", 100 + MAX_DEFERRED - 1, 1, states) is True
    assert full._may_wait("r", 100 + MAX_DEFERRED - 1, 2, states) is False
    assert drafter({})._may_wait("r", 0, MAX_DEFERRED + 1, states) is False


def test_every_group_block_size_counts():
    # A hybrid's attention and state groups have their own block sizes.
    states = SimpleNamespace(block_sizes=[64, 16])
    assert drafter({})._may_wait("r", 15, 1, states) is False
    assert drafter({})._may_wait("r", 14, 1, states) is True
