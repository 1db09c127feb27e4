// The row plan of the norm kernels and the pieces the forward and backward share.
//
// A row of `hidden` elements is held in registers by a group of `threads_per_row` threads (a whole
// number of warps); thread `lane` of the group reads accesses lane, lane + threads_per_row, ... of
// the row, each access `elements_per_access` consecutive elements: 16 bytes of x when every row
// and pointer is 16-byte aligned, else one element. A block holds `rows_per_block` such groups.
// How many accesses a thread makes is a compile-time choice per hidden-size bucket (row_access);
// the group size is chosen at run time, so one kernel covers a whole bucket, and accesses past the
// end of the row are predicated off (hidden 1000 uses 125 of the 128 16-byte slots of a warp).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "norms.h"
#include "tk/dispatch.h"
#include "tk/common.cuh"
#include "tk/pipeline/block.cuh"
#include "tk/pipeline/tile_scheduler.cuh"
#include "tk/types/register_numeric.cuh"

namespace tk::norms {

// ------------------------------------------------------------------------------------- the plan

constexpr int VECTOR_BYTES = 16;
// A row group is at most one block; short rows share a block up to this many threads.
constexpr int MAX_BLOCK_THREADS = 256;
constexpr int MAX_THREADS_PER_ROW = MAX_BLOCK_THREADS;
constexpr int MAX_WARPS_PER_BLOCK = MAX_BLOCK_THREADS / WARP_THREADS;
// Blocks per SM each kernel's register budget is sized for (the rows in flight that keep HBM
// busy): the forward holds one packed row per thread, the backward two (h and grad_out) and the
// unpacked floats of one access at a time on top.
constexpr int FORWARD_MIN_BLOCKS_PER_SM = 3;
constexpr int BACKWARD_MIN_BLOCKS_PER_SM = 2;
// Accesses per thread of the unaligned (one element per access) layout.
constexpr int SCALAR_ACCESSES_PER_THREAD = 8;

// The compile-time buckets: 16-byte accesses per thread (1, 2, 4), or single elements.
enum class row_access { vector1, vector2, vector4, scalar };
constexpr row_access VECTOR_BUCKETS[] = {row_access::vector1, row_access::vector2, row_access::vector4};

constexpr int accesses_per_thread(row_access a) {
  return a == row_access::scalar ? SCALAR_ACCESSES_PER_THREAD : a == row_access::vector1 ? 1 : a == row_access::vector2 ? 2 : 4;
}

template <typename T, row_access A>
struct access_shape {
  static constexpr int elements_per_access = A == row_access::scalar ? 1 : VECTOR_BYTES / int(sizeof(T));
  static constexpr int accesses_per_thread = norms::accesses_per_thread(A);
};

struct row_plan {
  row_access access;
  int elements_per_access;
  int accesses_per_row;
  int threads_per_row;  // 0: hidden is too large for any bucket
  int rows_per_block;

