// The row kernel of tk.linear_cross_entropy (the math: linear_cross_entropy.h).
//
//   block    one row of the tile, ROW_THREADS threads
//   thread   16-byte chunks chunk, chunk + ROW_THREADS, ... of the row (a warp reads 512 contiguous
//            bytes), CHUNKS_IN_FLIGHT of them loaded before the first is used
//   loss     each thread streams a log-sum-exp over its chunks (in log2 units: one exp2 per element
//            and one per chunk to rescale) and the sum of z; the block merges them, and thread 0
//            reads z at the target and writes lse and the loss
//   gradient each element is read, turned into its gradient and written back in place: the GEMMs
//            of the gradients read the tile next
//
// Tails need no code beyond a mask: rows are padded to whole chunks (row_stride), and the padding's
// elements are left out of the sums and written as zeros.
#pragma once

#include <cmath>
#include <cstdint>

#include "linear_cross_entropy.h"
#include "tk/common.cuh"
#include "tk/types/register_numeric.cuh"

namespace tk::linear_cross_entropy {

constexpr int CHUNK_BYTES = 16;  // one LDG.128 / STG.128
constexpr int ROW_THREADS = 256;
constexpr int ROW_WARPS = ROW_THREADS / WARP_THREADS;
// Independent 16-byte loads per thread before their first use: with MIN_BLOCKS_PER_SM resident blocks
// 64 KB in flight per SM, above what HBM's latency times its bandwidth asks of each SM (about 36 KB
// on an H200). The register budget this leaves (64 a thread) holds the passes without spills.
constexpr int CHUNKS_IN_FLIGHT = 4;
constexpr int MIN_BLOCKS_PER_SM = 4;
constexpr float LOG2_E = 1.4426950408889634f;  // exp(x) = exp2(x log2 e)
constexpr float LN_2 = 0.6931471805599453f;    // log(x) = log2(x) ln 2

template <typename T>
constexpr int CHUNK_ELEMENTS = CHUNK_BYTES / int(sizeof(T));
constexpr int CHUNK_PAIRS = CHUNK_BYTES / int(sizeof(uint32_t));

template <typename T>
struct tile_args {
  T* logits;
  int64_t row_stride;
  int classes;
  int chunks;             // 16-byte chunks per row: ceil(classes / CHUNK_ELEMENTS)
  int64_t first_class;
  int64_t vocab;
  const int64_t* target;
  int64_t ignore_index;
  float target_weight;        // 1 - e
  float smoothing_per_class;  // e / V
  float softcap;
  float inverse_softcap;
  float* lse;
  float* loss;
  const float* row_grad;
};

// A chunk of the row as fp32 values, and back.
template <typename T>
__device__ __forceinline__ void unpack_chunk(const uint4& bits, float (&values)[CHUNK_ELEMENTS<T>]) {
  const uint32_t pairs[CHUNK_PAIRS] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int i = 0; i < CHUNK_PAIRS; ++i) {
    const float2 pair = to_float2(pair_from_bits<packed_pair_t<T>>(pairs[i]));
    values[2 * i] = pair.x;
    values[2 * i + 1] = pair.y;
  }
}

template <typename T>
__device__ __forceinline__ uint4 pack_chunk(const float (&values)[CHUNK_ELEMENTS<T>]) {
  uint32_t pairs[CHUNK_PAIRS];
#pragma unroll
  for (int i = 0; i < CHUNK_PAIRS; ++i) {
    pairs[i] = pair_bits(numeric<T>::pair_from_float2(make_float2(values[2 * i], values[2 * i + 1])));
  }
  return make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
}

// A streamed log-sum-exp in log2 units: sum_v 2^(y_v - max) with its running maximum.
struct running_lse {
  float max;
  float sum;
};

__device__ __forceinline__ running_lse merge(running_lse a, running_lse b) {
  const float max = fmaxf(a.max, b.max);
  if (max == -INFINITY) return {max, 0.0f};  // both empty: no -inf - -inf
  return {max, a.sum * exp2f(a.max - max) + b.sum * exp2f(b.max - max)};
}

// Both statistics merged over the warp, on every lane.
__device__ __forceinline__ void merge_over_warp(running_lse& lse, float& logit_sum) {
#pragma unroll
  for (int mask = WARP_THREADS / 2; mask > 0; mask /= 2) {
    const running_lse other{__shfl_xor_sync(ALL_LANES, lse.max, mask), __shfl_xor_sync(ALL_LANES, lse.sum, mask)};
    lse = merge(lse, other);
    logit_sum += __shfl_xor_sync(ALL_LANES, logit_sum, mask);
  }
}

// A thread's next CHUNKS_IN_FLIGHT chunks of a row (first, first + ROW_THREADS, ...; those past the row's
// `chunks` left alone), all loads issued before any is used.
template <typename T>
__device__ __forceinline__ void load_chunks(const T* logits, int first, int chunks, uint4 (&raw)[CHUNKS_IN_FLIGHT]) {
#pragma unroll
  for (int k = 0; k < CHUNKS_IN_FLIGHT; ++k) {
    const int chunk = first + k * ROW_THREADS;
    if (chunk < chunks) raw[k] = *reinterpret_cast<const uint4*>(logits + int64_t(chunk) * CHUNK_ELEMENTS<T>);
  }
}

