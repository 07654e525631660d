// causal_conv1d on DLPack tensors (torch CPU tensors, NumPy arrays) through nanobind, zero-copy,
// with each sequence's window read from and written back to a pool of windows in place: the entry
// a torch custom op calls. It checks the arguments itself (errors name them) and runs the CPU
// driver (cpu.h) with the GIL released.
#pragma once

#include <nanobind/ndarray.h>

namespace vllm_metal {

// x [T, C] and out [T, C] contiguous and not overlapping; weight [C, K] contiguous (K >= 2);
// bias [C] or None; conv_state [N, K - 1, C] with contiguous rows (any stride between windows);
// all of one dtype (float32, float16 or bfloat16). state_indices [S] int32 distinct in [0, N),
// has_state [S] bool/uint8 or None (all true), cu_seqlens [S + 1] int32, each contiguous.
// Sequence s (tokens cu_seqlens[s] .. cu_seqlens[s + 1] of x) continues from window
// conv_state[state_indices[s]] (zeros when has_state[s] is false): writes
// out[t, c] = act(bias[c] + sum_j weight[c, j] * u[t + j, c]) (act SiLU when `silu`, else none;
// u the window then the tokens; float32 sums) and then stores the last K - 1 entries of u in that
// window, in place. CPU tensors only. Throws std::invalid_argument (ValueError) naming the argument.
void causal_conv1d_into(const nanobind::ndarray<>& x, const nanobind::ndarray<>& weight,
                        const nanobind::ndarray<>& bias, const nanobind::ndarray<>& conv_state,
                        const nanobind::ndarray<>& state_indices,
                        const nanobind::ndarray<>& has_state,
                        const nanobind::ndarray<>& cu_seqlens, const nanobind::ndarray<>& out,
                        bool silu);

}  // namespace vllm_metal
