"""The control plane: what each backend serves (model kinds x features, `table.py`), the startup
checks and config rewrites (`startup.py`, `multimodal.py`, `kv_offload.py`, `gguf.py`) and the
per-request refusals (`requests.py`). Model kinds are read from `vllm_metal.models`, never the
reverse: nothing below this package imports it.
"""

from vllm_metal.config.errors import MetalConfigError

__all__ = ["MetalConfigError"]
