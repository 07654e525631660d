"""Former home of the ops' constants, kept importable for callers not yet moved to
``vllm_metal.ops.HEAD_SIZES`` and friends (the checks now live beside each op)."""

from vllm_metal.ops._constants import BLOCK_SIZE_MULTIPLE, FLOAT_DTYPES, HEAD_SIZES

__all__ = ["BLOCK_SIZE_MULTIPLE", "FLOAT_DTYPES", "HEAD_SIZES"]
