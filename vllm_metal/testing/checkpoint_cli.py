"""What the tiny checkpoint writers share: the command line (`--out DIR [--dtype] [--seed]`, print
the written directory) and writing the files of a checkpoint (`save_checkpoint`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


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


def save_checkpoint(
    out_dir: str | Path, tensors: Mapping[str, Any], dtype: str, files: Mapping[str, Any]
) -> Path:
    """Write `tensors` (torch, cast to `dtype`) as model.safetensors and each of `files` (a JSON
    value, or text) beside it; return the directory."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: t.detach().to(torch_dtype).contiguous() for name, t in tensors.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=2) + "\n"
        (out / name).write_text(text, encoding="utf-8")
    return out
