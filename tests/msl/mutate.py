"""Mutation self-check of the msl tests: plants one bug at a time in a copy of metal_kernels/ (and
of csrc/, for the headers the kernels share with the host) and shows the kernel tests fail on each.
Run: python -m tests.msl.mutate [--only NAME] [--list]."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
KERNELS = REPO / "metal_kernels"
SHARED = REPO / "csrc"
TEST_FILES = ("test_kernels.py", "test_fp8_kernels.py", "test_pth_kernels.py")


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to metal_kernels/; a header shared with the host: "../csrc/..."
    pattern: str  # regex that must match exactly once (the original line(s))
    replacement: str
    tests: str  # pytest -k expression selecting the tests that should catch it


MUTATIONS = [
    Mutation(
        "prefill-causal-off-by-one",
        "attention/prefill.metal",
        r"const int row_hi = row_valid \? row_pos \+ 1 : row_lo;",
        "const int row_hi = row_valid ? row_pos : row_lo;",
        "prefill and not nax",
    ),
    Mutation(
        "nax-causal-off-by-one",
        "attention/nax.metal",
        r"const int row_hi = row_valid \? row_pos \+ 1 : row_lo;",
        "const int row_hi = row_valid ? row_pos + 2 : row_lo;",
        "nax",
    ),
    Mutation(
        "decode-wrong-kv-head",
        "attention/decode.metal",
        r"  const int kvh = h / group;",
        "  const int kvh = h % p.num_kv_heads;",
        "decode and not gqa",
    ),
    Mutation(
        "gqa-missing-barrier-after-k-tile",
        "attention/gqa.metal",
        r"    threadgroup_barrier\(mem_flags::mem_threadgroup\);\n\n    // 2\. S = Q K\^T",
        "\n\n    // 2. S = Q K^T",
        "gqa",
    ),
    Mutation(
        "prefill-missing-barrier-end-of-tile",
        "attention/prefill.metal",
        r"    threadgroup_barrier\(mem_flags::mem_threadgroup\);  // tiles are rewritten next",
        "    // (barrier removed)",
        "prefill and not nax",
    ),
    Mutation(
        "decode-dropped-output-rescale",
        "attention/decode.metal",
        r"        o\[rd\]\[e\] \*= factor;",
        "        o[rd][e] *= 1.0f;",
        "decode and not gqa",
    ),
    Mutation(
        "decode-dropped-sum-rescale",
        "attention/decode.metal",
        r"    l \*= factor;",
        "    l *= 1.0f;",
        "decode and not gqa",
    ),
    Mutation(
        "gqa-wrong-partition-index",
        "attention/gqa.metal",
        r"const int first_row = \(part_offsets\[r\] \+ part\) \* p\.scratch_heads \+",
        "const int first_row = (r + part) * p.scratch_heads +",
        "gqa and split",
    ),
    Mutation(
        "softmax-row-max-misses-lanes",
        "attention/common.h",
        r"  for \(ushort m = 1; m < LANES; m \*= 2\) \{\n    mx = ",
        "  for (ushort m = 1; m < LANES / 2; m *= 2) {\n    mx = ",
        "gqa",
    ),
    Mutation(
        "nax-cooperative-layout-assumed",
        "attention/nax.metal",
        r"        o_acc\[i\] \*= row_scale\[idx\[1\]\];",
        "        o_acc[i] *= row_scale[i % BQ];",
        "nax",
    ),
    Mutation(
        "window-start-off-by-one",
        "attention/common.h",
        r"q_pos - p\.sliding_window \+ 1\)",
        "q_pos - p.sliding_window)",
        "masks or kernel_blocks",
    ),
    Mutation(
        "reduce-drops-sinks",
        "attention/decode.metal",
        r"\n    l \+= metal::exp\(sinks\[h\] - shift\);",
        "\n    l += 0.0f;",
        "split",
    ),
    Mutation(
        "cache-skips-slot-zero",
        "cache/reshape_and_cache.metal",
        r"  if \(slot < 0 \|\| slot >= p\.num_slots\) \{",
        "  if (slot <= 0 || slot >= p.num_slots) {",
        "reshape_and_cache",
    ),
    Mutation(
        "gated-delta-wrong-key-head",
        "gated_delta/gated_delta_rule.metal",
        r"  const int kh = h / \(p\.num_v_heads / p\.num_k_heads\);",
        "  const int kh = h % p.num_k_heads;",
        "gated_delta",
    ),
    Mutation(
        "gated-delta-drops-last-token",
        "gated_delta/gated_delta_rule.metal",
        r"clamp\(cu_seqlens\[s \+ 1\], t0, p\.num_tokens\)",
        "clamp(cu_seqlens[s + 1] - 1, t0, p.num_tokens)",
        "gated_delta",
    ),
    Mutation(
        "gated-delta-lane-mask-off-by-one",
        "gated_delta/gated_delta_rule.metal",
        r"kt\[j\] = e < dk \?",
        "kt[j] = e <= dk ?",
        "gated_delta",
    ),
    Mutation(
        "gated-delta-output-before-update",
        "gated_delta/gated_delta_rule.metal",
        r"      st\[j\] \+= delta \* kt\[j\];\n      y \+= e < dk \? st\[j\] \* float\(q\[kq \+ e\]\) : 0\.0f;",
        "      y += e < dk ? st[j] * float(q[kq + e]) : 0.0f;\n      st[j] += delta * kt[j];",
        "gated_delta",
    ),
    Mutation(
        "mamba2-wrong-group",
        "mamba2/mamba2_scan.metal",
        r"  const int g = h / \(p\.num_heads / p\.num_groups\);",
        "  const int g = h % p.num_groups;",
        "mamba2",
    ),
    Mutation(
        "mamba2-decay-not-applied",
        "mamba2/mamba2_scan.metal",
        r"st\[j\] = decay \* st\[j\] \+ dx",
        "st[j] = st[j] + dx",
        "mamba2",
    ),
    Mutation(
        "mamba2-missing-d-skip",
        "mamba2/mamba2_scan.metal",
        r"T\(y \+ skip \* xp\)",
        "T(y)",
        "mamba2",
    ),
    Mutation(
        "mamba2-drops-last-token",
        "mamba2/mamba2_scan.metal",
        r"clamp\(cu_seqlens\[s \+ 1\], t0, p\.num_tokens\)",
        "clamp(cu_seqlens[s + 1] - 1, t0, p.num_tokens)",
        "mamba2",
    ),
    Mutation(
        "mamba2-output-before-update",
        "mamba2/mamba2_scan.metal",
        r"        st\[j\] = decay \* st\[j\] \+ dx \* float\(B\[bc \+ e\]\);  // S = exp\(dt A\) S \+ dt x B\n        y \+= st\[j\] \* float\(C\[bc \+ e\]\);",
        "        y += st[j] * float(C[bc + e]);\n        st[j] = decay * st[j] + dx * float(B[bc + e]);",
        "mamba2",
    ),
    Mutation(
        "mamba2-lane-mask-off-by-one",
        "mamba2/mamba2_scan.metal",
        r"      if \(e < n\) \{\n        st\[j\] = decay",
        "      if (e <= n) {\n        st[j] = decay",
        "mamba2",
    ),
    Mutation(
        "mla-causal-off-by-one",
        "mla/mla_attention.metal",
        r"clamp\(pos \+ 1, 0, p\.max_blocks_per_seq \* p\.block_size\)",
        "clamp(pos, 0, p.max_blocks_per_seq * p.block_size)",
        "mla_attention",
    ),
    Mutation(
        "mla-value-from-rope-columns",
        "mla/mla_attention.metal",
        r"o\[c\] \+= w \* float\(tile\[j \* D \+ int\(lane\)",
        "o[c] += w * float(tile[j * D + (D - DV) + int(lane)",
        "mla_attention",
    ),
    Mutation(
        "mla-dropped-output-rescale",
        "mla/mla_attention.metal",
        r"        o\[c\] \*= factor;",
        "        o[c] *= 1.0f;",
        "mla_attention",
    ),
    Mutation(
        "mla-max-not-subtracted",
        "mla/mla_attention.metal",
        r"metal::exp\(logit\[j\] - m_new\)",
        "metal::exp(logit[j])",
        "mla_attention",
    ),
    Mutation(
        "mla-block-of-tile-start",
        "mla/mla_attention.metal",
        r"const int block = table\[k / p\.block_size\];",
        "const int block = table[k0 / p.block_size];",
        "mla_attention",
    ),
    Mutation(
        "mla-sequence-search-skips-boundary",
        "mla/mla_attention.metal",
        r"if \(cu_seqlens_q\[mid\] <= t\)",
        "if (cu_seqlens_q[mid] < t)",
        "mla_attention",
    ),
    Mutation(
        "mla-missing-barrier-after-staging",
        "mla/mla_attention.metal",
        r"    threadgroup_barrier\(mem_flags::mem_threadgroup\);\n\n    // 3\. Logits",
        "\n\n    // 3. Logits",
        "mla_attention",
    ),
    Mutation(
        "mla-cache-skips-slot-zero",
        "mla/mla_reshape_and_cache.metal",
        r"  if \(slot < 0 \|\| slot >= p\.num_slots\) \{",
        "  if (slot <= 0 || slot >= p.num_slots) {",
        "mla_reshape_and_cache",
    ),
    Mutation(
        "mla-cache-wrong-block-stride",
        "mla/mla_reshape_and_cache.metal",
        r"\(slot / p\.block_size\) \* p\.cache_stride_block",
        "(slot / p.block_size) * p.cache_stride_slot",
        "mla_reshape_and_cache",
    ),
    Mutation(
        "conv-window-off-by-one",
        "short_conv/causal_conv1d.metal",
        r"p, s, begin, len \+ e, c\)",
        "p, s, begin, len + e - 1, c)",
        "causal_conv1d",
    ),
    Mutation(
        "conv-sequence-search-skips-boundary",
        "short_conv/causal_conv1d.metal",
        r"if \(cu_seqlens\[mid\] <= r\)",
        "if (cu_seqlens[mid] < r)",
        "causal_conv1d",
    ),
    Mutation(
        "conv-drops-bias",
        "short_conv/causal_conv1d.metal",
        r"acc = p\.has_bias \? float\(bias\[c\]\) : 0\.0f;",
        "acc = 0.0f;",
        "causal_conv1d",
    ),
    Mutation(
        "conv-missing-silu",
        "short_conv/causal_conv1d.metal",
        r"    acc = acc / \(1\.0f \+ metal::exp\(-acc\)\);  // silu",
        "",
        "causal_conv1d",
    ),
    Mutation(
        "rope-wrong-sign-of-sin",
        "rope/rotary_embedding.metal",
        r"o\[i1\] = T\(x1 \* c - x2 \* s\);",
        "o[i1] = T(x1 * c + x2 * s);",
        "rotary_embedding",
    ),
    Mutation(
        "rope-neox-halves-swapped",
        "rope/rotary_embedding.metal",
        r"const int i1 = neox \? j : 2 \* j;\n  const int i2 = neox \? half \+ j : 2 \* j \+ 1;",
        "const int i1 = neox ? half + j : 2 * j;\n  const int i2 = neox ? j : 2 * j + 1;",
        "rotary_embedding",
    ),
    Mutation(
        "rope-neox-gptj-confused",
        "rope/rotary_embedding.metal",
        r"const bool neox = p\.is_neox != 0;",
        "const bool neox = p.is_neox == 0;",
        "rotary_embedding",
    ),
    Mutation(
        "rope-position-off-by-one",
        "rope/rotary_embedding.metal",
        r"const long raw = long\(positions\[t\]\);",
        "const long raw = long(positions[t]) + 1;",
        "rotary_embedding",
    ),
    Mutation(
        "rope-position-unclamped",
        "rope/rotary_embedding.metal",
        r"const long pos = raw < 0 \? 0 : \(raw >= long\(p\.max_position\) \? "
        r"long\(p\.max_position - 1\) : raw\);",
        "const long pos = raw;",
        "rotary_embedding",
    ),
    Mutation(
        "rope-cos-sin-swapped",
        "rope/rotary_embedding.metal",
        r"const float c = float\(row\[j\]\);\n  const float s = float\(row\[half \+ j\]\);",
        "const float c = float(row[half + j]);\n  const float s = float(row[j]);",
        "rotary_embedding",
    ),
    Mutation(
        "rope-cache-row-of-head-size",
        "rope/rotary_embedding.metal",
        r"cos_sin_cache \+ pos \* p\.rotary_dim;",
        "cos_sin_cache + pos * p.head_size;",
        "rotary_embedding",
    ),
    Mutation(
        "rope-pass-through-odd-element-wrong",
        "rope/rotary_embedding.metal",
        r"o\[e \+ 1\] = x\[\(e \+ 1\) \* sd\];",
        "o[e + 1] = x[e * sd];",
        "rotary_embedding",
    ),
    Mutation(
        "rope-key-read-with-query-strides",
        "rope/rotary_embedding.metal",
        r"const long stride_head = is_query \? p\.q_stride_head : p\.k_stride_head;",
        "const long stride_head = p.q_stride_head;",
        "rotary_embedding",
    ),
    Mutation(
        "rope-key-rows-by-query-heads",
        "rope/rotary_embedding.metal",
        r"\(long\(t\) \* heads \+ head\) \* p\.head_size",
        "(long(t) * p.num_q_heads + head) * p.head_size",
        "rotary_embedding",
    ),
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
]


def apply(mutation: Mutation, kernel_dir: Path) -> None:
    """Plants ``mutation`` in the copy at ``kernel_dir``: its pattern must match exactly once (any
    object with name, file, pattern and replacement; tests/metal_host/mutate.py uses it too)."""
    path = kernel_dir / mutation.file
    text = path.read_text()
    hits = list(re.finditer(mutation.pattern, text))
    if len(hits) != 1:
        raise SystemExit(
            f"mutation {mutation.name}: target {mutation.pattern!r} matched {len(hits)} times in "
            f"{mutation.file} (must be exactly once); the source changed, update the mutation"
        )
    m = hits[0]
    path.write_text(text[: m.start()] + mutation.replacement + text[m.end() :])


def copy_sources(root: Path) -> Path:
    """Copies metal_kernels/ and csrc/'s headers to `root`; returns the metal_kernels copy."""
    kdir = root / "metal_kernels"
    shutil.copytree(KERNELS, kdir)
    shutil.copytree(SHARED, root / "csrc", ignore=shutil.ignore_patterns("*.cpp", "*.o"))
    return kdir