  int block_threads() const { return threads_per_row * rows_per_block; }
  int64_t blocks_for(int64_t rows) const { return ceil_div<int64_t>(rows, rows_per_block); }
};

inline bool aligned_rows(const void* data, int64_t row_stride, element_type dtype) {
  return data == nullptr ||
         (reinterpret_cast<uintptr_t>(data) % VECTOR_BYTES == 0 && row_stride * element_bytes(dtype) % VECTOR_BYTES == 0);
}

inline bool aligned_vector(const void* data) {
  return data == nullptr || reinterpret_cast<uintptr_t>(data) % VECTOR_BYTES == 0;
}

// `vectorisable`: hidden is a multiple of the 16-byte access of x and every pointer and row stride
// is 16-byte aligned (fp32 streams then take two 16-byte accesses per access of x). The bucket is
// the smallest whose warp covers the row, else the largest (several warps per row).
inline row_plan plan_rows(int64_t hidden, element_type x_dtype, bool vectorisable) {
  row_plan plan{};
  plan.access = row_access::scalar;
  plan.elements_per_access = 1;
  if (vectorisable) {
    plan.elements_per_access = VECTOR_BYTES / element_bytes(x_dtype);
    for (const row_access bucket : VECTOR_BUCKETS) {
      plan.access = bucket;
      if (hidden / plan.elements_per_access <= WARP_THREADS * accesses_per_thread(bucket)) break;
    }
  }
  const int64_t accesses = ceil_div<int64_t>(hidden, plan.elements_per_access);
  const int64_t threads = round_up<int64_t>(ceil_div<int64_t>(accesses, accesses_per_thread(plan.access)),
                                            WARP_THREADS);  // whole warps
  if (threads > MAX_THREADS_PER_ROW) return plan;
  plan.accesses_per_row = int(accesses);
  plan.threads_per_row = int(threads);
  plan.rows_per_block = MAX_BLOCK_THREADS / plan.threads_per_row;
  return plan;
}

// The largest hidden size the kernels take for x of this dtype: 16-byte aligned rows, or not.
inline int64_t max_hidden(element_type x_dtype, bool vectorisable) {
  return vectorisable ? int64_t(MAX_THREADS_PER_ROW) * accesses_per_thread(row_access::vector4) *
                            (VECTOR_BYTES / element_bytes(x_dtype))
                      : int64_t(MAX_THREADS_PER_ROW) * accesses_per_thread(row_access::scalar);
}

// Dropout (tk_ops/ops/layer_norm.py): keep iff hash(seed, index) >= floor(p * 2^32 + 0.5).
inline uint64_t keep_threshold(double dropout_p) { return uint64_t(std::floor(dropout_p * 4294967296.0 + 0.5)); }
inline float dropout_scale(double dropout_p) { return float(1.0 / (1.0 - dropout_p)); }

// The compiled variants of each kernel: x bf16 or fp16, the residual stream x's dtype or fp32 (the
// flag), every row access. f.template operator()<T, S, A>() runs the variant of the problem.
using x_dtypes = one_of<element_type::bf16, element_type::fp16>;
using row_accesses = one_of<row_access::vector1, row_access::vector2, row_access::vector4, row_access::scalar>;

template <typename F>
auto with_variant(element_type x_dtype, element_type stream_dtype, row_access access, F&& f) {
  return dispatch<x_dtypes, flags, row_accesses>(
      [&]<element_type X, bool FP32_STREAM, row_access A>() {
        using T = element_t<X>;
        return f.template operator()<T, std::conditional_t<FP32_STREAM, float, T>, A>();
      },
      x_dtype, stream_dtype == element_type::fp32, access);
}

// Kernels of one norm kind, instantiated in <kind>_fwd.cu and <kind>_bwd.cu.
template <norm_kind Kind>
cudaError_t launch_forward_of(const forward_problem& p, const row_plan& plan, cudaStream_t stream);
template <norm_kind Kind>
cudaError_t launch_backward_of(const backward_problem& p, const row_plan& plan, cudaStream_t stream);
template <norm_kind Kind>
int64_t backward_blocks_of(const backward_problem& p, const row_plan& plan, int device);

// ------------------------------------------------------------------------------ element access

// v rounded to U (nearest even, as torch's casts do) and read back as a float.
template <typename U>
__device__ __forceinline__ float round_to(float v) { return numeric<U>::to_float(numeric<U>::from_float(v)); }

// N consecutive elements of U, kept as 32-bit words (two 16-bit elements share one register; an
// array of 16-bit values would take a register each) and moved in 16-byte (or narrower) accesses.
template <typename U, int N>
struct alignas(std::min(int(sizeof(U)) * N, VECTOR_BYTES)) pack {
  static constexpr int bytes = int(sizeof(U)) * N;
  using word = std::conditional_t<(bytes >= 4), uint32_t, uint16_t>;
  static constexpr int words = bytes / int(sizeof(word));
  word w[words];
};

template <typename P>
struct pack_chunks {
  static constexpr int chunk_bytes = std::min(int(sizeof(P)), VECTOR_BYTES);
  using chunk = std::conditional_t<chunk_bytes == 16, uint4,
                                   std::conditional_t<chunk_bytes == 8, uint2,
                                                      std::conditional_t<chunk_bytes == 4, uint32_t, uint16_t>>>;
  static constexpr int count = int(sizeof(P)) / chunk_bytes;
  union {
    P value;
    chunk chunks[count];
  };
};

// Read-only data (inputs are never written while a kernel runs): the non-coherent path.
template <typename P>
__device__ __forceinline__ P load_global(const P* p) {
  pack_chunks<P> raw;
  const auto* source = reinterpret_cast<const typename pack_chunks<P>::chunk*>(p);
#pragma unroll
  for (int i = 0; i < pack_chunks<P>::count; ++i) raw.chunks[i] = __ldg(source + i);
  return raw.value;
}

template <typename P>
__device__ __forceinline__ void store_global(P* p, const P& v) {
  pack_chunks<P> raw;
  raw.value = v;
  auto* target = reinterpret_cast<typename pack_chunks<P>::chunk*>(p);
#pragma unroll
  for (int i = 0; i < pack_chunks<P>::count; ++i) target[i] = raw.chunks[i];
}

// Hide a value from the optimiser: what was computed from it before must be computed again after,
// so a row stays in registers in its packed form instead of as the floats derived from it.
__device__ __forceinline__ void launder_word(uint32_t& w) { asm volatile("" : "+r"(w)); }
__device__ __forceinline__ void launder_word(uint16_t& w) { asm volatile("" : "+h"(w)); }

template <typename U, int N, int V>
__device__ __forceinline__ void launder(pack<U, N> (&packs)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
#pragma unroll
    for (int i = 0; i < pack<U, N>::words; ++i) launder_word(packs[j].w[i]);
  }
}

