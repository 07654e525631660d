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
from pathlib import Path

from tests.msl.mutations import FLOAT_MUTATIONS, Mutation
from tests.msl.mutations_quant import QUANT_MUTATIONS

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
KERNELS = REPO / "metal_kernels"
SHARED = REPO / "csrc"
TEST_FILES = (
    "test_kernels.py",
    "test_fp8_kernels.py",
    "test_pth_kernels.py",
    "test_turboquant_kernels.py",
)


MUTATIONS = [*FLOAT_MUTATIONS, *QUANT_MUTATIONS]


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
