"""The TurboQuant cache write and attention (`ops.turboquant`) against a float64 port of vLLM's
store -> decode rules (tests/fixtures/turboquant_reference.py): the bytes written, what they read
back as, and attention over them with vLLM's prefill rule, windows, soft-capping and sinks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.fixtures import turboquant_reference as ref
from vllm_metal.kv.turboquant import format_for
from vllm_metal.ops import turboquant

PRESETS = list(ref.PRESETS)
# Relative distance to a rounding decision within which float32 may pick the neighbour level.
NEAR = 1e-5


def _rows(rng, shape, spread=3.0) -> np.ndarray:
    # Rows of different magnitudes, one constant row (value scale clamped at 1e-8), one zero key.
    x = rng.normal(size=shape) * spread * rng.uniform(0.1, 4.0, size=(*shape[:-1], 1))
    x[0, 0] = 0.25
    return x.astype(np.float32)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_formats_are_vllms(name: str, head_dim: int) -> None:
    """The plugin's format (vLLM's preset and centroid table) matches the port's layout and its
    independently solved Lloyd-Max table."""
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    fmt, layout = format_for(name, head_dim), ref.Layout(name, head_dim)
    assert (fmt.key_bytes, fmt.slot_bytes) == (layout.key_bytes, layout.slot_bytes)
    assert fmt.slot_bytes == TurboQuantConfig.from_cache_dtype(name, head_dim).slot_size_aligned
    assert fmt.key_bytes + fmt.value_bytes == layout.slot_bytes
    if not layout.fp8_keys:
        np.testing.assert_array_equal(
            np.asarray(fmt.centroids), ref.centroids(head_dim, layout.key_bits)
        )


def _write(name, head_dim, keys, values, slots, num_blocks=6, block_size=16):
    fmt = format_for(name, head_dim)
    heads = keys.shape[1]
    kc = mx.full((num_blocks, block_size, heads, fmt.key_bytes), 0xA5, dtype=mx.uint8)
    vc = mx.full((num_blocks, block_size, heads, fmt.value_bytes), 0x5A, dtype=mx.uint8)
    kc, vc = turboquant.reshape_and_cache(
        mx.array(keys), mx.array(values), kc, vc, mx.array(slots, dtype=mx.int64), fmt=fmt
    )
    return fmt, np.array(kc), np.array(vc)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_cache_write_stores_vllms_slot_bytes(name: str, dtype) -> None:
    rng = np.random.default_rng(7)
    head_dim, heads, n = 64, 2, 40
    keys, values = _rows(rng, (n, heads, head_dim)), _rows(rng, (n, heads, head_dim), 1.0)
    keys[1, 1] = 0.0
    keys[2, 0] = rng.normal(size=head_dim) * 1e-4  # a tiny key: the norm's epsilon shows
    values[0, 1] = 0.75  # a constant row
    # Rows as the model hands them (bf16 rows are rounded before they are quantized).
    keys = np.array(mx.array(keys).astype(dtype).astype(mx.float32))
    values = np.array(mx.array(values).astype(dtype).astype(mx.float32))
    slots = rng.permutation(6 * 16)[:n].astype(np.int64)
    slots[[3, 17]] = -1  # padding rows
    fmt, kc, vc = _write(name, head_dim, keys.astype(np.float32), values, slots)
    layout = ref.Layout(name, head_dim)
    written = slots >= 0
    ours = np.concatenate([kc, vc], axis=-1).reshape(-1, heads, layout.slot_bytes)[slots[written]]
    want = ref.store(layout, keys[written], values[written])
    key_near, value_near = ref.near_boundary(layout, keys[written], values[written], NEAR)
    exact = ~(key_near.any(-1) | value_near.any(-1))
    assert exact.mean() > 0.8
    got_k, got_v = ref.decode(layout, ours)
    want_k, want_v = ref.decode(layout, want)
    kb = layout.key_bytes
    if layout.fp8_keys:  # a tiny negative key stores -0 (0x80), the brute-force port +0
        np.testing.assert_array_equal(got_k, want_k)
        np.testing.assert_array_equal(ours[exact][..., kb:], want[exact][..., kb:])
    else:
        np.testing.assert_array_equal(ours[exact], want[exact])
        idx = ref._unpack(ours[..., : kb - 2], layout.key_bits, head_dim)
        want_idx = ref._unpack(want[..., : kb - 2], layout.key_bits, head_dim)
        assert (np.abs(idx - want_idx) <= key_near).all()
        np.testing.assert_array_equal(ours[..., kb - 2 : kb], want[..., kb - 2 : kb])
    levels = 2**layout.value_bits - 1
    step = np.maximum((values[written].max(-1) - values[written].min(-1)) / levels, 1e-8) * 1.01
    assert (np.abs(got_v - want_v) <= np.where(value_near, step[..., None], 1e-12)).all()
    # Padding rows and untouched slots keep their bytes; the pad byte of a slot is zero.
    untouched = np.setdiff1d(np.arange(6 * 16), slots[written])
    assert (kc.reshape(-1, heads, fmt.key_bytes)[untouched] == 0xA5).all()
    assert (vc.reshape(-1, heads, fmt.value_bytes)[untouched] == 0x5A).all()
    if layout.slot_bytes > kb + layout.value_data_bytes + 4:
        assert (ours[..., -1] == 0).all()


def test_quantize_then_dequantize_is_close_to_the_rows() -> None:
    """The codec's own round trip (keys rotated back) is the port's decode of its bytes, and close
    to the input: a wrong rotation or table is off by the whole row."""
    from vllm_metal.ops.turboquant import codec

    rng = np.random.default_rng(3)
    x = _rows(rng, (64, 1, 128), 1.0)
    for name in PRESETS:
        fmt = format_for(name, 128)
        k = codec.dequantize_keys(codec.quantize_keys(mx.array(x), fmt), fmt)
        if not fmt.fp8_keys:
            k = k @ codec.hadamard(128)
        v = codec.dequantize_values(codec.quantize_values(mx.array(x), fmt), fmt)
        slot = np.concatenate(
            [
                np.array(codec.quantize_keys(mx.array(x), fmt)),
                np.array(codec.quantize_values(mx.array(x), fmt)),
            ],
            axis=-1,
        )
        want_k, want_v = ref.decode(ref.Layout(name, 128), slot)
        np.testing.assert_allclose(np.array(k), want_k, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.array(v), want_v, rtol=1e-6, atol=1e-6)
        rel = np.linalg.norm(want_k - x) / np.linalg.norm(x)
        assert rel < 0.25, (name, rel)


def _attention64(q, k, v, q_pos, k_len, scale, window, softcap, sinks):
    """float64 attention of one sequence's rows over keys 0..k_len-1 (causal, window)."""
    hq, hkv = q.shape[1], k.shape[1]
    out = np.zeros(q.shape)
    for i, p in enumerate(q_pos):
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(hq):
            kh = h // (hq // hkv)
            logits = scale * (k[lo : p + 1, kh] @ q[i, h])
            if softcap is not None:
                logits = softcap * np.tanh(logits / softcap)
            top = logits.max() if sinks is None else max(logits.max(), sinks[h])
            w = np.exp(logits - top)
            den = w.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            out[i, h] = (w / den) @ v[lo : p + 1, kh]
    return out


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize(
    "window, softcap, with_sinks", [(None, None, False), (24, 30.0, True)]
)  # fmt: skip
def test_attention_reads_what_the_port_decodes(name, window, softcap, with_sinks) -> None:
    """One step of four sequences: a first chunk (unquantized step rows, as vLLM's prefill), a
    decode row, a short continuation (every key from the cache) and a continuation longer than
    CONTINUATION_DECODE_MAX (its own rows unquantized, earlier ones from the cache)."""
    rng = np.random.default_rng(11)
    head_dim, hq, hkv, bs = 64, 4, 2, 16
    long_q = turboquant.CONTINUATION_DECODE_MAX + 2
    # (computed tokens before the step, query rows)
    seqs = [(0, 20), (37, 1), (30, 3), (9, long_q)]
    fresh = [True, False, False, True]
    blocks_of = [-(-(c + q) // bs) for c, q in seqs]
    max_blocks = max(blocks_of)
    num_blocks = sum(blocks_of) + 2
    layout = ref.Layout(name, head_dim)
    fmt = format_for(name, head_dim)
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seqs), max_blocks), np.int32)
    k_all, v_all, q_rows, slots_all, slots_step, k_step, v_step = [], [], [], [], [], [], []
    start = 0
    for s, (computed, q_len) in enumerate(seqs):
        tables[s, : blocks_of[s]] = perm[start : start + blocks_of[s]]
        start += blocks_of[s]
        n = computed + q_len
        k, v = _rows(rng, (n, hkv, head_dim)), _rows(rng, (n, hkv, head_dim), 1.0)
        pos = np.arange(n)
        slots = tables[s, pos // bs].astype(np.int64) * bs + pos % bs
        k_all.append(k), v_all.append(v), slots_all.append(slots)
        (
            k_step.append(k[computed:]),
            v_step.append(v[computed:]),
            slots_step.append(slots[computed:]),
        )
        q_rows.append(_rows(rng, (q_len, hq, head_dim), 0.3))
    kc = mx.zeros((num_blocks, bs, hkv, fmt.key_bytes), dtype=mx.uint8)
    vc = mx.zeros((num_blocks, bs, hkv, fmt.value_bytes), dtype=mx.uint8)
    # Earlier steps' rows, then this step's, written as the runner writes them.
    for part in (0, 1):
        ks = [k[:c] if part == 0 else k[c:] for k, (c, _) in zip(k_all, seqs)]
        vs = [v[:c] if part == 0 else v[c:] for v, (c, _) in zip(v_all, seqs)]
        sl = [x[:c] if part == 0 else x[c:] for x, (c, _) in zip(slots_all, seqs)]
        kc, vc = turboquant.reshape_and_cache(
            mx.array(np.concatenate(ks)),
            mx.array(np.concatenate(vs)),
            kc,
            vc,
            mx.array(np.concatenate(sl)),
            fmt=fmt,
        )
    q = np.concatenate(q_rows)
    cu = np.concatenate([[0], np.cumsum([ql for _, ql in seqs])]).astype(np.int32)
    seq_lens = np.array([c + ql for c, ql in seqs], np.int32)
    sinks = rng.normal(size=hq).astype(np.float32) if with_sinks else None
    scale = head_dim**-0.5
    out = turboquant.paged_attention(
        mx.array(q),
        kc,
        vc,
        mx.array(tables),
        mx.array(seq_lens),
        mx.array(cu),
        fmt=fmt,
        scale=scale,
        sliding_window=window,
        softcap=softcap,
        sinks=None if sinks is None else mx.array(sinks),
        key=mx.array(np.concatenate(k_step)),
        value=mx.array(np.concatenate(v_step)),
    )
    slot_bytes = np.concatenate([np.array(kc), np.array(vc)], axis=-1).reshape(
        -1, hkv, layout.slot_bytes
    )
    for s, (computed, q_len) in enumerate(seqs):
        k, v = ref.decode(layout, slot_bytes[slots_all[s]])
        if fresh[s]:
            k[computed:], v[computed:] = k_all[s][computed:], v_all[s][computed:]
        want = _attention64(
            q_rows[s].astype(np.float64),
            k,
            v,
            np.arange(computed, computed + q_len),
            computed + q_len,
            scale,
            window,
            softcap,
            sinks,
        )
        got = np.array(out[cu[s] : cu[s + 1]])
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4, err_msg=f"sequence {s}")


