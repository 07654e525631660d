"""The planted bugs of the quantized KV caches' kernels (per-tensor fp8, the per-token-head int8
and fp8 formats, TurboQuant) that the msl tests must catch (`mutate.py` runs them)."""

from __future__ import annotations

from tests.msl.mutations import Mutation

# TurboQuant (test_turboquant_kernels.py: the decode tests end in "_tq", the write test is
# test_write_stores_codec_bytes).
TURBOQUANT_MUTATIONS = [
    Mutation(
        "tq-3bit-unpack-off-by-one-bit",
        "../csrc/common/turboquant.h",
        r"  const int bit = i \* bits;\n",
        "  const int bit = i * bits + (bits == 3 ? 1 : 0);\n",
        "tq",
    ),
    Mutation(
        "tq-decode-norm-not-applied",
        "turboquant/decode.metal",
        r"factor = vm_tq_f16\(uint\(krow\[nb\]\), uint\(krow\[nb \+ 1\]\)\);",
        "factor = 1.0f;",
        "tq",
    ),
    Mutation(
        "tq-value-min-dropped",
        "../csrc/common/turboquant.h",
        r"return float\(index\) \* scale \+ vmin;",
        "return float(index) * scale;",
        "tq",
    ),
    Mutation(
        "tq-decode-wrong-centroid-table",
        "turboquant/decode.metal",
        r"k\[i\] = centroids\[vm_tq_index\(krow, d0 \+ i, p\.key_bits\)\];",
        "k[i] = centroids[((1 << p.key_bits) - 1) - vm_tq_index(krow, d0 + i, p.key_bits)];",
        "tq",
    ),
    Mutation(
        "tq-decode-keys-of-kv-head-0",
        "turboquant/decode.metal",
        r"slot \* p\.kc_stride_slot \+ long\(kvh\) \* p\.kc_stride_head;",
        "slot * p.kc_stride_slot;",
        "gqa_decode_tq",
    ),
    Mutation(
        "tq-reduce-drops-partition-weight",
        "turboquant/decode.metal",
        r"total \+= w \* ml\.y;",
        "total += ml.y;",
        "split_kv",
    ),
    Mutation(
        "tq-write-pack-shift-off-by-one",
        "../csrc/common/turboquant.h",
        r"const int shift = i \* bits - 8 \* b;",
        "const int shift = i * bits - 8 * b + 1;",
        "codec_bytes",
    ),
    Mutation(
        "tq-write-value-scale-not-floored",
        "../csrc/common/turboquant.h",
        r"return s > VM_TQ_MIN_VALUE_SCALE \? s : VM_TQ_MIN_VALUE_SCALE;",
        "return s;",
        "codec_bytes",
    ),
]

