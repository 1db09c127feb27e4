// The vocabulary every part of the tile core shares: element types, thread-group sizes, indices.
// Knows nothing of torch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "element_type.h"

namespace tk {

using bf16 = __nv_bfloat16;
using half = __half;
using bf16_2 = __nv_bfloat162;
using half_2 = __half2;

constexpr int WARP_THREADS = 32;
constexpr int WARPGROUP_WARPS = 4;
constexpr int WARPGROUP_THREADS = WARP_THREADS * WARPGROUP_WARPS;
constexpr unsigned ALL_LANES = 0xffffffffu;  // the member mask of a whole-warp shuffle or vote
// Register and shared tiles are built from square base tiles of this many rows and columns.
constexpr int BASE_TILE = 16;

__device__ __forceinline__ int lane_id() { return threadIdx.x % WARP_THREADS; }
__device__ __forceinline__ int warp_id() { return threadIdx.x / WARP_THREADS; }
__device__ __forceinline__ int warpgroup_id() { return threadIdx.x / WARPGROUP_THREADS; }
__device__ __forceinline__ int warp_in_warpgroup() { return warp_id() % WARPGROUP_WARPS; }
// The one thread of each warpgroup that issues its TMA copies and bulk reductions and waits for them.
__device__ __forceinline__ bool is_warpgroup_leader() { return threadIdx.x % WARPGROUP_THREADS == 0; }

// Two elements of T packed in one register (the unit of most tensor-core and vector operations).
template <typename T> struct packed_pair;
template <> struct packed_pair<bf16> { using type = bf16_2; };
template <> struct packed_pair<half> { using type = half_2; };
template <> struct packed_pair<float> { using type = float2; };
template <typename T> using packed_pair_t = typename packed_pair<T>::type;

// The 32-bit shared-state-space address of a generic pointer into shared memory, as PTX wants it.
__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// The C++ type of a run-time element_type (for kernels instantiated through tk::dispatch).
template <element_type E>
using element_t = std::conditional_t<E == element_type::bf16, bf16, std::conditional_t<E == element_type::fp16, half, float>>;

// Whole blocks of `block` needed to cover `count` (host and device; integer types only).
template <typename I>
__host__ __device__ constexpr I ceil_div(I count, I block) {
  static_assert(std::is_integral_v<I>, "ceil_div counts in integers");
  return (count + block - 1) / block;
}

// `count` rounded up to a multiple of `multiple`.
template <typename I>
__host__ __device__ constexpr I round_up(I count, I multiple) {
  return ceil_div(count, multiple) * multiple;
}

template <typename T> constexpr bool is_16bit_float = false;
template <> constexpr bool is_16bit_float<bf16> = true;
template <> constexpr bool is_16bit_float<half> = true;

}  // namespace tk
