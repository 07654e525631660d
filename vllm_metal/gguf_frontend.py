"""`vllm serve FILE.gguf --tokenizer REPO_OR_DIR` on this platform.

vLLM 0.32 no longer reads GGUF files: it has no "gguf" quantization method or load format, and a
`.gguf` model path fails while it builds its config (the speculators probe parses the file as
JSON; `get_config` finds no config.json). The plugin restores what earlier vLLM releases did for a
`.gguf` path:

- the Hugging Face config comes from the file's metadata, read by transformers
  (`gguf_file=`), through a "gguf" config parser registered with vLLM's `register_config_parser`;
  `get_config` picks it for a `.gguf` path when `--config-format` is left at `auto`, and
  `--hf-config-path` still overrides it;
- a `.gguf` file is never a speculators checkpoint, so that probe is skipped for it;
- without `--tokenizer`, the tokenizer is the one transformers builds from the file's tokenizer
  metadata, saved once as a Hugging Face tokenizer directory so every vLLM process can load it.

vLLM's `quantization` stays None: the MLX runner reads the file itself (models/loaders/gguf.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_metal._logging import init_logger
from vllm_metal.models.loaders import is_gguf

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

_INSTALLED = "_vllm_metal_gguf"
CONFIG_FORMAT = "gguf"


def install() -> None:
    """Register the config parser and wrap vLLM's config entry points (idempotent)."""
    import vllm.config.model as model_config_module
    import vllm.transformers_utils.config as config_module
    from vllm.engine import arg_utils

    if getattr(config_module, _INSTALLED, False):
        return
    config_module.register_config_parser(CONFIG_FORMAT)(_parser_class())
    # `get_config` is called from its own module (generation config) and through the name
    # vllm.config.model imported.
    get_config = _gguf_config_format(config_module.get_config)
    config_module.get_config = get_config
    model_config_module.get_config = get_config
    arg_utils.maybe_override_with_speculators = _skip_for_gguf(
        arg_utils.maybe_override_with_speculators
    )
    setattr(config_module, _INSTALLED, True)


def _parser_class() -> type:
    from vllm.transformers_utils.config_parser_base import ConfigParserBase

    class GGUFConfigParser(ConfigParserBase):
        """The Hugging Face config of a `.gguf` file (`loaders.gguf.read_config`)."""

        def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
            from transformers import CONFIG_MAPPING

            from vllm_metal.models.loaders.gguf import read_config

            config_dict = read_config(model)  # vLLM's get_config applies --hf-overrides after
            config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(dict(config_dict))
            return config_dict, config

    return GGUFConfigParser


def _gguf_config_format(get_config):
    @wraps(get_config)
    def wrapper(
        model,
        trust_remote_code,
        revision=None,
        code_revision=None,
        config_format="auto",
        *args,
        **kwargs,
    ):
        if config_format == "auto" and is_gguf(model):
            config_format = CONFIG_FORMAT
        return get_config(
            model, trust_remote_code, revision, code_revision, config_format, *args, **kwargs
        )

    return wrapper


def _skip_for_gguf(maybe_override_with_speculators):
    @wraps(maybe_override_with_speculators)
    def wrapper(model, tokenizer, *args, **kwargs):
        if is_gguf(model):
            return model, tokenizer, kwargs.get("vllm_speculative_config")
        return maybe_override_with_speculators(model, tokenizer, *args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------------------------------
# Tokenizer from the file
# --------------------------------------------------------------------------------------------------


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
