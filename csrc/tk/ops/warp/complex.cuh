// Verbs on complex tiles (types/complex_tile.cuh), destination first:
//
//   cmma_AB(d, a, b, c);                     d = a · b + c        a: M x K row, b: K x N col registers
//   cmma_AB(d, a, b_smem, c, row0, col0);    the same with b = b_smem[row0 : row0 + K, col0 : col0 + N]
//   cmma_AB<CONJ_A, CONJ_B>(...)             conj(a) and/or conj(b) in place of a, b
//   cmul<CONJ_B>(d, a, b);                   d = a ∘ b (or a ∘ conj(b)) elementwise, in float
//   copy, zero, mul (by a real scalar), load, store, load_fragments, columns, set_columns:
//                                            the real verbs on both planes
//
// A complex product is four real mma.sync products of the planes,
//   re(a b) = ar br - ai bi,   im(a b) = ar bi + ai br,
// the signs of conjugation and of the minus folded into a negated copy of a B plane (a sign-bit
// flip of each packed 16-bit pair: exact, 4 instructions per base tile). The 3-product (Gauss)
// form would save a quarter of the products but needs a third fp32 accumulator per product (32
// more registers at N = 64), a 16-bit rounding of (ar + ai) and of (br + bi), and takes im as a
// difference of products that may cancel: more registers and a looser error for a tensor core
// that, in the FFT convolution, shares the time with the elementwise stages.
//
// The shared-B form streams b through registers one base tile at a time (8 registers), so the
// operand a (M x K) and the accumulator d (M x N) are the only tiles kept live.
#pragma once

#include "../../types/complex_tile.cuh"
#include "fragments.cuh"
#include "layout.cuh"
#include "maps.cuh"
#include "mma.cuh"
#include "shared_memory.cuh"

