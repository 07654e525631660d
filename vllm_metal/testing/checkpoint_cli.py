"""The command line the tiny checkpoint writers share: `--out DIR [--dtype] [--seed]`, print the
written directory."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path


def write_checkpoint_main(
    argv: list[str] | None,
    module: str,
    what: str,
    write: Callable[..., Path],
    dtypes: Sequence[str],
) -> int:
    """Parse `argv`, call `write(out, dtype=..., seed=...)` and print the resolved directory."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=f"Write the tiny random-weight {what} checkpoint and print its path.",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="float32", choices=list(dtypes))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write(Path(args.out), dtype=args.dtype, seed=args.seed).resolve())
    return 0