def run_one(mutation: Mutation) -> tuple[bool, str, float]:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"msl-mutant-{mutation.name}-") as td:
        kdir = copy_sources(Path(td))
        apply(mutation, kdir)
        env = dict(
            os.environ,
            VLLM_METAL_MSL_KERNEL_DIR=str(kdir),
            VLLM_METAL_MSL_SHARED_DIR=str(Path(td) / "csrc"),
            COLUMNS="400",
        )
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                *(str(HERE / name) for name in TEST_FILES),
                "-m",
                "msl",
                "-x",
                "-q",
                "-p",
                "no:cacheprovider",
                "-k",
                mutation.tests,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    failed = [ln for ln in r.stdout.splitlines() if ln.startswith("FAILED")]
    if r.returncode == 1 and failed:
        test, _, why = failed[0].removeprefix("FAILED ").partition(" - ")
        why = re.sub(r"^[\w.]*(MslRuntimeError|AssertionError): ", "", why)
        return True, f"{test.split('::')[-1]}: {why[:110]}", time.monotonic() - t0
    tail = r.stdout.strip().splitlines()[-1:] or [r.stderr.strip()[-300:]]
    return False, f"pytest exit {r.returncode}: {tail[0]}", time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", help="run only the named mutation(s)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.only and len(chosen) != len(args.only):
        raise SystemExit(f"unknown mutation in {args.only}")
    if args.list:
        for m in chosen:
            print(f"{m.name:40s} {m.file}")
        return 0
    # Check every target before spending time on any run.
    with tempfile.TemporaryDirectory() as td:
        for m in chosen:
            apply(m, copy_sources(Path(td) / m.name))
    missed = 0
    for m in chosen:
        caught, detail, secs = run_one(m)
        missed += not caught
        print(
            f"{'CAUGHT' if caught else 'MISSED'}  {m.name:40s} {secs:5.1f}s  {detail}", flush=True
        )
    print(f"{len(chosen) - missed}/{len(chosen)} planted bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
