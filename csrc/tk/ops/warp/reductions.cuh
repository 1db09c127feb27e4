// Row and column reductions of a register tile into a register vector, destination first:
//
//   row_max(m, s);          m[i] = max_j s[i][j]            (m: per_row_vector<decltype(s)>)
//   row_max(m, s, m_prev);  m[i] = max(m_prev[i], max_j s[i][j])
//   row_sum(l, p);  row_min(m, s);  col_sum(c, t);  col_max(c, t);
//
//   lane_row_sum(l, p, l);  ...  all_lanes_row_sum(l);   a running sum kept per lane and combined
//                                                        across lanes once, at the end
//   total = across_warp<op::add>(value);                 one float per lane (any Op of maps.cuh)
//   if (any_of<Pred>(a, b)) ...                          whether Pred(a[i], b[i]) holds for some
//                                                        entry on some lane: a warp vote, so the
//                                                        branch is uniform
//
// Each lane first reduces the elements it holds, in float, then the lanes that hold the rest of the
// same lines exchange partial results by shuffles: the 4 threads of a group when the reduced axis
// runs along the pairs, the 8 groups otherwise. Every lane ends with the full result.
#pragma once

#include "maps.cuh"

namespace tk::warp {
namespace detail {

// The lanes whose xor-distances span the axis a vector of layout L reduces: the threads of a group
// when the reduced axis runs along the pairs, the groups otherwise.
template <vector_layout L>
constexpr int FIRST_LANE_MASK = L == vector_layout::group ? 1 : fragment::THREADS_PER_GROUP;
template <vector_layout L>
constexpr int LANE_MASK_END = L == vector_layout::group ? fragment::THREADS_PER_GROUP : WARP_THREADS;

template <typename Op, vector_layout L>
__device__ __forceinline__ float across_lanes(float value) {
#pragma unroll
  for (int mask = FIRST_LANE_MASK<L>; mask < LANE_MASK_END<L>; mask *= 2) {
    value = Op::apply(value, __shfl_xor_sync(ALL_LANES, value, mask));
  }
  return value;
}

// dst[i] = Op over line i (a row when KEPT == rows) of src, combined with init[i] when given; with
// ACROSS_LANES false, over this lane's elements only.
template <typename Op, tile_axis KEPT, bool ACROSS_LANES, register_vector_type V, register_tile_type Tile, typename... Init>
__device__ __forceinline__ void reduce(V& dst, const Tile& src, const Init&... init) {
  static_assert(V::length == extent<Tile>(KEPT), "a reduction's vector needs one entry per row (per column) of the tile");
  static_assert(V::layout == fragment::vector_layout_along(Tile::layout, KEPT),
                "a reduction's vector must be laid out like the tile's lines: declare it as "
                "per_row_vector<Tile> (row_*) or per_col_vector<Tile> (col_*)");
  static_assert(sizeof...(Init) <= 1 && (std::is_same_v<Init, V> && ...), "the initial value is one vector like dst");
  float partial[V::blocks][V::slots];
  for_each_slot<V>([&](int b, int s) { partial[b][s] = Op::identity; });
  for_each_pair<Tile>([&](int br, int bc, int q) {
    const float2 pair = to_float2(src.pairs[br][bc][q]);
    const int block = KEPT == tile_axis::rows ? br : bc;
    const int half = fragment::half_along(KEPT, q);
#pragma unroll
    for (int e = 0; e < fragment::PAIR; ++e) {
      float& slot = partial[block][fragment::vector_slot(V::layout, half, e)];
      slot = Op::apply(slot, e == 0 ? pair.x : pair.y);
    }
  });
  for_each_slot<V>([&](int b, int s) {
    float value = partial[b][s];
    if constexpr (ACROSS_LANES) value = across_lanes<Op, V::layout>(value);
    ((value = Op::apply(value, numeric<typename V::element>::to_float(init.values[b][s]))), ...);
    dst.values[b][s] = numeric<typename V::element>::from_float(value);
  });
}

}  // namespace detail

template <register_vector_type V, register_tile_type T, typename... Init>
__device__ __forceinline__ void row_max(V& dst, const T& src, const Init&... init) { detail::reduce<op::max, tile_axis::rows, true>(dst, src, init...); }
template <register_vector_type V, register_tile_type T, typename... Init>
__device__ __forceinline__ void row_min(V& dst, const T& src, const Init&... init) { detail::reduce<op::min, tile_axis::rows, true>(dst, src, init...); }
template <register_vector_type V, register_tile_type T, typename... Init>
__device__ __forceinline__ void row_sum(V& dst, const T& src, const Init&... init) { detail::reduce<op::add, tile_axis::rows, true>(dst, src, init...); }
template <register_vector_type V, register_tile_type T, typename... Init>
__device__ __forceinline__ void col_max(V& dst, const T& src, const Init&... init) { detail::reduce<op::max, tile_axis::cols, true>(dst, src, init...); }
template <register_vector_type V, register_tile_type T, typename... Init>
__device__ __forceinline__ void col_sum(V& dst, const T& src, const Init&... init) { detail::reduce<op::add, tile_axis::cols, true>(dst, src, init...); }

// This lane's share of each row sum, plus init, which is itself such a share (an earlier
// lane_row_sum): no shuffles, so a running sum over many tiles pays for the exchange once. The
// result is not a valid row vector until all_lanes_row_sum combines the lanes' shares.
template <register_vector_type V, register_tile_type T, typename... Init>
__device__ __forceinline__ void lane_row_sum(V& dst, const T& src, const Init&... init) { detail::reduce<op::add, tile_axis::rows, false>(dst, src, init...); }

// Op over one float per lane, every lane getting the result: xor shuffles at distances 1, 2, ...,
// 16, so every lane combines the same values in the same order (bitwise equal results).
template <typename Op>
__device__ __forceinline__ float across_warp(float value) {
#pragma unroll
  for (int mask = 1; mask < WARP_THREADS; mask *= 2) value = Op::apply(value, __shfl_xor_sync(ALL_LANES, value, mask));
  return value;
}

// Whether Pred::apply(v[i], x[i]...) (a bool on floats) holds for some entry i of some lane; every
// lane gets the same answer (one vote).
template <typename Pred, register_vector_type V, typename... X>
__device__ __forceinline__ bool any_of(const V& v, const X&... x) {
  bool holds = false;
  for_each_slot<V>([&](int b, int s) {
    holds |= Pred::apply(detail::vector_operand<V>(v, b, s), detail::vector_operand<V>(x, b, s)...);
  });
  return __any_sync(ALL_LANES, holds);
}

template <register_vector_type V>
__device__ __forceinline__ void all_lanes_row_sum(V& partial) {
  for_each_slot<V>([&](int b, int s) {
    using E = typename V::element;
    partial.values[b][s] = numeric<E>::from_float(
        detail::across_lanes<op::add, V::layout>(numeric<E>::to_float(partial.values[b][s])));
  });
}

}  // namespace tk::warp
