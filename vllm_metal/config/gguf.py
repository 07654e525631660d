"""`vllm serve FILE.gguf` without `--tokenizer`: the tokenizer transformers builds from the file's
tokenizer metadata, saved once as a Hugging Face tokenizer directory so every vLLM process can
load it. (vLLM's config of a `.gguf` path comes from `compat.vllm_config`.)
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_metal._logging import init_logger
from vllm_metal.models.loaders import is_gguf

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def tokenizer_dir(path: str | Path, cache_root: str | Path | None = None) -> Path:
    """A Hugging Face tokenizer directory built by transformers from the GGUF file's tokenizer
    metadata (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), cached per file version under
    vLLM's cache root (`VLLM_CACHE_ROOT`)."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    if cache_root is None:
        import vllm.envs

        cache_root = Path(vllm.envs.VLLM_CACHE_ROOT) / "vllm-metal" / "gguf-tokenizers"
    root = Path(cache_root)
    out = root / f"{path.stem}-{key}"
    if (out / "tokenizer_config.json").is_file():
        return out
    if "tokenizer.ggml.model" not in _metadata_keys(path):
        raise ValueError(
            f"model={str(path)!r}: the GGUF file has no tokenizer; pass --tokenizer with the "
            "original model's Hugging Face id or directory"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    staging = out.with_name(out.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(str(staging))
    try:
        staging.replace(out)
    except OSError:  # another process saved it first
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _metadata_keys(path: Path) -> set[str]:
    from vllm_metal.models.loaders.gguf import open_reader

    return set(open_reader(path).fields)


def use_file_tokenizer(vllm_config: VllmConfig) -> None:
    """With a `.gguf` model and no `--tokenizer`, point vLLM at the file's own tokenizer."""
    model = vllm_config.model_config
    if model is None or not is_gguf(model.model) or model.skip_tokenizer_init:
        return
    if model.tokenizer != model.model:
        return
    model.tokenizer = str(tokenizer_dir(model.model))
    logger.info(
        "vllm-metal: tokenizer of %s read from its GGUF metadata (%s); pass --tokenizer to use the "
        "original model's",
        model.model,
        model.tokenizer,
    )
