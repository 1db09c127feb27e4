// Row and column reductions of a register tile into a register vector, destination first:
//
//   row_max(m, s);          m[i] = max_j s[i][j]            (m: per_row_vector<decltype(s)>)
//   row_max(m, s, m_prev);  m[i] = max(m_prev[i], max_j s[i][j])
//   row_sum(l, p);  col_sum(c, t);  col_max(c, t);
//
// Each lane first reduces the elements it holds, in float, then the lanes that hold the rest of the
// same lines exchange partial results by shuffles: the 4 threads of a group when the reduced axis
// runs along the pairs, the 8 groups otherwise. Every lane ends with the full result.
#pragma once

#include "maps.cuh"

namespace tk::warp {
namespace detail {

constexpr unsigned ALL_LANES = 0xffffffffu;

// dst[i] = Op over line i (a row when KEPT == rows) of src, combined with init[i] when given.
template <typename Op, tile_axis KEPT, register_vector_type V, register_tile_type Tile, typename... Init>
__device__ __forceinline__ void reduce(V& dst, const Tile& src, const Init&... init) {
  static_assert(V::length == extent<Tile>(KEPT), "a reduction's vector needs one entry per row (per column) of the tile");
  static_assert(V::layout == fragment::vector_layout_along(Tile::layout, KEPT),
                "a reduction's vector must be laid out like the tile's lines: declare it as "
                "per_row_vector<Tile> (row_*) or per_col_vector<Tile> (col_*)");
  static_assert(sizeof...(Init) <= 1 && (std::is_same_v<Init, V> && ...), "the initial value is one vector like dst");
  // The lanes whose xor-distance spans the reduced axis: threadID_in_group bits or groupID bits.
  constexpr bool along_pairs = V::layout == vector_layout::group;
  constexpr int first_lane_mask = along_pairs ? 1 : fragment::THREADS_PER_GROUP;
  constexpr int lane_mask_end = along_pairs ? fragment::THREADS_PER_GROUP : WARP_THREADS;

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
#pragma unroll
    for (int mask = first_lane_mask; mask < lane_mask_end; mask *= 2) {
      value = Op::apply(value, __shfl_xor_sync(ALL_LANES, value, mask));
    }
    ((value = Op::apply(value, numeric<typename V::element>::to_float(init.values[b][s]))), ...);
    dst.values[b][s] = numeric<typename V::element>::from_float(value);
  });
}

}  // namespace detail

template <register_vector_type V, register_tile_type T, typename... Init>
__device__ __forceinline__ void row_max(V& dst, const T& src, const Init&... init) { detail::reduce<op::max, tile_axis::rows>(dst, src, init...); }
template <register_vector_type V, register_tile_type T, typename... Init>
__device__ __forceinline__ void row_sum(V& dst, const T& src, const Init&... init) { detail::reduce<op::add, tile_axis::rows>(dst, src, init...); }
template <register_vector_type V, register_tile_type T, typename... Init>
__device__ __forceinline__ void col_max(V& dst, const T& src, const Init&... init) { detail::reduce<op::max, tile_axis::cols>(dst, src, init...); }
template <register_vector_type V, register_tile_type T, typename... Init>
__device__ __forceinline__ void col_sum(V& dst, const T& src, const Init&... init) { detail::reduce<op::add, tile_axis::cols>(dst, src, init...); }

}  // namespace tk::warp
