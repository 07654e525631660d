"""The torch backend's causal convolution (`kernels.causal_conv1d`: the C++ CPU driver through
DLPack, and its torch-ops path for other devices) against an independent per-sequence
`torch.nn.functional.conv1d`, on windows laid out as vLLM lays out state pages: strided views of
one buffer per block page, the windows of fresh requests poisoned with NaN (a read of them shows
in the output), decodes beside first and later prefill chunks, and an empty sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_metal.backends.torch import kernels, torch_ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rtol, atol): float32 differs only by summation order; half types by one output rounding.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2)}
CHANNELS, WIDTH, PAGES = 40, 4, 9
# A page holds a window after LEAD elements, with TAIL more after it.
LEAD, TAIL = 6, 10
LENS = [1, 1, 0, 5, 70, 2, 33]
INDICES = [7, 0, 3, 5, 8, 2, 6]
HAS_STATE = [True, True, False, True, False, True, False]
PATHS = {"native": kernels.causal_conv1d, "torch": torch_ops.causal_conv1d}


def window_pool(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages [PAGES, LEAD + (K-1)*C + TAIL] and the window view [PAGES, K-1, C] into them."""
    g = torch.Generator().manual_seed(seed)
    keep = WIDTH - 1
    pages = torch.randn(PAGES, LEAD + keep * CHANNELS + TAIL, generator=g).to(dtype)
    return pages, windows_of(pages)


def windows_of(pages: torch.Tensor) -> torch.Tensor:
    keep = WIDTH - 1
    return pages[:, LEAD : LEAD + keep * CHANNELS].view(PAGES, keep, CHANNELS)


def reference(x, weight, bias, windows, indices, has_state, lens, silu):
    """Each sequence on its own: F.conv1d over its window (zeros when fresh) then its tokens."""
    keep = WIDTH - 1
    outs, new = [], windows.clone()
    start = 0
    for s, n in enumerate(lens):
        window = windows[indices[s]] if has_state[s] else torch.zeros(keep, CHANNELS)
        u = torch.cat([window.float(), x[start : start + n].float()])
        y = torch.empty(0, CHANNELS)  # conv1d refuses an input shorter than the kernel
        if n:
            y = F.conv1d(
                u.t()[None],
                weight.float()[:, None, :],
                None if bias is None else bias.float(),
                groups=CHANNELS,
            )[0].t()
        outs.append(F.silu(y) if silu else y)
        new[indices[s]] = u[-keep:].to(windows.dtype)
        start += n
    return torch.cat(outs), new


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_matches_per_sequence_conv1d(dtype, bias, silu, path):
    g = torch.Generator().manual_seed(1)
    tokens = sum(LENS)
    # x as vLLM's layer makes it: B * x of two column slices of one projection.
    bcx = torch.randn(tokens, 3 * CHANNELS, generator=g).to(dtype)
    x = bcx[:, :CHANNELS] * bcx[:, 2 * CHANNELS :]
    weight = (torch.randn(CHANNELS, WIDTH, generator=g) * 0.5).to(dtype)
    bias_t = torch.randn(CHANNELS, generator=g).to(dtype) if bias else None
    pages, windows = window_pool(dtype, seed=2)
    has_state = torch.tensor(HAS_STATE)
    for s, fresh in enumerate(~has_state):
        if fresh:
            windows[INDICES[s]] = float("nan")
    before = pages.clone()
    want, want_windows = reference(x, weight, bias_t, windows, INDICES, HAS_STATE, LENS, silu=silu)

    out = torch.full((tokens, CHANNELS), float("nan"), dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.tensor(INDICES, dtype=torch.int32)
    PATHS[path](x, weight, bias_t, windows, indices, has_state, cu, out, silu=silu)

    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), want, rtol=rtol, atol=atol)
    assert torch.equal(windows, want_windows)  # copies of inputs: exact
    outside = torch.ones_like(pages, dtype=torch.bool)
    outside[:, LEAD : LEAD + (WIDTH - 1) * CHANNELS] = False
    assert torch.equal(pages[outside], before[outside])  # the rest of each page is untouched


def test_windows_stored_dim_first_take_the_torch_path():
    """vLLM's "DS" conv-state layout ([blocks, C, K-1] per page, read transposed): the rows of a
    window are not contiguous, so the CPU driver cannot read them in place."""
    g = torch.Generator().manual_seed(5)
    tokens = sum(LENS)
    x = torch.randn(tokens, CHANNELS, generator=g)
    weight = torch.randn(CHANNELS, WIDTH, generator=g)
    pages = torch.randn(PAGES, CHANNELS * (WIDTH - 1), generator=g)
    windows = pages.view(PAGES, CHANNELS, WIDTH - 1).transpose(1, 2)
    want, want_windows = reference(x, weight, None, windows, INDICES, HAS_STATE, LENS, silu=False)
    out = torch.empty(tokens, CHANNELS)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    kernels.causal_conv1d(x, weight, None, windows, torch.tensor(INDICES, dtype=torch.int32),
                             torch.tensor(HAS_STATE), cu, out)  # fmt: skip
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(windows, want_windows)


