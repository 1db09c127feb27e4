// Changing a register tile's layout:
//
//   transpose(t_T, t);     t_T (C x R, other layout) = tᵀ: no data moves, the registers are relabelled
//   swap_layout(t_c, t);   t_c (R x C, other layout) = t: one movmatrix per core matrix (16-bit types)
//   columns<C0, C>(t)      the R x C tile of t's columns [C0, C0 + C): a copy the compiler resolves
//                          to t's own registers (whole base tiles only)
//   set_columns<C0>(t, s)  t's columns [C0, C0 + s.cols) = s (whole base tiles), e.g. one k16 block
//                          of an operand assembled from parts
#pragma once

#include "maps.cuh"

namespace tk::warp {

template <register_tile_type D, register_tile_type S>
__device__ __forceinline__ void transpose(D& dst, const S& src) {
  static_assert(D::rows == S::cols && D::cols == S::rows, "transpose: dst must be (src cols) x (src rows)");
  static_assert(D::layout != S::layout,
                "transpose: dst must have the other layout (a row-layout tile's registers are its transpose's "
                "col-layout registers)");
  for_each_pair<S>([&](int br, int bc, int q) {
    dst.pairs[bc][br][fragment::transposed(q)] = convert_pair<typename D::pair_type>(src.pairs[br][bc][q]);
  });
}

namespace detail {

// Transposes how one 8 x 8 core matrix of 16-bit elements is spread over the warp.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t pair) {
  uint32_t moved;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(moved) : "r"(pair));
  return moved;
}

}  // namespace detail

template <register_tile_type D, register_tile_type S>
__device__ __forceinline__ void swap_layout(D& dst, const S& src) {
  static_assert(D::rows == S::rows && D::cols == S::cols, "swap_layout: dst must have src's shape");
  static_assert(D::layout != S::layout, "swap_layout: dst must have the other layout");
  static_assert(std::is_same_v<typename D::element, typename S::element> && is_16bit_float<typename S::element>,
                "swap_layout moves 16-bit tiles (movmatrix); copy a float tile to bf16/half first");
  for_each_pair<S>([&](int br, int bc, int q) {
    const uint32_t moved = detail::movmatrix_trans(pair_bits(src.pairs[br][bc][q]));
    dst.pairs[br][bc][q] = pair_from_bits<typename D::pair_type>(moved);
  });
}

template <int FIRST_COL, int COLS, register_tile_type S>
__device__ __forceinline__ register_tile<typename S::element, S::rows, COLS, S::layout> columns(const S& src) {
  static_assert(FIRST_COL % BASE_TILE == 0 && COLS % BASE_TILE == 0 && FIRST_COL + COLS <= S::cols,
                "columns: whole base tiles inside the source");
  register_tile<typename S::element, S::rows, COLS, S::layout> dst;
  for_each_pair<decltype(dst)>([&](int br, int bc, int q) { dst.pairs[br][bc][q] = src.pairs[br][FIRST_COL / BASE_TILE + bc][q]; });
  return dst;
}

template <int FIRST_COL, register_tile_type D, register_tile_type S>
__device__ __forceinline__ void set_columns(D& dst, const S& src) {
  static_assert(FIRST_COL % BASE_TILE == 0 && FIRST_COL + S::cols <= D::cols && S::rows == D::rows && S::layout == D::layout,
                "set_columns: whole base tiles of the destination's rows and layout");
  for_each_pair<S>([&](int br, int bc, int q) {
    dst.pairs[br][FIRST_COL / BASE_TILE + bc][q] = convert_pair<typename D::pair_type>(src.pairs[br][bc][q]);
  });
}

}  // namespace tk::warp