// An offset the optimiser cannot see through: addresses formed from it are computed where they
// are used, not kept live across a row reduction (the base pointer stays a known global one).
__device__ __forceinline__ int64_t launder_offset(int64_t offset) {
  asm volatile("" : "+l"(offset));
  return offset;
}

// Element e of a pack as a float (16-bit element 2i in the low half of word i).
template <typename U, int N>
__device__ __forceinline__ float element(const pack<U, N>& p, int e) {
  if constexpr (std::is_same_v<U, float>) {
    return __uint_as_float(p.w[e]);
  } else {
    const uint16_t bits = N == 1 ? uint16_t(p.w[0]) : uint16_t(e % 2 == 0 ? p.w[e / 2] : p.w[e / 2] >> 16);
    if constexpr (std::is_same_v<U, bf16>) {
      return __uint_as_float(uint32_t(bits) << 16);
    } else {
      return numeric<half>::to_float(__ushort_as_half(bits));
    }
  }
}

template <typename U>
__device__ __forceinline__ uint16_t bits_of(float v) {
  if constexpr (std::is_same_v<U, bf16>) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    return __half_as_ushort(__float2half_rn(v));
  }
}

template <typename U, int N>
__device__ __forceinline__ void unpack(const pack<U, N>& p, float (&out)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) out[e] = element(p, e);
}

// Rounds to U (nearest even, as torch's casts do).
template <typename U, int N>
__device__ __forceinline__ pack<U, N> pack_from(const float (&v)[N]) {
  pack<U, N> p;
  if constexpr (std::is_same_v<U, float>) {
#pragma unroll
    for (int e = 0; e < N; ++e) p.w[e] = __float_as_uint(v[e]);
  } else if constexpr (N == 1) {
    p.w[0] = bits_of<U>(v[0]);
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) p.w[i] = uint32_t(bits_of<U>(v[2 * i])) | (uint32_t(bits_of<U>(v[2 * i + 1])) << 16);
  }
  return p;
}

