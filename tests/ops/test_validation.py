"""Every bad argument to the public ops raises ValueError naming that argument (before any work),
on the native and on the reference path alike, and the optional value checks catch out-of-range
indices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal import ops

T, HQ, HKV, D, NB, BS, S, MAXB = 5, 8, 2, 64, 6, 16, 2, 3


def attention_args() -> dict[str, Any]:
    return {
        "query": mx.zeros((T, HQ, D)),
        "key_cache": mx.zeros((NB, BS, HKV, D)),
        "value_cache": mx.zeros((NB, BS, HKV, D)),
        "block_tables": mx.zeros((S, MAXB), dtype=mx.int32),
        "seq_lens": mx.array([3, 20], dtype=mx.int32),
        "cu_seqlens_q": mx.array([0, 1, 5], dtype=mx.int32),
        "scale": 0.125,
    }


def cache_args() -> dict[str, Any]:
    return {
        "key": mx.zeros((T, HKV, D)),
        "value": mx.zeros((T, HKV, D)),
        "key_cache": mx.zeros((NB, BS, HKV, D)),
        "value_cache": mx.zeros((NB, BS, HKV, D)),
        "slot_mapping": mx.arange(T).astype(mx.int64),
    }


@pytest.fixture(params=["native", "reference"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    # The checks run before either implementation is chosen: both paths see the same errors.
    if request.param == "native" and not ops.native_available():
        pytest.skip("native extension unavailable")
    monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1" if request.param == "reference" else "0")
    assert ops.backend() == request.param
    return request.param


def call_attention(**args: Any) -> mx.array:
    positional = [
        args.pop(n)
        for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "cu_seqlens_q")
    ]
    return ops.paged_attention(*positional, **args)


def call_cache(**args: Any) -> tuple[mx.array, mx.array]:
    return ops.reshape_and_cache(**args)


ATTENTION_ERRORS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("query-ndim", lambda a: a.update(query=mx.zeros((T, HQ * D))), "query"),
    ("query-type", lambda a: a.update(query=np.zeros((T, HQ, D))), "query"),
    ("query-dtype", lambda a: a.update(query=mx.zeros((T, HQ, D), dtype=mx.int32)), "query"),
    (
        "head-size",
        lambda a: a.update(
            query=mx.zeros((T, HQ, 0)),
            key_cache=mx.zeros((NB, BS, HKV, 0)),
            value_cache=mx.zeros((NB, BS, HKV, 0)),
        ),
        "head_size",
    ),
    ("kc-ndim", lambda a: a.update(key_cache=mx.zeros((NB * BS, HKV, D))), "key_cache"),
    (
        "kc-block",
        lambda a: a.update(
            key_cache=mx.zeros((NB, 12, HKV, D)), value_cache=mx.zeros((NB, 12, HKV, D))
        ),
        "block_size",
    ),
    (
        "kc-dtype",
        lambda a: a.update(
            key_cache=mx.zeros((NB, BS, HKV, D), dtype=mx.float16),
            value_cache=mx.zeros((NB, BS, HKV, D), dtype=mx.float16),
        ),
        "key_cache",
    ),
    (
        "kc-head-size",
        lambda a: a.update(
            key_cache=mx.zeros((NB, BS, HKV, 128)), value_cache=mx.zeros((NB, BS, HKV, 128))
        ),
        "key_cache",
    ),
    ("vc-shape", lambda a: a.update(value_cache=mx.zeros((NB + 1, BS, HKV, D))), "value_cache"),
    (
        "vc-dtype",
        lambda a: a.update(value_cache=mx.zeros((NB, BS, HKV, D), dtype=mx.bfloat16)),
        "value_cache",
    ),
    (
        "gqa",
        lambda a: a.update(
            key_cache=mx.zeros((NB, BS, 3, D)), value_cache=mx.zeros((NB, BS, 3, D))
        ),
        "num_kv_heads",
    ),
    (
        "bt-ndim",
        lambda a: a.update(block_tables=mx.zeros((S * MAXB,), dtype=mx.int32)),
        "block_tables",
    ),
    (
        "bt-dtype",
        lambda a: a.update(block_tables=mx.zeros((S, MAXB), dtype=mx.int64)),
        "block_tables",
    ),
    ("sl-dtype", lambda a: a.update(seq_lens=mx.array([3, 20], dtype=mx.int64)), "seq_lens"),
    ("sl-len", lambda a: a.update(seq_lens=mx.array([3], dtype=mx.int32)), "seq_lens"),
    ("cu-len", lambda a: a.update(cu_seqlens_q=mx.array([0, 5], dtype=mx.int32)), "cu_seqlens_q"),
    (
        "cu-dtype",
        lambda a: a.update(cu_seqlens_q=mx.array([0, 1, 5], dtype=mx.uint32)),
        "cu_seqlens_q",
    ),
    ("scale-nan", lambda a: a.update(scale=float("nan")), "scale"),
    ("scale-type", lambda a: a.update(scale="0.1"), "scale"),
    ("window-zero", lambda a: a.update(sliding_window=0), "sliding_window"),
    ("window-float", lambda a: a.update(sliding_window=4.5), "sliding_window"),
    ("softcap-neg", lambda a: a.update(softcap=-1.0), "softcap"),
    ("softcap-zero", lambda a: a.update(softcap=0.0), "softcap"),
    ("sinks-shape", lambda a: a.update(sinks=mx.zeros((HKV,))), "sinks"),
    ("sinks-dtype", lambda a: a.update(sinks=mx.zeros((HQ,), dtype=mx.int32)), "sinks"),
    ("sinks-type", lambda a: a.update(sinks=[0.0] * HQ), "sinks"),
]

CACHE_ERRORS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("key-ndim", lambda a: a.update(key=mx.zeros((T, HKV * D))), "key"),
    ("key-type", lambda a: a.update(key=np.zeros((T, HKV, D))), "key"),
    ("value-shape", lambda a: a.update(value=mx.zeros((T + 1, HKV, D))), "value"),
    ("key-dtype", lambda a: a.update(key=mx.zeros((T, HKV, D), dtype=mx.float16)), "key"),
    ("value-dtype", lambda a: a.update(value=mx.zeros((T, HKV, D), dtype=mx.bfloat16)), "value"),
    ("kc-ndim", lambda a: a.update(key_cache=mx.zeros((NB, BS, HKV * D))), "key_cache"),
    (
        "kc-rows",
        lambda a: a.update(
            key_cache=mx.zeros((NB, BS, HKV + 1, D)), value_cache=mx.zeros((NB, BS, HKV + 1, D))
        ),
        "key_cache",
    ),
    (
        "kc-block",
        lambda a: a.update(
            key_cache=mx.zeros((NB, 4, HKV, D)), value_cache=mx.zeros((NB, 4, HKV, D))
        ),
        "block_size",
    ),
    ("vc-shape", lambda a: a.update(value_cache=mx.zeros((NB, BS * 2, HKV, D))), "value_cache"),
    (
        "kc-int",
        lambda a: a.update(
            key_cache=mx.zeros((NB, BS, HKV, D), dtype=mx.int8),
            value_cache=mx.zeros((NB, BS, HKV, D), dtype=mx.int8),
        ),
        "key_cache",
    ),
    ("slots-dtype", lambda a: a.update(slot_mapping=mx.arange(T).astype(mx.int32)), "slot_mapping"),
    (
        "slots-len",
        lambda a: a.update(slot_mapping=mx.arange(T - 1).astype(mx.int64)),
        "slot_mapping",
    ),
    (
        "slots-ndim",
        lambda a: a.update(slot_mapping=mx.zeros((T, 1), dtype=mx.int64)),
        "slot_mapping",
    ),
]


@pytest.mark.parametrize(
    ("case", "mutate", "name"), ATTENTION_ERRORS, ids=[c[0] for c in ATTENTION_ERRORS]
)
def test_paged_attention_errors_name_the_argument(
    backend: str, case: str, mutate: Callable[[dict[str, Any]], None], name: str
) -> None:
    args = attention_args()
    mutate(args)
    with pytest.raises(ValueError, match=name):
        call_attention(**args)


@pytest.mark.parametrize(("case", "mutate", "name"), CACHE_ERRORS, ids=[c[0] for c in CACHE_ERRORS])
def test_reshape_and_cache_errors_name_the_argument(
    backend: str, case: str, mutate: Callable[[dict[str, Any]], None], name: str
) -> None:
    args = cache_args()
    mutate(args)
    with pytest.raises(ValueError, match=name):
        call_cache(**args)


def test_valid_arguments_pass(backend: str) -> None:
    # The unmodified arguments of the tables above are accepted (so each error is the mutation's).
    mx.eval(call_attention(**attention_args()))
    mx.eval(*call_cache(**cache_args()))


@pytest.fixture
def value_checks() -> Iterator[None]:
    ops.set_value_checks(True)
    yield
    ops.set_value_checks(False)


VALUE_ERRORS = [
    ("cu-start", {"cu_seqlens_q": [1, 1, 5]}, "cu_seqlens_q\\[0\\]"),
    ("cu-order", {"cu_seqlens_q": [0, 4, 3]}, "non-decreasing"),
    ("cu-end", {"cu_seqlens_q": [0, 1, 9]}, "cu_seqlens_q\\[-1\\]"),
    ("short-seq", {"seq_lens": [3, 2]}, "seq_lens\\[1\\]"),
    ("long-seq", {"seq_lens": [3, 49]}, "block_tables capacity"),
    ("bad-block", {"block_tables": [[0, 0, 0], [1, 7, 0]]}, "block_tables\\[1, 1\\]"),
]


@pytest.mark.parametrize(
    ("case", "change", "message"), VALUE_ERRORS, ids=[c[0] for c in VALUE_ERRORS]
)
def test_value_checks(value_checks: None, case: str, change: dict[str, Any], message: str) -> None:
    args = attention_args()
    for key, value in change.items():
        args[key] = mx.array(np.asarray(value, np.int32))
    with pytest.raises(ValueError, match=message):
        call_attention(**args)


def test_value_checks_slot_range(value_checks: None) -> None:
    args = cache_args()
    args["slot_mapping"] = mx.array(np.array([0, -1, NB * BS, 3, 4], np.int64))
    with pytest.raises(ValueError, match="slot_mapping\\[2\\]"):
        call_cache(**args)


def test_value_checks_off_by_default() -> None:
    args = attention_args()
    args["cu_seqlens_q"] = mx.array(np.array([0, 4, 3], np.int32))
    mx.eval(call_attention(**args))  # invalid, but neither checked nor unsafe
