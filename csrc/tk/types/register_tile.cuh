// Register tiles: a ROWS x COLS matrix held by one warp, in the mma fragment layout described in
// register_layout.cuh. The element type, shape and layout are part of the type, so feeding a tile to
// an operation that needs the other layout (mma operands, broadcasts) fails to compile.
//
//   register_tile<bf16, 16, 64>                        Q rows of one warp, mma A operand
//   register_tile<bf16, 64, 64, register_layout::col>  V (K x N), mma B operand
//   register_tile<float, 16, 64>                       an fp32 accumulator
#pragma once

#include "register_layout.cuh"
#include "register_numeric.cuh"
#include "register_vector.cuh"

namespace tk {

template <typename T, int ROWS, int COLS, register_layout LAYOUT = register_layout::row>
struct register_tile {
  static_assert(is_register_element<T>, "register tiles hold float, bf16 or half");
  static_assert(ROWS > 0 && ROWS % BASE_TILE == 0, "a register tile's rows must be a multiple of BASE_TILE");
  static_assert(COLS > 0 && COLS % BASE_TILE == 0, "a register tile's cols must be a multiple of BASE_TILE");

  using element = T;
  using pair_type = packed_pair_t<T>;
  static constexpr int rows = ROWS;
  static constexpr int cols = COLS;
  static constexpr register_layout layout = LAYOUT;
  static constexpr int row_blocks = ROWS / BASE_TILE;
  static constexpr int col_blocks = COLS / BASE_TILE;

  // pairs[row block][col block][quadrant]: this lane's packed pair in each quadrant of each base tile.
  pair_type pairs[row_blocks][col_blocks][fragment::QUADRANTS];
};

template <typename Tile> constexpr bool is_register_tile_v = false;
template <typename T, int R, int C, register_layout L> constexpr bool is_register_tile_v<register_tile<T, R, C, L>> = true;
template <typename Tile> concept register_tile_type = is_register_tile_v<std::remove_cvref_t<Tile>>;

// Calls f(br, bc) for each base tile of a Tile, and f(br, bc, q) for each of its packed registers
// (quadrant q of base tile (br, bc)). The loops unroll fully, so f sees constant indices and the
// registers are never indexed at run time (which would put the tile in local memory).
template <register_tile_type Tile, typename F>
__device__ __forceinline__ void for_each_base_tile(F&& f) {
#pragma unroll
  for (int br = 0; br < Tile::row_blocks; ++br) {
#pragma unroll
    for (int bc = 0; bc < Tile::col_blocks; ++bc) f(br, bc);
  }
}

template <register_tile_type Tile, typename F>
__device__ __forceinline__ void for_each_pair(F&& f) {
  for_each_base_tile<Tile>([&](int br, int bc) {
#pragma unroll
    for (int q = 0; q < fragment::QUADRANTS; ++q) f(br, bc, q);
  });
}

template <register_tile_type Tile>
__host__ __device__ constexpr int extent(tile_axis axis) {
  return axis == tile_axis::rows ? Tile::rows : Tile::cols;
}

// A vector with one entry per row (or column) of Tile, laid out to match it (e.g. row_max's result).
template <register_tile_type Tile, typename T = typename Tile::element>
using per_row_vector =
    register_vector<T, Tile::rows, fragment::vector_layout_along(Tile::layout, tile_axis::rows)>;
template <register_tile_type Tile, typename T = typename Tile::element>
using per_col_vector =
    register_vector<T, Tile::cols, fragment::vector_layout_along(Tile::layout, tile_axis::cols)>;

}  // namespace tk
