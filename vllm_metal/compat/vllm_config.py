"""Patches of vLLM's config entry points: `vllm serve FILE.gguf` builds its config from the file.

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
  metadata (`config.gguf`, not a patch).

vLLM's `quantization` stays None: the MLX runner reads the file itself (models/loaders/gguf.py).
"""

from __future__ import annotations

from functools import wraps

from vllm_metal.models.loaders import is_gguf

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
