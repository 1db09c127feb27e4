// How u's element type meets the tensor cores: the precision policy of the Monarch stages.
//
//   precision<bf16>, precision<half>   the operands are u's type: one mma.sync per real product
//   precision<float>                   every 16-bit operand is carried as bf16 hi + lo (hi = bf16(a),
//                                      lo = bf16(a - hi), tk/ops/warp/split.cuh): the DFT tables,
//                                      the input tile (split on load), the stage-2/4 strip (split
//                                      from the accumulator) and the exchange tile (split on
//                                      store); a product keeps a_lo b_hi + a_hi b_lo + a_hi b_hi,
//                                      three mma.sync per real product, fp32 accumulation
//
// `carried<X>` is X (a 16-bit tile or table) or hi_lo<X>; the verbs below take either, so the stages
// (monarch.cuh) are written once. For 16-bit u each verb is the tile core's own, unchanged.
#pragma once

#include <utility>

#include "tk/tk.cuh"

namespace tk::fftconv {

// A value carried as two parts of the same type, hi + lo.
template <typename Part>
struct hi_lo {
  Part hi;
  Part lo;
};

// A complex table's planes in the workspace (fragment order, ops/warp/fragments.cuh).
template <typename E>
struct complex_table {
  E* re;
  E* im;
};

template <typename U>
struct precision {
  using operand = U;
  static constexpr int parts = 1;
  template <typename X> using carried = X;
};

template <>
struct precision<float> {
  using operand = bf16;
  static constexpr int parts = 2;
  template <typename X> using carried = hi_lo<X>;
};

// ------------------------------------------------------------------ entries (tables, inputs)

// Entry (row, col) of a complex shared tile from float (re, im).
template <complex_shared_tile_type S>
__device__ __forceinline__ void set_entry(S& t, int row, int col, float2 value) {
  t.re.at(row, col) = convert<typename S::element>(value.x);
  t.im.at(row, col) = convert<typename S::element>(value.y);
}
template <complex_shared_tile_type S>
__device__ __forceinline__ void set_entry(hi_lo<S>& t, int row, int col, float2 value) {
  bf16_2 hi, lo;
  split_pair(value, hi, lo);
  t.hi.re.at(row, col) = hi.x;
  t.hi.im.at(row, col) = hi.y;
  t.lo.re.at(row, col) = lo.x;
  t.lo.im.at(row, col) = lo.y;
}

// Quadrant q of a complex base tile from the float pairs of its real and imaginary planes.
template <complex_register_tile_type Tile>
__device__ __forceinline__ void set_quadrant(Tile& t, int q, float2 re, float2 im) {
  using E = typename Tile::element;
  t.re.pairs[0][0][q] = numeric<E>::pair_from_float2(re);
  t.im.pairs[0][0][q] = numeric<E>::pair_from_float2(im);
}
template <complex_register_tile_type Tile>
__device__ __forceinline__ void set_quadrant(hi_lo<Tile>& t, int q, float2 re, float2 im) {
  split_pair(re, t.hi.re.pairs[0][0][q], t.lo.re.pairs[0][0][q]);
  split_pair(im, t.hi.im.pairs[0][0][q], t.lo.im.pairs[0][0][q]);
}

// A 16-byte vector of u's values into plane `part` (0: re, 1: im) of an input tile at (row, col):
// as it is (16-bit u: 8 values), or four floats as 8 bytes of hi and 8 of lo (the chunk stays whole).
template <complex_shared_tile_type S>
__device__ __forceinline__ void store_vector(S& t, int part, int row, int col, uint4 v) {
  auto& plane = part == 0 ? t.re : t.im;
  *reinterpret_cast<uint4*>(&plane.at(row, col)) = v;
}
template <complex_shared_tile_type S>
__device__ __forceinline__ void store_vector(hi_lo<S>& t, int part, int row, int col, uint4 v) {
  float4 values;
  __builtin_memcpy(&values, &v, sizeof(values));
  bf16_2 hi[2], lo[2];
  split_pair({values.x, values.y}, hi[0], lo[0]);
  split_pair({values.z, values.w}, hi[1], lo[1]);
  auto& hi_plane = part == 0 ? t.hi.re : t.hi.im;
  auto& lo_plane = part == 0 ? t.lo.re : t.lo.im;
  *reinterpret_cast<uint2*>(&hi_plane.at(row, col)) = make_uint2(pair_bits(hi[0]), pair_bits(hi[1]));
  *reinterpret_cast<uint2*>(&lo_plane.at(row, col)) = make_uint2(pair_bits(lo[0]), pair_bits(lo[1]));
}

// The 16-byte vector of 16-bit operands at (row, col) of plane `part` (hi's and lo's when split),
// and pair j of its values in float (hi + lo).
template <complex_shared_tile_type S>
__device__ __forceinline__ uint4 load_vector(const S& t, int part, int row, int col) {
  const auto& plane = part == 0 ? t.re : t.im;
  return *reinterpret_cast<const uint4*>(&plane.at(row, col));
}
template <complex_shared_tile_type S>
__device__ __forceinline__ hi_lo<uint4> load_vector(const hi_lo<S>& t, int part, int row, int col) {
  return {load_vector(t.hi, part, row, col), load_vector(t.lo, part, row, col)};
}

template <typename E>
__device__ __forceinline__ float2 vector_pair(const uint4& v, int j) {
  packed_pair_t<E> pairs[sizeof(uint4) / sizeof(packed_pair_t<E>)];
  __builtin_memcpy(pairs, &v, sizeof(v));
  return to_float2(pairs[j]);
}
template <typename E>
__device__ __forceinline__ float2 vector_pair(const hi_lo<uint4>& v, int j) {
  const float2 hi = vector_pair<E>(v.hi, j), lo = vector_pair<E>(v.lo, j);
  return {hi.x + lo.x, hi.y + lo.y};
}

// skip = d * (plane `part` of t)[row0.., col0..] in float.
template <register_tile_type F, complex_shared_tile_type S>
__device__ __forceinline__ void skip_term(F& skip, const S& t, int part, int row0, int col0, float d) {
  register_tile<typename S::element, F::rows, F::cols> values;
  warp::load(values, part == 0 ? t.re : t.im, row0, col0);
  warp::mul(skip, values, d);
}
template <register_tile_type F, complex_shared_tile_type S>
__device__ __forceinline__ void skip_term(F& skip, const hi_lo<S>& t, int part, int row0, int col0, float d) {
  register_tile<typename S::element, F::rows, F::cols> hi, lo;
  warp::load(hi, part == 0 ? t.hi.re : t.hi.im, row0, col0);
  warp::load(lo, part == 0 ? t.lo.re : t.lo.im, row0, col0);
  warp::add(skip, hi, lo);
  warp::mul(skip, skip, d);
}

}  // namespace tk::fftconv