// The loss pass for one row (see the top of the file); thread 0 ends with lse and the loss.
template <typename T, bool SOFTCAP>
__device__ __forceinline__ void loss_row(const tile_args<T>& a, int64_t row) {
  constexpr int E = CHUNK_ELEMENTS<T>;
  const T* logits = a.logits + row * a.row_stride;
  const auto capped = [&](float r) { return SOFTCAP ? a.softcap * tanhf(r * a.inverse_softcap) : r; };
  running_lse lse{-INFINITY, 0.0f};
  float logit_sum = 0.0f;
  for (int first = threadIdx.x; first < a.chunks; first += ROW_THREADS * CHUNKS_IN_FLIGHT) {
    uint4 raw[CHUNKS_IN_FLIGHT];
    load_chunks(logits, first, a.chunks, raw);
#pragma unroll
    for (int k = 0; k < CHUNKS_IN_FLIGHT; ++k) {
      const int chunk = first + k * ROW_THREADS;
      if (chunk >= a.chunks) break;
      float y[E];  // z log2 e, -inf past the row's end
      unpack_chunk<T>(raw[k], y);
      float chunk_max = -INFINITY;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const bool inside = chunk * E + e < a.classes;
        const float z = capped(y[e]);
        logit_sum += inside ? z : 0.0f;
        y[e] = inside ? z * LOG2_E : -INFINITY;
        chunk_max = fmaxf(chunk_max, y[e]);
      }
      float chunk_sum = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) chunk_sum += exp2f(y[e] - chunk_max);
      lse = merge(lse, {chunk_max, chunk_sum});
    }
  }

  __shared__ running_lse warp_lse[ROW_WARPS];
  __shared__ float warp_logit_sum[ROW_WARPS];
  merge_over_warp(lse, logit_sum);
  if (lane_id() == 0) {
    warp_lse[warp_id()] = lse;
    warp_logit_sum[warp_id()] = logit_sum;
  }
  __syncthreads();
  if (warp_id() != 0) return;
  const bool holds_a_warp = lane_id() < ROW_WARPS;
  lse = holds_a_warp ? warp_lse[lane_id()] : running_lse{-INFINITY, 0.0f};
  logit_sum = holds_a_warp ? warp_logit_sum[lane_id()] : 0.0f;
  merge_over_warp(lse, logit_sum);
  if (lane_id() != 0) return;

  const float row_lse = (lse.max + log2f(lse.sum)) * LN_2;
  const int64_t target = a.target[row];
  float loss = 0.0f;
  if (target != a.ignore_index) {
    if (target < 0 || target >= a.vocab) {
      loss = NAN;
    } else {
      const float target_logit = capped(numeric<T>::to_float(logits[target]));
      loss = row_lse - a.target_weight * target_logit;
      if (a.smoothing_per_class != 0.0f) loss -= a.smoothing_per_class * logit_sum;  // 0 * inf would be NaN
    }
  }
  a.lse[row] = row_lse;
  a.loss[row] = loss;
}

// The gradient pass for one row: r overwritten by g (p - q) dz/dr.
template <typename T, bool SOFTCAP>
__device__ __forceinline__ void gradient_row(const tile_args<T>& a, int64_t row) {
  constexpr int E = CHUNK_ELEMENTS<T>;
  T* logits = a.logits + row * a.row_stride;
  const int64_t target = a.target[row];
  const bool ignored = target == a.ignore_index;
  const bool invalid = !ignored && (target < 0 || target >= a.vocab);
  const float grad = a.row_grad[row];
  const float lse_log2 = a.lse[row] * LOG2_E;
  const int64_t target_column = target - a.first_class;  // anywhere, or outside the tile
  const float smoothing_grad = grad * a.smoothing_per_class;
  const float target_grad = grad * a.target_weight;
  for (int first = threadIdx.x; first < a.chunks; first += ROW_THREADS * CHUNKS_IN_FLIGHT) {
    uint4 raw[CHUNKS_IN_FLIGHT];
    load_chunks(logits, first, a.chunks, raw);
#pragma unroll
    for (int k = 0; k < CHUNKS_IN_FLIGHT; ++k) {
      const int chunk = first + k * ROW_THREADS;
      if (chunk >= a.chunks) break;
      float values[E];
      unpack_chunk<T>(raw[k], values);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int column = chunk * E + e;
        const float tanh_value = SOFTCAP ? tanhf(values[e] * a.inverse_softcap) : 0.0f;
        const float z = SOFTCAP ? a.softcap * tanh_value : values[e];
        float dz = grad * exp2f(z * LOG2_E - lse_log2) - smoothing_grad - (column == target_column ? target_grad : 0.0f);
        if (SOFTCAP) dz *= 1.0f - tanh_value * tanh_value;
        values[e] = column >= a.classes || ignored ? 0.0f : invalid ? NAN : dz;
      }
      *reinterpret_cast<uint4*>(logits + int64_t(chunk) * E) = pack_chunk<T>(values);
    }
  }
}

template <typename T, row_pass PASS, bool SOFTCAP>
__global__ void __launch_bounds__(ROW_THREADS, MIN_BLOCKS_PER_SM) row_kernel(const __grid_constant__ tile_args<T> a) {
  const int64_t row = blockIdx.x;
  if constexpr (PASS == row_pass::loss) {
    loss_row<T, SOFTCAP>(a, row);
  } else {
    gradient_row<T, SOFTCAP>(a, row);
  }
}

}  // namespace tk::linear_cross_entropy
