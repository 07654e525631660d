"""The constants the native ops share (csrc/constants.h) as Python values: from vllm_metal._C
when the extension loads, else from the header itself. Read them here; never restate them."""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.ops import _backend, _header


def _source() -> dict[str, object]:
    native = _backend.loaded_native()
    if native is not None:
        return dict(native._C.CONSTANTS)
    return _header.header_constants()


CONSTANTS: dict[str, object] = _source()

HEAD_SIZES: tuple[int, ...] = tuple(CONSTANTS["HEAD_SIZES"])
# The head sizes of the TurboQuant Metal kernels (the C++ CPU bodies take any).
TQ_HEAD_SIZES: tuple[int, ...] = tuple(CONSTANTS["TQ_HEAD_SIZES"])
# (latent_dim, value_dim) pairs of the MLA kernel.
MLA_SIZES: tuple[tuple[int, int], ...] = tuple(tuple(e) for e in CONSTANTS["MLA_SIZES"])
BLOCK_SIZE_MULTIPLE: int = CONSTANTS["BLOCK_SIZE_MULTIPLE"]
# Entries are (tag, msl_type, mlx_name, bytes).
FLOAT_DTYPES: tuple[mx.Dtype, ...] = tuple(getattr(mx, e[2]) for e in CONSTANTS["FLOAT_DTYPES"])