// The warp verbs on carried operands (destination first, as in ops/warp/complex.cuh).
namespace tk::warp {

template <complex_register_tile_type D, typename E>
__device__ __forceinline__ void load_fragments(D& dst, const fftconv::complex_table<E>& table, int col_blocks,
                                               int block_row = 0, int block_col = 0) {
  load_fragments(dst, table.re, table.im, col_blocks, block_row, block_col);
}
template <complex_register_tile_type D, typename E>
__device__ __forceinline__ void load_fragments(fftconv::hi_lo<D>& dst, const fftconv::hi_lo<fftconv::complex_table<E>>& table,
                                               int col_blocks, int block_row = 0, int block_col = 0) {
  load_fragments(dst.hi, table.hi, col_blocks, block_row, block_col);
  load_fragments(dst.lo, table.lo, col_blocks, block_row, block_col);
}

template <typename E, complex_register_tile_type S>
__device__ __forceinline__ void store_fragments(const fftconv::complex_table<E>& table, int col_blocks, const S& src,
                                                int block_row = 0, int block_col = 0) {
  store_fragments(table.re, table.im, col_blocks, src, block_row, block_col);
}
template <typename E, complex_register_tile_type S>
__device__ __forceinline__ void store_fragments(const fftconv::hi_lo<fftconv::complex_table<E>>& table, int col_blocks,
                                                const fftconv::hi_lo<S>& src, int block_row = 0, int block_col = 0) {
  store_fragments(table.hi, col_blocks, src.hi, block_row, block_col);
  store_fragments(table.lo, col_blocks, src.lo, block_row, block_col);
}

// dst = src split into hi and lo (a float accumulator -> a carried operand).
template <complex_register_tile_type D, complex_register_tile_type S>
__device__ __forceinline__ void copy(fftconv::hi_lo<D>& dst, const S& src) {
  split(dst.hi.re, dst.lo.re, src.re);
  split(dst.hi.im, dst.lo.im, src.im);
}

// dst[row0.., col0..] = src split into hi and lo, one base-tile column at a time (few live registers).
template <complex_shared_tile_type D, complex_register_tile_type S>
__device__ __forceinline__ void store(fftconv::hi_lo<D>& dst, const S& src, int row0 = 0, int col0 = 0) {
  [&]<int... BC>(std::integer_sequence<int, BC...>) {
    ([&] {
      complex_register_tile<typename D::element, S::rows, BASE_TILE> hi, lo;
      const auto block = columns<BC * BASE_TILE, BASE_TILE>(src);
      split(hi.re, lo.re, block.re);
      split(hi.im, lo.im, block.im);
      store(dst.hi, hi, row0, col0 + BC * BASE_TILE);
      store(dst.lo, lo, row0, col0 + BC * BASE_TILE);
    }(), ...);
  }(std::make_integer_sequence<int, S::cols / BASE_TILE>{});
}

// d = op(a) · op(b[b_row0.., b_col0..]) + c with both operands split: per base tile of b, its hi
// and lo planes are read once and meet a as a_lo b_hi + a_hi b_lo + a_hi b_hi (the small terms first).
template <bool CONJ_A = false, bool CONJ_B = false, complex_register_tile_type D, complex_register_tile_type A,
          complex_shared_tile_type B, complex_register_tile_type C>
__device__ __forceinline__ void cmma_AB(D& d, const fftconv::hi_lo<A>& a, const fftconv::hi_lo<B>& b, const C& c,
                                        int b_row0, int b_col0) {
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
      base hi, lo;
      load(hi, b.hi, b_row0 + BASE_TILE * kb, b_col0 + BASE_TILE * nb);
      load(lo, b.lo, b_row0 + BASE_TILE * kb, b_col0 + BASE_TILE * nb);
      detail::complex_base_tile_mma<CONJ_A, CONJ_B>(d, nb, a.lo, kb, hi);
      detail::complex_base_tile_mma<CONJ_A, CONJ_B>(d, nb, a.hi, kb, lo);
      detail::complex_base_tile_mma<CONJ_A, CONJ_B>(d, nb, a.hi, kb, hi);
    }
  }
}

// d = a ∘ b (or a ∘ conj(b)) in float, of split operands (each taken as hi + lo).
template <bool CONJ_B = false, complex_register_tile_type D, complex_register_tile_type A, complex_register_tile_type B>
__device__ __forceinline__ void cmul(D& d, const fftconv::hi_lo<A>& a, const fftconv::hi_lo<B>& b) {
  D a_value, b_value;
  add(a_value.re, a.hi.re, a.lo.re);
  add(a_value.im, a.hi.im, a.lo.im);
  add(b_value.re, b.hi.re, b.lo.re);
  add(b_value.im, b.hi.im, b.lo.im);
  cmul<CONJ_B>(d, a_value, b_value);
}

}  // namespace tk::warp