def test_decode_steps_read_every_key_from_the_cache() -> None:
    """max_query_len=1 (a traced decode step) ignores the step's rows: the output equals the
    op without them."""
    rng = np.random.default_rng(5)
    fmt = format_for("turboquant_4bit_nc", 64)
    kc = mx.zeros((3, 16, 1, fmt.key_bytes), dtype=mx.uint8)
    vc = mx.zeros((3, 16, 1, fmt.value_bytes), dtype=mx.uint8)
    k, v = _rows(rng, (20, 1, 64)), _rows(rng, (20, 1, 64))
    slots = np.concatenate([np.arange(16, 32), np.arange(32, 36)]).astype(np.int64)
    kc, vc = turboquant.reshape_and_cache(
        mx.array(k), mx.array(v), kc, vc, mx.array(slots), fmt=fmt
    )
    args = (
        mx.array(_rows(rng, (1, 2, 64))),
        kc,
        vc,
        mx.array([[1, 2]], dtype=mx.int32),
        mx.array([20], dtype=mx.int32),
        mx.array([0, 1], dtype=mx.int32),
    )
    plain = turboquant.paged_attention(*args, fmt=fmt, scale=0.125, max_query_len=1)
    given = turboquant.paged_attention(
        *args, fmt=fmt, scale=0.125, key=mx.array(k[-1:]), value=mx.array(v[-1:]), max_query_len=1
    )
    np.testing.assert_array_equal(np.array(plain), np.array(given))