namespace tk::warp {
namespace detail {

constexpr uint32_t PAIR_SIGN_BITS = 0x80008000u;  // the sign bits of both halves of a 16-bit pair

template <register_tile_type Tile>
__device__ __forceinline__ Tile negated(const Tile& src) {
  static_assert(is_16bit_float<typename Tile::element>, "negated flips the sign bits of 16-bit pairs");
  Tile dst;
  for_each_pair<Tile>([&](int br, int bc, int q) {
    dst.pairs[br][bc][q] = pair_from_bits<typename Tile::pair_type>(pair_bits(src.pairs[br][bc][q]) ^ PAIR_SIGN_BITS);
  });
  return dst;
}

// d's base tile (mb, nb) += a's base tile (mb, kb) · b (one 16 x 16 col-layout base tile).
template <register_tile_type D, register_tile_type A, register_tile_type B>
__device__ __forceinline__ void base_tile_mma(D& d, int mb, int nb, const A& a, int kb, const B& b) {
#pragma unroll
  for (int n_half = 0; n_half < fragment::HALVES; ++n_half) {
    float2& top = d.pairs[mb][nb][fragment::quadrant(0, n_half)];
    float2& bottom = d.pairs[mb][nb][fragment::quadrant(1, n_half)];
    float acc[MMA_ACCUMULATORS] = {top.x, top.y, bottom.x, bottom.y};
    uint32_t a_regs[MMA_A_REGISTERS];
#pragma unroll
    for (int q = 0; q < MMA_A_REGISTERS; ++q) a_regs[q] = pair_bits(a.pairs[mb][kb][q]);
    uint32_t b_regs[MMA_B_REGISTERS];
#pragma unroll
    for (int k_half = 0; k_half < MMA_B_REGISTERS; ++k_half) {
      b_regs[k_half] = pair_bits(b.pairs[0][0][fragment::quadrant(k_half, n_half)]);
    }
    mma_m16n8k16<typename A::element>(acc, a_regs, b_regs);
    top = {acc[0], acc[1]};
    bottom = {acc[2], acc[3]};
  }
}

// d[:, block nb] += op(a)[:, block kb] · op(b) for one complex 16 x 16 base tile b:
//   (ar + i sa ai)(br + i sb bi) = ar br + ai (-sa sb bi) + i (ar (sb bi) + ai (sa br)).
template <bool CONJ_A, bool CONJ_B, complex_register_tile_type D, complex_register_tile_type A, typename B>
__device__ __forceinline__ void complex_base_tile_mma(D& d, int nb, const A& a, int kb, const B& b) {
  using plane = typename B::plane;
  const plane& re_partner = CONJ_A != CONJ_B ? b.im : negated(b.im);  // -sa sb bi
  const plane& im_partner = CONJ_B ? negated(b.im) : b.im;            // sb bi
  const plane& re_of_im = CONJ_A ? negated(b.re) : b.re;              // sa br
#pragma unroll
  for (int mb = 0; mb < D::plane::row_blocks; ++mb) {
    base_tile_mma(d.re, mb, nb, a.re, kb, b.re);
    base_tile_mma(d.re, mb, nb, a.im, kb, re_partner);
    base_tile_mma(d.im, mb, nb, a.re, kb, im_partner);
    base_tile_mma(d.im, mb, nb, a.im, kb, re_of_im);
  }
}

template <complex_register_tile_type D, complex_register_tile_type A>
__device__ __forceinline__ void check_complex_mma() {
  static_assert(A::layout == register_layout::row && is_16bit_float<typename A::element>,
                "cmma: a is a 16-bit row-layout M x K complex tile");
  static_assert(std::is_same_v<typename D::element, float> && D::layout == register_layout::row,
                "cmma: the accumulator is a float row-layout complex tile");
  static_assert(D::rows == A::rows, "cmma: a and d have the same rows");
}

}  // namespace detail

template <complex_register_tile_type D, complex_register_tile_type S>
__device__ __forceinline__ void copy(D& dst, const S& src) {
  copy(dst.re, src.re);
  copy(dst.im, src.im);
}

template <complex_register_tile_type D>
__device__ __forceinline__ void zero(D& dst) {
  zero(dst.re);
  zero(dst.im);
}

// dst = src * scale (a real scalar).
template <complex_register_tile_type D, complex_register_tile_type S>
__device__ __forceinline__ void mul(D& dst, const S& src, float scale) {
  mul(dst.re, src.re, scale);
  mul(dst.im, src.im, scale);
}

template <bool CONJ_A = false, bool CONJ_B = false, complex_register_tile_type D, complex_register_tile_type A,
          complex_register_tile_type B, complex_register_tile_type C>
__device__ __forceinline__ void cmma_AB(D& d, const A& a, const B& b, const C& c) {
  detail::check_complex_mma<D, A>();
  static_assert(B::layout == register_layout::col && std::is_same_v<typename A::element, typename B::element>,
                "cmma_AB: b is a K x N col-layout complex tile of a's element type");
  static_assert(A::cols == B::rows && D::cols == B::cols, "cmma_AB: a is M x K, b K x N, d M x N");
  static_assert(std::is_same_v<D, C>, "cmma_AB: d and c have the same type");
  d = c;
  using base = complex_register_tile<typename B::element, BASE_TILE, BASE_TILE, register_layout::col>;
#pragma unroll
  for (int kb = 0; kb < B::plane::row_blocks; ++kb) {
#pragma unroll
    for (int nb = 0; nb < B::plane::col_blocks; ++nb) {
      base b_tile;
#pragma unroll
      for (int q = 0; q < fragment::QUADRANTS; ++q) {
        b_tile.re.pairs[0][0][q] = b.re.pairs[kb][nb][q];
        b_tile.im.pairs[0][0][q] = b.im.pairs[kb][nb][q];
      }
      detail::complex_base_tile_mma<CONJ_A, CONJ_B>(d, nb, a, kb, b_tile);
    }
  }
}

template <bool CONJ_A = false, bool CONJ_B = false, complex_register_tile_type D, complex_register_tile_type A,
          complex_shared_tile_type B, complex_register_tile_type C>
__device__ __forceinline__ void cmma_AB(D& d, const A& a, const B& b, const C& c, int b_row0, int b_col0) {
  detail::check_complex_mma<D, A>();
  static_assert(std::is_same_v<typename A::element, typename B::element>, "cmma_AB: b holds a's element type");
  static_assert(A::cols <= B::rows && D::cols <= B::cols, "cmma_AB: the K x N window must fit in b");
  static_assert(std::is_same_v<D, C>, "cmma_AB: d and c have the same type");
  d = c;
  using base = complex_register_tile<typename B::element, BASE_TILE, BASE_TILE, register_layout::col>;
#pragma unroll
  for (int kb = 0; kb < A::plane::col_blocks; ++kb) {
#pragma unroll
    for (int nb = 0; nb < D::plane::col_blocks; ++nb) {
      base b_tile;
      load(b_tile.re, b.re, b_row0 + BASE_TILE * kb, b_col0 + BASE_TILE * nb);
      load(b_tile.im, b.im, b_row0 + BASE_TILE * kb, b_col0 + BASE_TILE * nb);
      detail::complex_base_tile_mma<CONJ_A, CONJ_B>(d, nb, a, kb, b_tile);
    }
  }
}

// d = a ∘ b, or a ∘ conj(b), element by element in float (d may alias a or b).
template <bool CONJ_B = false, complex_register_tile_type D, complex_register_tile_type A, complex_register_tile_type B>
__device__ __forceinline__ void cmul(D& d, const A& a, const B& b) {
  static_assert(D::rows == A::rows && D::cols == A::cols && D::layout == A::layout && A::rows == B::rows &&
                    A::cols == B::cols && A::layout == B::layout,
                "cmul: the operands have the destination's shape and layout");
  constexpr float b_im_sign = CONJ_B ? -1.0f : 1.0f;
  for_each_pair<typename D::plane>([&](int br, int bc, int q) {
    const float2 ar = to_float2(a.re.pairs[br][bc][q]), ai = to_float2(a.im.pairs[br][bc][q]);
    const float2 xr = to_float2(b.re.pairs[br][bc][q]), xi = to_float2(b.im.pairs[br][bc][q]);
    const float2 bi = {b_im_sign * xi.x, b_im_sign * xi.y};
    using E = typename D::element;
    d.re.pairs[br][bc][q] = numeric<E>::pair_from_float2({ar.x * xr.x - ai.x * bi.x, ar.y * xr.y - ai.y * bi.y});
    d.im.pairs[br][bc][q] = numeric<E>::pair_from_float2({ar.x * bi.x + ai.x * xr.x, ar.y * bi.y + ai.y * xr.y});
  });
}

template <complex_register_tile_type D, complex_shared_tile_type S>
__device__ __forceinline__ void load(D& dst, const S& src, int row0 = 0, int col0 = 0) {
  load(dst.re, src.re, row0, col0);
  load(dst.im, src.im, row0, col0);
}

template <complex_shared_tile_type S, complex_register_tile_type T>
__device__ __forceinline__ void store(S& dst, const T& src, int row0 = 0, int col0 = 0) {
  store(dst.re, src.re, row0, col0);
  store(dst.im, src.im, row0, col0);
}

// A complex table is two fragment-order tables (fragments.cuh) of the same shape, one per plane.
template <complex_register_tile_type Tile>
__device__ __forceinline__ void load_fragments(Tile& dst, const typename Tile::element* table_re,
                                               const typename Tile::element* table_im, int col_blocks,
                                               int block_row = 0, int block_col = 0) {
  load_fragments(dst.re, table_re, col_blocks, block_row, block_col);
  load_fragments(dst.im, table_im, col_blocks, block_row, block_col);
}

template <complex_register_tile_type Tile>
__device__ __forceinline__ void store_fragments(typename Tile::element* table_re, typename Tile::element* table_im,
                                                int col_blocks, const Tile& src, int block_row = 0, int block_col = 0) {
  store_fragments(table_re, col_blocks, src.re, block_row, block_col);
  store_fragments(table_im, col_blocks, src.im, block_row, block_col);
}

template <int FIRST_COL, int COLS, complex_register_tile_type S>
__device__ __forceinline__ complex_register_tile<typename S::element, S::rows, COLS, S::layout> columns(const S& src) {
  return {columns<FIRST_COL, COLS>(src.re), columns<FIRST_COL, COLS>(src.im)};
}

template <int FIRST_COL, complex_register_tile_type D, complex_register_tile_type S>
__device__ __forceinline__ void set_columns(D& dst, const S& src) {
  set_columns<FIRST_COL>(dst.re, src.re);
  set_columns<FIRST_COL>(dst.im, src.im);
}

}  // namespace tk::warp