// A weight or bias slice in its run-time dtype (x's or fp32); ones/zeros when absent.
template <typename T, int N>
__device__ __forceinline__ void load_parameter(const void* data, bool fp32, int offset, float absent,
                                               float (&out)[N]) {
  if (data == nullptr) {
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = absent;
  } else if (fp32) {
    unpack(load_global(reinterpret_cast<const pack<float, N>*>(static_cast<const float*>(data) + offset)), out);
  } else {
    unpack(load_global(reinterpret_cast<const pack<T, N>*>(static_cast<const T*>(data) + offset)), out);
  }
}

// ------------------------------------------------------------------------------- row placement

struct row_slot {
  int threads_per_row;
  int lane;  // within the row's thread group
  int slot;  // row group within the block
  int rows_per_block;

  __device__ __forceinline__ explicit row_slot(int threads) : threads_per_row(threads) {
    lane = int(threadIdx.x) % threads;
    slot = int(threadIdx.x) / threads;
    rows_per_block = int(blockDim.x) / threads;
  }
  // Access j of this thread is access (j * threads_per_row + lane) of the row.
  __device__ __forceinline__ int access(int j) const { return j * threads_per_row + lane; }
};

// Sums K values over the threads of each row group; every thread gets its row's totals, added in
// the same order on every thread. `scratch` holds MAX_WARPS_PER_BLOCK * K floats; a caller that
// reduces again before a barrier passes another buffer (the one barrier here orders reuse).
template <int K>
__device__ __forceinline__ void row_allreduce(float (&v)[K], float* scratch, int threads_per_row) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int offset = WARP_THREADS / 2; offset > 0; offset /= 2) {
      v[k] += __shfl_xor_sync(ALL_LANES, v[k], offset);
    }
  }
  if (threads_per_row == WARP_THREADS) return;  // uniform over the block
  const int warp = int(threadIdx.x) / WARP_THREADS;
  const int warps_per_row = threads_per_row / WARP_THREADS;
  const int first_warp = warp / warps_per_row * warps_per_row;
  if (lane_id() == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) scratch[warp * K + k] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float total = 0.f;
    for (int w = 0; w < warps_per_row; ++w) total += scratch[(first_warp + w) * K + k];
    v[k] = total;
  }
}

// --------------------------------------------------------------------------------------- dropout

constexpr uint32_t MIX_MULTIPLIER_1 = 0x7FEB352Du;
constexpr uint32_t MIX_MULTIPLIER_2 = 0x846CA68Bu;
constexpr uint32_t SEED_SALT = 0x9E3779B9u;

__device__ __forceinline__ uint32_t mix32(uint32_t v) {
  v ^= v >> 16;
  v *= MIX_MULTIPLIER_1;
  v ^= v >> 15;
  v *= MIX_MULTIPLIER_2;
  return v ^ (v >> 16);
}

struct dropout_mask {
  uint32_t key_a = 0;
  uint32_t key_b = 0;
  uint64_t threshold = 0;

  dropout_mask() = default;
  __device__ __forceinline__ dropout_mask(const int64_t* seed, uint64_t keep_threshold) : threshold(keep_threshold) {
    const uint64_t bits = static_cast<uint64_t>(__ldg(seed));
    key_a = mix32(uint32_t(bits) ^ SEED_SALT);
    key_b = mix32(uint32_t(bits >> 32) ^ key_a);
  }
  // `index`: the element's row-major index over the logical (rows, hidden) layout.
  __device__ __forceinline__ bool keep(uint64_t index) const {
    const uint32_t hash = mix32(mix32(uint32_t(index) ^ key_b) ^ uint32_t(index >> 32) ^ key_a);
    return uint64_t(hash) >= threshold;
  }
};

}  // namespace tk::norms
