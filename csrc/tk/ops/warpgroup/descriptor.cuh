// The shared-memory matrix descriptor through which wgmma reads an operand tile.
//
// Fields (PTX ISA, "matrix descriptor format"; byte quantities are stored without their 4 low bits):
//   bits  0..13  start address
//   bits 16..29  leading-dimension byte offset (LBO)
//   bits 32..45  stride-dimension byte offset (SBO)
//   bits 49..51  base offset: 0, since every tile starts on a swizzle period
//   bits 62..63  swizzle: 1 = 128 B, 2 = 64 B, 3 = 32 B
//
// In the panel layout of shared_tile.cuh, an operand is read either
//   K-major  (tile rows = M or N, tile cols = K): 8-row groups are SBO = 8 * span apart; LBO is
//            unused because one k16 step never leaves a swizzle span;
//   MN-major (tile rows = K, tile cols = M or N): 8-row groups along K are SBO = 8 * span apart,
//            and consecutive spans along M/N (the panels) are LBO = panel_bytes apart.
#pragma once

#include <cstdio>

#include "../../common.cuh"
#include "../../types/shared_tile.cuh"

namespace tk::warpgroup {

enum class operand_major { k, mn };

struct matrix_descriptor {
  uint64_t bits;

  __device__ static matrix_descriptor make(uint32_t start_address, uint32_t leading_bytes, uint32_t stride_bytes,
                                           swizzle_mode swizzle) {
    const uint64_t layout = swizzle == swizzle_mode::bytes128 ? 1 : swizzle == swizzle_mode::bytes64 ? 2 : 3;
    return {uint64_t((start_address & 0x3FFFF) >> 4) | (uint64_t((leading_bytes & 0x3FFFF) >> 4) << 16) |
            (uint64_t((stride_bytes & 0x3FFFF) >> 4) << 32) | (layout << 62)};
  }

  __host__ __device__ void print() const {
    printf("matrix_descriptor 0x%016llx: start %u, leading %u B, stride %u B, base offset %u, swizzle code %u\n",
           static_cast<unsigned long long>(bits), unsigned(bits & 0x3FFF) << 4, unsigned((bits >> 16) & 0x3FFF) << 4,
           unsigned((bits >> 32) & 0x3FFF) << 4, unsigned((bits >> 49) & 0x7), unsigned(bits >> 62));
  }
};

// The k16 slice [k0, k0 + 16) of rows/cols [mn0, mn0 + 64 or N) of an operand tile.
template <operand_major MAJOR, typename Tile>
__device__ __forceinline__ matrix_descriptor describe(const Tile& tile, int mn0, int k0) {
  static_assert(is_16bit_float<typename Tile::element>, "wgmma reads 16-bit operands from shared memory here");
  static_assert(Tile::swizzle != swizzle_mode::none, "wgmma operands are swizzled tiles");
  constexpr int element_bytes = int(sizeof(typename Tile::element));
  constexpr uint32_t group_stride = 8 * Tile::swizzle_bytes;  // 8 rows of one span
  const uint32_t base = shared_address(tile.data);
  if constexpr (MAJOR == operand_major::k) {
    const uint32_t start = base + (k0 / Tile::panel_cols) * Tile::panel_bytes + mn0 * Tile::swizzle_bytes +
                           (k0 % Tile::panel_cols) * element_bytes;
    return matrix_descriptor::make(start, 16, group_stride, Tile::swizzle);
  } else {
    const uint32_t start = base + (mn0 / Tile::panel_cols) * Tile::panel_bytes + k0 * Tile::swizzle_bytes +
                           (mn0 % Tile::panel_cols) * element_bytes;
    return matrix_descriptor::make(start, Tile::panel_bytes, group_stride, Tile::swizzle);
  }
}

// The K extent of an operand tile read with the given major-ness.
template <operand_major MAJOR, typename Tile>
constexpr int k_extent() {
  return MAJOR == operand_major::k ? Tile::cols : Tile::rows;
}

}  // namespace tk::warpgroup
