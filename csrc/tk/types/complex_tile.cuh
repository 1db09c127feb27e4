// Complex tiles: a pair of real tiles of one type, the real part and the imaginary part ("planes").
//
//   complex_register_tile<bf16, 16, 64>                         a DFT operand (mma A)
//   complex_register_tile<float, 16, 64>                        its fp32 accumulator
//   complex_shared_tile<bf16, 64, 64>                           a DFT matrix as mma B reads it
//
// Keeping the planes apart (rather than interleaving re/im in a pair) lets every real verb (load,
// store, copy, mma) work on each plane unchanged: a complex product is four real products of
// the planes (ops/warp/complex.cuh).
#pragma once

#include "register_tile.cuh"
#include "shared_tile.cuh"

namespace tk {

template <typename T, int ROWS, int COLS, register_layout LAYOUT = register_layout::row>
struct complex_register_tile {
  using plane = register_tile<T, ROWS, COLS, LAYOUT>;
  using element = T;
  static constexpr int rows = ROWS;
  static constexpr int cols = COLS;
  static constexpr register_layout layout = LAYOUT;

  plane re;
  plane im;
};

template <typename T, int ROWS, int COLS>
struct complex_shared_tile {
  using plane = shared_tile<T, ROWS, COLS>;
  using element = T;
  static constexpr int rows = ROWS;
  static constexpr int cols = COLS;
  static constexpr int bytes = 2 * plane::bytes;

  plane re;  // each plane keeps shared_tile's alignment to a swizzle period
  plane im;
};

template <typename Tile> constexpr bool is_complex_register_tile_v = false;
template <typename T, int R, int C, register_layout L>
constexpr bool is_complex_register_tile_v<complex_register_tile<T, R, C, L>> = true;
template <typename Tile> concept complex_register_tile_type = is_complex_register_tile_v<std::remove_cvref_t<Tile>>;

template <typename Tile> constexpr bool is_complex_shared_tile_v = false;
template <typename T, int R, int C> constexpr bool is_complex_shared_tile_v<complex_shared_tile<T, R, C>> = true;
template <typename Tile> concept complex_shared_tile_type = is_complex_shared_tile_v<std::remove_cvref_t<Tile>>;

}  // namespace tk
