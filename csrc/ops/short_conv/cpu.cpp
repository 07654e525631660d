// The CPU causal_conv1d driver (see cpu.h).

#include "ops/short_conv/cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/elem.h"
#include "common/thread_pool.h"

namespace vllm_metal::cpu {

namespace {

// Below this many multiply-adds per call the convolution runs on the calling thread alone.
constexpr int64_t kParallelWork = 1 << 18;
// Tokens per work item.
constexpr int64_t kTokenBlock = 32;

// Tokens [t0, t1) of the sequence whose tokens are [begin, begin + len).
struct Item {
  int64_t s, begin, len, t0, t1;
};

template <typename E>
void run(const ShortConvArgs& a) {
  using T = typename E::T;
  const int64_t C = a.channels, K = a.width, keep = K - 1, S = a.num_seqs;
  const int64_t in_stride = a.state_stride > 0 ? a.state_stride : keep * C;
  const int64_t out_stride = a.state_out_stride > 0 ? a.state_out_stride : keep * C;
  const T* x = static_cast<const T*>(a.x);
  const T* state = static_cast<const T*>(a.conv_state);
  T* out = static_cast<T*>(a.out);
  T* state_out = static_cast<T*>(a.state_out);

  std::vector<float> w(K * C);  // weight as float [K, C]: the channel loop reads it contiguously
  const T* weight = static_cast<const T*>(a.weight);
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t j = 0; j < K; ++j) w[j * C + c] = E::load(weight[c * K + j]);
  }
  std::vector<float> b(C, 0.0f);  // bias as float (zeros without one)
  if (a.bias != nullptr) {
    const T* bias = static_cast<const T*>(a.bias);
    for (int64_t c = 0; c < C; ++c) b[c] = E::load(bias[c]);
  }
  const std::vector<T> zeros(C, E::store(0.0f));  // the window row of a fresh sequence
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t b = std::clamp<int64_t>(a.cu_seqlens[s], 0, a.num_tokens);
    const int64_t e = std::clamp<int64_t>(a.cu_seqlens[s + 1], b, a.num_tokens);
    int64_t t = b;
    do {
      items.push_back({s, b, e - b, t, std::min(t + kTokenBlock, e)});
      t += kTokenBlock;
    } while (t < e);
  }

  auto window = [&](int64_t s) -> int64_t {
    return a.state_indices != nullptr ? a.state_indices[s] : s;
  };
  // Entry u of sequence s's window-then-tokens sequence.
  auto input_row = [&](int64_t s, int64_t begin, int64_t u) -> const T* {
    if (u >= keep) return x + (begin + u - keep) * C;
    if (a.has_state != nullptr && a.has_state[s] == 0) return zeros.data();
    return state + window(s) * in_stride + u * C;
  };
  auto body = [&](const Item& it, std::vector<float>& acc) {
    acc.resize(C);
    for (int64_t t = it.t0; t < it.t1; ++t) {
      std::copy(b.begin(), b.end(), acc.begin());
      for (int64_t j = 0; j < K; ++j) {
        const T* row = input_row(it.s, it.begin, t - it.begin + j);
        const float* wj = w.data() + j * C;
        for (int64_t c = 0; c < C; ++c) acc[c] += wj[c] * E::load(row[c]);
      }
      T* y = out + t * C;
      if (a.silu) {
        for (int64_t c = 0; c < C; ++c) y[c] = E::store(acc[c] / (1.0f + std::exp(-acc[c])));
      } else {
        for (int64_t c = 0; c < C; ++c) y[c] = E::store(acc[c]);
      }
    }
  };

  for_each_item<std::vector<float>>(
      static_cast<int64_t>(items.size()), a.num_tokens * C * K, kParallelWork,
      [&](int64_t i, std::vector<float>& acc) { body(items[i], acc); });

  // The new windows, once every output is computed (they may overwrite the windows read above):
  // the last K - 1 entries of each window-then-tokens sequence. Written in order, entry e of the
  // new window reads entry len + e >= e of the old one, so no entry is read after it is written.
  for (int64_t s = 0; s < S; ++s) {
    const int64_t b = std::clamp<int64_t>(a.cu_seqlens[s], 0, a.num_tokens);
    const int64_t len = std::clamp<int64_t>(a.cu_seqlens[s + 1], b, a.num_tokens) - b;
    T* dst = state_out + window(s) * out_stride;
    for (int64_t e = 0; e < keep; ++e) {
      std::memmove(dst + e * C, input_row(s, b, len + e), C * sizeof(T));
    }
  }
}

}  // namespace

void causal_conv1d(const ShortConvArgs& a) {
  std::memset(a.out, 0, a.num_tokens * a.channels * elem_size(a.dtype));
  dispatch_elem(a.dtype, [&](auto e) { run<decltype(e)>(a); });
}

}  // namespace vllm_metal::cpu
