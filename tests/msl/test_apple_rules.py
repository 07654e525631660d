"""Apple's Metal rules that g++ does not enforce: every kernel source follows them (apple_rules.py),
the host's planners launch within them, the runner rejects dispatches beyond them, and a planted
violation of each rule is reported with its rule, file and line."""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("clang.cindex", reason="the Apple-rules lint needs libclang (test extras)")

from . import apple_rules, harness
from . import kernels as K

pytestmark = pytest.mark.msl

FIXTURES = harness.HERE / "fixtures" / "apple_rules"
VIOLATIONS = sorted(p for p in FIXTURES.glob("*.metal") if p.stem != "clean")
# Fixtures whose rules need the harness build (static threadgroup arrays, per-instance maxima).
NEEDS_BUILD = {"threadgroup_memory", "threads_per_threadgroup"}


def expected(fixture: Path) -> set[tuple[int, str]]:
    """(line, rule) of every `// expect: rule[, rule]` comment of a fixture."""
    out = set()
    for n, line in enumerate(fixture.read_text().splitlines(), 1):
        m = re.search(r"//\s*expect:\s*([\w\-, ]+)$", line)
        if m:
            out |= {(n, rule.strip()) for rule in m[1].split(",")}
    return out


def show(reports: list) -> str:
    return "\n".join(map(str, reports)) or "(no reports)"


# ---------------------------------------------------------------------------------------------
# The kernel sources
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    apple_rules.kernel_sources(),
    ids=lambda p: p.relative_to(harness.KERNEL_DIR).as_posix(),
)
def test_kernel_source_follows_apple_rules(source: Path) -> None:
    reports = apple_rules.lint(source)
    assert not reports, show(reports)


