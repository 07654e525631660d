"""The GPU's real core count reaches the split-KV planner: it is parsed from the IORegistry's
`ioreg -a` output on macOS, handed to _C (with a logged fallback), and changes the plan.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator

import pytest

from vllm_metal import ops
from vllm_metal.ops import _gpu

# `ioreg -a -r -d 1 -c AGXAccelerator` on an M2 Pro (abridged: one entry, some of its keys).
IOREG_M2_PRO = b"""<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<plist version="1.0">
<array>
	<dict>
		<key>AGXParameterBufferMaxSize</key>
		<integer>402653184</integer>
		<key>CFBundleIdentifier</key>
		<string>com.apple.AGXG14X</string>
		<key>GPUConfigurationVariable</key>
		<dict>
			<key>gpu_gen</key>
			<integer>14</integer>
			<key>num_cores</key>
			<integer>19</integer>
		</dict>
		<key>IOClass</key>
		<string>AGXAcceleratorG14X</string>
		<key>IOMatchedAtBoot</key>
		<true/>
		<key>gpu-core-count</key>
		<integer>19</integer>
		<key>model</key>
		<string>Apple M2 Pro</string>
	</dict>
</array>
</plist>
"""


def test_parses_the_core_count_of_the_accelerator() -> None:
    assert _gpu.parse_gpu_core_count(IOREG_M2_PRO) == 19


@pytest.mark.parametrize(
    "output",
    [
        b"",
        b"not a plist",
        IOREG_M2_PRO.replace(b"gpu-core-count", b"gpu-core-kount"),
        IOREG_M2_PRO.replace(
            b"<integer>19</integer>\n\t\t<key>model", b"<string>x</string>\n<key>model"
        ),
        IOREG_M2_PRO.replace(
            b"<integer>19</integer>\n\t\t<key>model", b"<integer>0</integer>\n<key>model"
        ),
    ],
    ids=["empty", "garbage", "no-key", "not-an-int", "zero"],
)
def test_unreadable_output_gives_none(output: bytes) -> None:
    assert _gpu.parse_gpu_core_count(output) is None


def test_reads_ioreg_only_on_macos(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, IOREG_M2_PRO, b"")

    monkeypatch.setattr(_gpu.sys, "platform", "linux")
    assert _gpu.read_gpu_core_count(fake_run) is None and calls == []
    monkeypatch.setattr(_gpu.sys, "platform", "darwin")
    assert _gpu.read_gpu_core_count(fake_run) == 19
    assert calls == [_gpu.IOREG]

    def missing(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    assert _gpu.read_gpu_core_count(missing) is None


@pytest.fixture
def native_C() -> Iterator[object]:
    if not ops.native_available():
        pytest.skip(f"native extension unavailable: {ops.native_unavailable_reason()}")
    from vllm_metal import _C

    yield _C
    _C.set_gpu_cores(0)


def decode_plan(_C, **kwargs) -> dict:
    # Four long decode rows of an 8-head MHA model: a one-pass grid of 8 x 4 = 32 threadgroups.
    (launch,) = _C.select_paged_attention_kernel(
        "f16", 8, 8, 128, 16, [0, 1, 2, 3, 4], [5000] * 4, **kwargs
    )["launches"]
    return launch


def test_split_kv_plan_follows_the_core_count(native_C) -> None:
    per_core = native_C.CONSTANTS["SPLIT_THREADGROUPS_PER_CORE"]
    assert native_C.gpu_cores() == native_C.CONSTANTS["DEFAULT_GPU_CORES"]
    native_C.set_gpu_cores(32 // per_core)  # the grid already has a threadgroup per slot
    assert decode_plan(native_C)["partition_size"] == 0
    native_C.set_gpu_cores(32 // per_core + 1)
    assert decode_plan(native_C)["partition_size"] == native_C.CONSTANTS["PARTITION_SIZE"]
    # An explicit count overrides the device's (the planner tests use it).
    assert decode_plan(native_C, gpu_cores=1)["partition_size"] == 0
    native_C.set_gpu_cores(0)
    assert native_C.gpu_cores() == native_C.CONSTANTS["DEFAULT_GPU_CORES"]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.levelname, record.getMessage()))


@pytest.fixture
def records() -> Iterator[Records]:
    logger = logging.getLogger("vllm.metal.ops")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_native_hands_the_count_to_the_planner_once(
    native_C, records: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_metal.ops import _native

    reads = []
    monkeypatch.setattr(_gpu, "read_gpu_core_count", lambda: reads.append(1) or 19)
    # What a GPU build's _C.metal_device_facts() answers on an M2 Pro.
    facts = {"architecture": "applegpu_g14s", "architecture_gen": 14, "nax": False}
    monkeypatch.setattr(_native, "_metal_facts", lambda: facts)
    _native._configure_gpu.cache_clear()
    _native._configure_gpu()
    _native._configure_gpu()
    assert native_C.gpu_cores() == 19 and len(reads) == 1
    ((level, message),) = records.seen
    assert level == "INFO"
    assert message.startswith("Metal GPU applegpu_g14s (generation 14), 19 cores; NAX prefill")
    assert "kernels: no (they need an M5-class GPU" in message
    _native._configure_gpu.cache_clear()


@pytest.mark.parametrize(
    "os_has_metal4, architecture, gen, expected",
    [
        (True, "applegpu_g17s", 17, True),  # M5
        (True, "applegpu_g17g", 17, True),
        (True, "applegpu_g18s", 18, True),  # later Mac GPUs
        (True, "applegpu_g16s", 16, False),  # M4
        (True, "applegpu_g17p", 17, False),  # a phone-class part needs generation 18
        (True, "applegpu_g18p", 18, True),
        (False, "applegpu_g17s", 17, False),  # an OS before macOS 26.2
        (True, "", 17, False),  # MLX could not name the GPU
    ],
)
def test_nax_eligibility_follows_gpu_generation_and_os(
    native_C, os_has_metal4: bool, architecture: str, gen: int, expected: bool
) -> None:
    assert native_C.nax_eligible(os_has_metal4, architecture, gen) is expected


def test_unknown_count_keeps_the_default_and_says_so(
    native_C, records: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_metal.ops import _native

    monkeypatch.setattr(_gpu, "read_gpu_core_count", lambda: None)
    _native._configure_gpu.cache_clear()
    _native._configure_gpu()
    assert native_C.gpu_cores() == native_C.CONSTANTS["DEFAULT_GPU_CORES"]
    ((level, message),) = records.seen
    assert level == "WARNING" and f"{native_C.gpu_cores()} cores" in message
    _native._configure_gpu.cache_clear()