QUANT_MUTATIONS = [
    Mutation(
        "fp8-decode-keys-read-with-value-scale",
        "attention/decode.metal",
        r"PaKv<T, KV>::row_scale\(k_row, p\.k_scale, p\)",
        "PaKv<T, KV>::row_scale(k_row, p.v_scale, p)",
        "fp8 and decode and not gqa",
    ),
    Mutation(
        "fp8-gqa-values-staged-with-key-scale",
        "attention/gqa.metal",
        r"value_cache \+ head_off, 0, p\.v_scale,",
        "value_cache + head_off, 0, p.k_scale,",
        "fp8 and gqa",
    ),
    Mutation(
        "fp8-prefill-key-scale-dropped",
        "attention/prefill.metal",
        r"key_cache \+ head_off, 0, p\.k_scale,",
        "key_cache + head_off, 0, 1.0f,",
        "fp8 and prefill and not nax",
    ),
    Mutation(
        "fp8-nax-values-staged-with-key-scale",
        "attention/nax.metal",
        r"w\.v_col0, p\.v_scale, base,",
        "w.v_col0, p.k_scale, base,",
        "fp8 and nax",
    ),
    Mutation(
        "fp8-cache-values-stored-with-key-scale",
        "cache/reshape_and_cache.metal",
        r"value\[long\(token\) \* p\.value_stride_token \+ long\(h\) \* p\.value_stride_head \+ d\], p\.v_scale,",
        "value[long(token) * p.value_stride_token + long(h) * p.value_stride_head + d], p.k_scale,",
        "fp8 and reshape",
    ),
    Mutation(
        "fp8-e4m3-e5m2-swapped",
        "../csrc/common/fp8.h",
        r"if \(kv_format == ID \|\| f\.mantissa_bits == 0\)",
        "if (kv_format != ID || f.mantissa_bits == 0)",
        "fp8 and decode and not gqa",
    ),
    Mutation(
        "fp8-read-exponent-bias-off-by-one",
        "../csrc/common/fp8.h",
        r"\(\(e \+ vm_u32\(127 - f\.bias\)\) << 23\)",
        "((e + vm_u32(128 - f.bias)) << 23)",
        "fp8 and decode and not gqa",
    ),
    Mutation(
        "fp8-write-exponent-bias-off-by-one",
        "../csrc/common/fp8.h",
        r"\(vm_u32\(e_out \+ f\.bias\) << m_bits\)",
        "(vm_u32(e_out + f.bias + 1) << m_bits)",
        "fp8 and reshape",
    ),
    Mutation(
        "fp8-write-missing-saturation",
        "../csrc/common/fp8.h",
        r"  if \(mag > max_bits\) mag = max_bits;  // saturate \(infinities too\)",
        "",
        "fp8 and reshape",
    ),
    Mutation(
        "fp8-write-ties-away-from-even",
        "../csrc/common/fp8.h",
        r"rem == half && \(steps & 1u\) != 0",
        "rem == half",
        "fp8 and reshape",
    ),
    Mutation(
        "pth-scale-of-the-next-row",
        "attention/common.h",
        r"const device uchar\* s = row \+ p\.head_dim;",
        "const device uchar* s = row + p.head_dim + p.kv_stride_head;",
        "pth and decode and not split",
    ),
    Mutation(
        "pth-scale-read-from-the-data-bytes",
        "attention/common.h",
        r"const device uchar\* s = row \+ p\.head_dim;",
        "const device uchar* s = row;",
        "pth and prefill and not nax",
    ),
    Mutation(
        "pth-staged-scale-ignores-the-column-offset",
        "attention/common.h",
        r"row_scale\(row - col0, scale, p\)",
        "row_scale(row, scale, p)",
        "pth and prefill and not nax",
    ),
    Mutation(
        "pth-int8-read-unsigned",
        "../csrc/common/per_token_head.h",
        r"return code >= 128u \? float\(int\(code\) - 256\) : float\(code\);",
        "return float(code);",
        "pth and decode and int8",
    ),
    Mutation(
        "pth-fp8-elements-as-e5m2",
        "../csrc/common/per_token_head.h",
        r"#define VM_PTH_FP8_ELEMENT 1 ",
        "#define VM_PTH_FP8_ELEMENT 2 ",
        "pth and reshape",
    ),
    Mutation(
        "pth-decode-value-scale-skipped",
        "attention/decode.metal",
        r"const float v_scale = PaKv<T, KV>::row_scale\(v_row, p\.v_scale, p\);",
        "const float v_scale = p.v_scale;",
        "pth and decode and not gqa",
    ),
    Mutation(
        "pth-write-int8-scale-over-128",
        "../csrc/common/per_token_head.h",
        r"\? 127\.0f\n",
        "? 128.0f\n",
        "pth and reshape",
    ),
    Mutation(
        "pth-write-int8-rounds-toward-zero",
        "../csrc/common/per_token_head.h",
        r"float r = q >= 0\.0f \? q \+ 0\.5f : q - 0\.5f;",
        "float r = q;",
        "pth and reshape",
    ),
    *TURBOQUANT_MUTATIONS,
]