def test_host_launches_stay_within_the_pipeline_limits() -> None:
    """Every launch the planners of vllm_metal._C can produce, over a grid of dtypes, head dims,
    block sizes, head groupings, batches, windows and devices: threads per threadgroup within
    1..1024 and the kernel's declared maximum, whole simdgroups for kernels using simdgroup
    functions."""
    facts: dict[str, apple_rules.InstanceFacts] = {}
    for source in apple_rules.kernel_sources():
        facts |= apple_rules.facts(source)
    launched: dict[str, int] = {}

    def check(kernel: str, threads: int, context: object) -> None:
        assert kernel in facts, f"{context}: the host launches {kernel}, which no source defines"
        f = facts[kernel]
        assert 1 <= threads <= f.max_threads, f"{context}: {kernel} with {threads} threads"
        if f.uses_simdgroup:
            assert threads % apple_rules.SIMD_WIDTH == 0, f"{context}: {kernel}, {threads} threads"
        launched[f.function] = launched.get(f.function, 0) + 1

    C = K.native()
    batches = [  # (cu_seqlens_q, seq_lens): decode, prefill, mixed with a long decode row
        ([0, 1, 2], [17, 300]),
        ([0, 7, 40], [7, 90]),
        ([0, 1, 9, 10], [6000, 50, 9000]),
    ]
    heads = [(8, 8), (32, 8), (12, 1), (40, 8), (16, 2)]
    grid = itertools.product(
        C.CONSTANTS["FLOAT_DTYPES"], C.CONSTANTS["HEAD_SIZES"], (8, 16, 24, 32, 64, 128), heads,
        batches, (0, 64), (False, True), (8, 40),
    )  # fmt: skip
    planned = 0
    for (dt, *_), d, bs, (hq, hkv), (cu, lens), window, nax, cores in grid:
        context = (dt, d, bs, hq, hkv, cu, lens, window, nax, cores)
        try:
            plan = C.select_paged_attention_kernel(dt, hq, hkv, d, bs, cu, lens, window, nax, cores)
        except ValueError as e:  # combinations the host refuses (e.g. f32 at head dim 512)
            assert "no Metal" in str(e), f"{context}: {e}"
            continue
        planned += 1
        for launch in plan["launches"]:
            check(launch["kernel"], launch["threads"], context)
            if launch["reduce_kernel"]:
                check(launch["reduce_kernel"], launch["reduce_threads"], context)
    for (dt, *_), heads_kv, d in itertools.product(
        C.CONSTANTS["FLOAT_DTYPES"], (1, 2, 3, 8, 32), (1, 3, 64, 80, 128, 256, 512, 1000)
    ):
        launch = C.select_reshape_and_cache_kernel(dt, heads_kv, d)
        check(launch["kernel"], launch["threads"], (dt, heads_kv, d))
    for (dt, *_), hv, dk, dv in itertools.product(
        C.CONSTANTS["FLOAT_DTYPES"], (1, 8, 32), (1, 37, 128, 256), (1, 5, 128)
    ):
        launch = C.select_gated_delta_rule_kernel(dt, hv, dk, dv, 3)
        check(launch["kernel"], launch["threads"], (dt, hv, dk, dv))
    for (dt, *_), channels, width in itertools.product(
        C.CONSTANTS["FLOAT_DTYPES"], (1, 37, 256, 257, 8192), (2, 4)
    ):
        launch = C.select_causal_conv1d_kernel(dt, 10, 3, channels, width)
        check(launch["kernel"], launch["threads"], (dt, channels, width))
    for (dt, *_), h, p, n in itertools.product(
        C.CONSTANTS["FLOAT_DTYPES"], (1, 8, 48), (1, 5, 64), (1, 16, 37, 128, 256)
    ):
        launch = C.select_mamba2_scan_kernel(dt, h, p, n, 3)
        check(launch["kernel"], launch["threads"], (dt, h, p, n))
    for (dt, *_), (d, dv), h in itertools.product(
        C.CONSTANTS["FLOAT_DTYPES"], C.CONSTANTS["MLA_SIZES"], (1, 7, 8, 16, 128)
    ):
        launch = C.select_mla_attention_kernel(dt, h, d, dv, 5)
        check(launch["kernel"], launch["threads"], (dt, d, dv, h))
    for (dt, *_), d in itertools.product(C.CONSTANTS["FLOAT_DTYPES"], (1, 64, 576, 1000)):
        launch = C.select_mla_reshape_and_cache_kernel(dt, d, 3)
        check(launch["kernel"], launch["threads"], (dt, d))
    for (dt, *_), to_f32, pos, heads, d in itertools.product(
        C.CONSTANTS["FLOAT_DTYPES"], (False, True), ("i32", "i64"), (1, 5, 40), (2, 67, 128, 512)
    ):
        cache = "f32" if to_f32 else dt
        launch = C.select_rotary_embedding_kernel(dt, cache, pos, 3, heads, d)
        check(launch["kernel"], launch["threads"], (dt, cache, pos, heads, d))
    for d, (hq, hkv), (cu, lens), window, cores in itertools.product(
        C.CONSTANTS["TQ_HEAD_SIZES"], [(8, 8), (32, 8), (12, 1)], batches, (0, 64), (8, 40)
    ):
        plan = C.select_turboquant_attention_kernel(d, hq, hkv, cu[-1], cu, lens, window, cores)
        check(plan["kernel"], plan["threads"], ("turboquant", d, hq, hkv, cu, lens, window))
        if plan["reduce_kernel"]:
            check(plan["reduce_kernel"], plan["reduce_threads"], ("turboquant", d, cu, lens))
    for tokens, heads_kv in itertools.product((1, 5, 300), (1, 8)):
        launch = C.select_turboquant_write_kernel(tokens, heads_kv)
        check(launch["kernel"], launch["threads"], ("turboquant", tokens, heads_kv))
    assert planned > 2000
    assert set(launched) == {f.function for f in facts.values()}, "a kernel the grid never plans"


# ---------------------------------------------------------------------------------------------
# Planted violations: the lint is not trivially passing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", VIOLATIONS, ids=lambda p: p.stem)
def test_planted_violation_is_reported(fixture: Path) -> None:
    want = expected(fixture)
    assert fixture.stem.replace("_", "-") in {rule for _, rule in want}
    reports = apple_rules.lint(fixture, build=fixture.stem in NEEDS_BUILD)
    assert {(r.line, r.rule) for r in reports} == want, show(reports)
    assert all(r.file.endswith(f"apple_rules/{fixture.name}") and r.where for r in reports)


def test_every_rule_has_a_planted_violation() -> None:
    planted = {rule for f in VIOLATIONS for _, rule in expected(f)}
    assert planted == set(apple_rules.RULES) - {"parse", "compile"}