def test_decode_steps_continue_a_chunked_prefill():
    """A prompt in chunks of 16, then single-token decodes, through one window: the outputs equal
    one convolution over the whole sequence."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, CHANNELS, generator=g)
    weight = torch.randn(CHANNELS, WIDTH, generator=g)
    _, windows = window_pool(torch.float32, seed=4)
    index = torch.tensor([4], dtype=torch.int32)
    outs, start = [], 0
    for n in [16, 16, 13, 1, 1, 1, 1, 1]:
        out = torch.empty(n, CHANNELS)
        has_state = torch.tensor([start > 0])
        cu = torch.tensor([0, n], dtype=torch.int32)
        kernels.causal_conv1d(x[start : start + n], weight, None, windows, index, has_state,
                                 cu, out)  # fmt: skip
        outs.append(out)
        start += n
    want, _ = reference(x, weight, None, windows, [4], [False], [50], silu=False)
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-5, atol=1e-5)


def _native_args(**changes):
    tokens = 6
    args = {
        "x": torch.randn(tokens, CHANNELS),
        "weight": torch.randn(CHANNELS, WIDTH),
        "bias": None,
        "conv_state": torch.randn(PAGES, WIDTH - 1, CHANNELS),
        "state_indices": torch.tensor([1, 4], dtype=torch.int32),
        "has_state": None,
        "cu_seqlens": torch.tensor([0, 2, tokens], dtype=torch.int32),
        "out": torch.empty(tokens, CHANNELS),
        "silu": False,
    }
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"state_indices": torch.tensor([1, 1], dtype=torch.int32)}, "state_indices must be"),
        ({"state_indices": torch.tensor([1, PAGES], dtype=torch.int32)}, "state_indices must be"),
        ({"state_indices": torch.tensor([1, 4])}, "state_indices must be int32"),
        ({"weight": torch.randn(CHANNELS, WIDTH, dtype=torch.float16)}, "weight must have"),
        ({"conv_state": torch.randn(PAGES, CHANNELS, WIDTH - 1).transpose(1, 2)}, "conv_state"),
        ({"out": torch.empty(5, CHANNELS)}, "out must have shape"),
        ({"cu_seqlens": torch.tensor([0, 6], dtype=torch.int32)}, "cu_seqlens must have shape"),
        ({"has_state": torch.ones(2, dtype=torch.int32)}, "has_state must be bool"),
    ],
    ids=["duplicate", "out_of_range", "int64", "dtype", "dim_first", "out", "cu", "flags"],
)
def test_the_native_entry_refuses_bad_arguments_by_name(changes, message):
    from vllm_metal.ops import _native

    args = _native_args(**changes)
    with pytest.raises(ValueError, match=message):
        _native._C.causal_conv1d_into(**args)


def test_the_native_entry_refuses_aliased_output():
    from vllm_metal.ops import _native

    args = _native_args()
    args["out"] = args["x"]
    with pytest.raises(ValueError, match="out must not overlap x"):
        _native._C.causal_conv1d_into(**args)


def test_the_op_runs_the_torch_body_for_mps_tensors():
    """No Mac here: the kernel registered for the "MPS" dispatch key is called by redispatch on
    `cpu` tensors, and equals the native one."""
    name = f"{kernels.NAMESPACE}::causal_conv1d"
    for key in ("CPU", "MPS"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), key
    g = torch.Generator().manual_seed(6)
    tokens = sum(LENS)
    x = torch.randn(tokens, CHANNELS, generator=g)
    weight = torch.randn(CHANNELS, WIDTH, generator=g)
    bias = torch.randn(CHANNELS, generator=g)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.tensor(INDICES, dtype=torch.int32)
    has_state = torch.tensor(HAS_STATE)
    results = []
    for keys in (torch._C.DispatchKeySet(torch._C.DispatchKey.CPU),
                 torch._C.DispatchKeySet(torch._C.DispatchKey.MPS)):  # fmt: skip
        pages, windows = window_pool(torch.float32, seed=7)
        out = torch.empty(tokens, CHANNELS)
        torch.ops.vllm_metal.causal_conv1d.default.redispatch(
            keys, x, weight, bias, windows, indices, has_state, cu, out, True
        )
        results.append((out, pages))
    (native_out, native_pages), (torch_out, torch_pages) = results
    torch.testing.assert_close(torch_out, native_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch_pages, native_pages)
