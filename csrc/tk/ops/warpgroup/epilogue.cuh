// What a warpgroup does with a finished accumulator: add a per-column vector (a bias) and write
// it, converted to 16-bit, into a swizzled shared tile from which TMA stores it.
#pragma once

#include <type_traits>

#include "../../common.cuh"
#include "../../types/shared_tile.cuh"
#include "wgmma.cuh"

namespace tk::warpgroup {

namespace detail {

template <typename T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  if constexpr (std::is_same_v<T, bf16>) {
    const bf16_2 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const half_2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(half x) { return __half2float(x); }

__device__ __forceinline__ void store_matrices(uint32_t address, uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(m0), "r"(m1),
               "r"(m2), "r"(m3)
               : "memory");
}

}  // namespace detail

// acc[:, c] += vector[first_col + c] for every column with first_col + c < limit.
template <int N, typename T>
__device__ __forceinline__ void add_column_vector(accumulator<N>& acc, const T* vector, int first_col, int limit) {
  const int col0 = first_col + accumulator<N>::first_col();
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const int c = col0 + 8 * j;
    const float v0 = c < limit ? detail::to_float(vector[c]) : 0.0f;
    const float v1 = c + 1 < limit ? detail::to_float(vector[c + 1]) : 0.0f;
    acc.data[4 * j + 0] += v0;
    acc.data[4 * j + 1] += v1;
    acc.data[4 * j + 2] += v0;
    acc.data[4 * j + 3] += v1;
  }
}

// dst (64 x Tile::cols) = acc[:, FIRST_COL : FIRST_COL + Tile::cols] converted to Tile::element.
// Each stmatrix.x4 writes a 16 x 16 block: lanes 0-7 address rows 0-7 of the first 8 columns,
// lanes 8-15 rows 8-15, lanes 16-31 the same rows of the next 8 columns; rows of 16 bytes stay
// whole under every swizzle, so the addresses come from Tile::offset.
template <int FIRST_COL, typename Tile, int N>
__device__ __forceinline__ void store(Tile& dst, const accumulator<N>& acc) {
  using T = typename Tile::element;
  static_assert(is_16bit_float<T>, "stmatrix writes 16-bit elements");
  static_assert(Tile::rows == accumulator<N>::rows, "the tile holds the warpgroup's 64 rows");
  static_assert(FIRST_COL % 16 == 0 && Tile::cols % 16 == 0 && FIRST_COL + Tile::cols <= N,
                "whole 16-column blocks of the accumulator");
  const int lane = lane_id();
  const int row = 16 * warp_in_warpgroup() + 8 * ((lane / 8) % 2) + lane % 8;
  const int col_in_block = 8 * (lane / 16);
  const uint32_t base = shared_address(dst.data);
#pragma unroll
  for (int block = 0; block < Tile::cols / 16; ++block) {
    constexpr int first_register = 4 * (FIRST_COL / 8);
    const int r = first_register + 8 * block;
    const float* d = acc.data;
    detail::store_matrices(base + Tile::offset(row, 16 * block + col_in_block),
                           detail::pack<T>(d[r + 0], d[r + 1]), detail::pack<T>(d[r + 2], d[r + 3]),
                           detail::pack<T>(d[r + 4], d[r + 5]), detail::pack<T>(d[r + 6], d[r + 7]));
  }
}

}  // namespace tk::warpgroup