def test_clean_fixture_has_no_reports() -> None:
    clean = FIXTURES / "clean.metal"
    assert apple_rules.lint(clean) == []
    # ...and was read: its instances, their declared maxima and their simdgroup use are known.
    f = apple_rules.facts(clean)
    assert f["block_sum_f32_128"] == apple_rules.InstanceFacts("block_sum", 128, True)
    assert f["block_sum_f16_256"].max_threads == 256


@pytest.mark.parametrize(
    "path,original,planted,lint,rule",
    [
        # a clashing slot through the shared params.h macros
        (
            "cache/reshape_and_cache.metal",
            "[[buffer(RC_BUF_PARAMS)]]",
            "[[buffer(RC_BUF_KEY)]]",
            "cache/reshape_and_cache.metal",
            "argument-duplicate",
        ),
        # recursion and double in a header the kernels share
        (
            "attention/common.h",
            "  return x;\n}\n\n// First key position",
            "  return p.softcap > 1.0f ? pa_logit(x, p) : x;\n}\n\n// First key position",
            "attention/decode.metal",
            "recursion",
        ),
        (
            "attention/common.h",
            "  float x = dot * p.scale;",
            "  double x = dot * p.scale;",
            "attention/gqa.metal",
            "double",
        ),
    ],
    ids=["duplicate-slot", "recursive-helper", "double-in-header"],
)
def test_violation_planted_in_a_real_kernel_copy(tmp_path, path, original, planted, lint, rule):
    root = tmp_path / "metal_kernels"
    shutil.copytree(harness.KERNEL_DIR, root)
    text = (root / path).read_text()
    assert text.count(original) == 1, f"{path} no longer contains the line to mutate"
    (root / path).write_text(text.replace(original, planted))
    reports = apple_rules.lint(root / lint, build=False)
    assert [r.rule for r in reports] == [rule], show(reports)
    assert reports[0].file.endswith(path)


# ---------------------------------------------------------------------------------------------
# Dispatch-time rules (runtime/runner.cpp)
# ---------------------------------------------------------------------------------------------


def dispatch(fixture: str, kernel: str, threads: tuple[int, int, int], tgmem=None) -> None:
    program = harness.compile_source(FIXTURES / f"{fixture}.metal")
    binds = {0: "out", 1: np.array(0, np.uint32)}
    d = harness.Dispatch(kernel, (1, 1, 1), threads, binds, tgmem or {})
    harness.run(program, {"out": np.zeros(2048, np.float32)}, [d], ["out"])


LIMITS = [
    # fixture, kernel, (a dispatch within the rules, one beyond them), [[threadgroup(0)]] lengths
    ("threads_per_threadgroup", "capped", ((64, 1, 1), (128, 1, 1)), None),
    ("threads_per_threadgroup", "plain", ((32, 32, 1), (33, 32, 1)), None),
    ("threads_per_threadgroup", "per_instance_256", ((256, 1, 1), (288, 1, 1)), None),
    ("simd_width", "partial", ((64, 1, 1), (48, 1, 1)), None),
    ("threadgroup_memory", "with_dynamic", ((32, 1, 1), (32, 1, 1)), ({0: 8192}, {0: 20480})),
]


@pytest.mark.parametrize("fixture,kernel,threads,tgmem", LIMITS, ids=[x[1] for x in LIMITS])
def test_runner_enforces_dispatch_limits(fixture, kernel, threads, tgmem) -> None:
    ok, beyond = threads
    ok_mem, beyond_mem = tgmem or (None, None)
    dispatch(fixture, kernel, ok, ok_mem)
    kind = {"simd_width": "simd-width", "threadgroup_memory": "threadgroup-limit"}.get(
        fixture, "threads-per-threadgroup"
    )
    with pytest.raises(harness.MslRuntimeError) as e:
        dispatch(fixture, kernel, beyond, beyond_mem)
    assert e.value.kind == kind, str(e.value)


def test_runner_counts_threadgroup_arrays_a_dispatch_never_reaches() -> None:
    dispatch("threadgroup_memory", "stage_small", (32, 1, 1))
    with pytest.raises(harness.MslRuntimeError) as e:
        dispatch("threadgroup_memory", "stage_big", (32, 1, 1))
    assert e.value.kind == "threadgroup-limit" and "36864" in str(e.value), str(e.value)
