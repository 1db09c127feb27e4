// Register tiles stored as their lanes' registers ("fragment order"): how a setup launch hands a
// kernel tables it computed once (DFT matrices, twiddle factors, a filter's spectrum) that every
// block then reads straight into registers, destination first:
//
//   store_fragments(table, col_blocks, t, block_row, block_col);
//   load_fragments(t, table, col_blocks, block_row, block_col);
//
// A table is a matrix of base tiles in row-major order, `col_blocks` base tiles per row; base tile
// (r, c) is 32 lanes' packed registers (QUADRANTS pairs each), lane after lane. A tile moves base
// tiles (block_row + br, block_col + bc). A lane's share of a base tile is 16 (16-bit) or 32 (float)
// contiguous bytes, so a warp moves it with coalesced 16-byte accesses and no shuffles, and what
// store_fragments wrote comes back bit for bit through load_fragments of the same layout: no
// coordinate arithmetic on the reading side.
#pragma once

#include "../../types/register_tile.cuh"

namespace tk::warp {
namespace detail {

constexpr int VECTOR_BYTES = 16;

template <register_tile_type Tile>
constexpr int lane_share_bytes = fragment::QUADRANTS * int(sizeof(typename Tile::pair_type));

template <register_tile_type Tile>
__device__ __forceinline__ int64_t base_tile_offset(int col_blocks, int row, int col) {
  return (int64_t(row) * col_blocks + col) * (BASE_TILE * BASE_TILE) +
         lane_id() * (lane_share_bytes<Tile> / int(sizeof(typename Tile::element)));
}

}  // namespace detail

template <register_tile_type Tile>
__device__ __forceinline__ void load_fragments(Tile& dst, const typename Tile::element* table, int col_blocks,
                                               int block_row = 0, int block_col = 0) {
  constexpr int vectors = detail::lane_share_bytes<Tile> / detail::VECTOR_BYTES;
  static_assert(vectors * detail::VECTOR_BYTES == detail::lane_share_bytes<Tile>, "a lane's share is whole 16-byte vectors");
  for_each_base_tile<Tile>([&](int br, int bc) {
    const auto* source = reinterpret_cast<const uint4*>(
        table + detail::base_tile_offset<Tile>(col_blocks, block_row + br, block_col + bc));
    uint4 loaded[vectors];
    // Coherent loads, not __ldg: a table written earlier in the same kernel must read back (the
    // non-coherent path returned stale lines for the test's round trip on the H100).
#pragma unroll
    for (int v = 0; v < vectors; ++v) loaded[v] = source[v];
    __builtin_memcpy(&dst.pairs[br][bc][0], loaded, sizeof(loaded));  // pair types are not trivially copyable
  });
}

template <register_tile_type Tile>
__device__ __forceinline__ void store_fragments(typename Tile::element* table, int col_blocks, const Tile& src,
                                                int block_row = 0, int block_col = 0) {
  constexpr int vectors = detail::lane_share_bytes<Tile> / detail::VECTOR_BYTES;
  static_assert(vectors * detail::VECTOR_BYTES == detail::lane_share_bytes<Tile>, "a lane's share is whole 16-byte vectors");
  for_each_base_tile<Tile>([&](int br, int bc) {
    auto* destination =
        reinterpret_cast<uint4*>(table + detail::base_tile_offset<Tile>(col_blocks, block_row + br, block_col + bc));
    uint4 packed[vectors];
    __builtin_memcpy(packed, &src.pairs[br][bc][0], sizeof(packed));
#pragma unroll
    for (int v = 0; v < vectors; ++v) destination[v] = packed[v];
  });
}

}  // namespace tk::warp
