// The per-row dot product of two 16-bit rows that the backward statistics kernels (attention's delta,
// the causal linear attentions' grad_out . out) compute: each of a row's lanes reads 16-byte chunks
// of 8 elements and sums their products in fp32; the caller combines the lanes.
#pragma once

#include "tk/tk.cuh"

namespace tk {

constexpr int ROW_DOT_CHUNK_ELEMENTS = 8;  // one 16-byte load of 16-bit elements

// sum_e a[e] * b[e] over one 16-byte chunk, in fp32.
template <typename T>
__device__ __forceinline__ float chunk_dot(const T* a, const T* b) {
  const uint4 x = *reinterpret_cast<const uint4*>(a);
  const uint4 y = *reinterpret_cast<const uint4*>(b);
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w};
  const uint32_t ys[4] = {y.x, y.y, y.z, y.w};
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 u = to_float2(pair_from_bits<packed_pair_t<T>>(xs[i]));
    const float2 w = to_float2(pair_from_bits<packed_pair_t<T>>(ys[i]));
    dot = fmaf(u.x, w.x, fmaf(u.y, w.y, dot));
  }
  return dot;
}

// dot += this lane's share of a . b over `dim` elements (a multiple of 8, both rows 16-byte
// aligned): the chunks lane_in_row, lane_in_row + LANES, ... of the row's LANES lanes.
template <int LANES, typename T>
__device__ __forceinline__ void add_lane_dot(float& dot, const T* a, const T* b, int dim, int lane_in_row) {
  for (int c = lane_in_row * ROW_DOT_CHUNK_ELEMENTS; c < dim; c += LANES * ROW_DOT_CHUNK_ELEMENTS) {
    dot += chunk_dot(a + c, b + c);
  }
}

}  // namespace tk