def test_bad_pools_are_refused_by_name() -> None:
    from vllm_metal import ops

    fmt = format_for("turboquant_k8v4", 64)
    rows = mx.zeros((2, 1, 64))
    kc = mx.zeros((2, 16, 1, fmt.key_bytes), dtype=mx.uint8)
    vc = mx.zeros((2, 16, 1, fmt.value_bytes), dtype=mx.uint8)
    slots = mx.array([0, 1], dtype=mx.int64)
    with pytest.raises(ValueError, match="value_cache of turboquant_k8v4"):
        turboquant.reshape_and_cache(rows, rows, kc, kc, slots, fmt=fmt)
    with pytest.raises(ValueError, match="key_cache of turboquant_k8v4 must be uint8"):
        turboquant.reshape_and_cache(rows, rows, kc.astype(mx.float32), vc, slots, fmt=fmt)
    # The float ops (native or reference) never read TurboQuant bytes as floats.
    with pytest.raises(ValueError):
        ops.paged_attention(
            rows,
            kc,
            vc,
            mx.array([[0]], dtype=mx.int32),
            mx.array([2], dtype=mx.int32),
            mx.array([0, 2], dtype=mx.int32),
            scale=0.125,
        )
    with pytest.raises(ValueError, match="not a power of two"):
        format_for("turboquant_4bit_nc", 96)
    assert format_for("turboquant_k8v4", 96).key_bytes == 96
