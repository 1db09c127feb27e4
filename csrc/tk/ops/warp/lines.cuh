// One line of a register tile as a register vector, destination first:
//
//   column(w, k_cols, a);   w[j] = k_cols[j][a]   (w: per_row_vector<decltype(k_cols)>)
//   row(w, t, r);           w[j] = t[r][j]        (w: per_col_vector<decltype(t)>)
//
// The line lives on a few lanes; every lane fetches the entries it keeps by shuffles (one per
// register the vector keeps), so the vector then scales the tile's other lines with
// mul_row / mul_col (e.g. the Taylor feature map's products k_a * k_b). `index` must be the same on
// every lane; it may vary at run time (it selects registers with selects, never by indexing).
#pragma once

#include "maps.cuh"

namespace tk::warp {
namespace detail {

constexpr tile_axis other_axis(tile_axis axis) { return axis == tile_axis::rows ? tile_axis::cols : tile_axis::rows; }

// src's packed pair in quadrant (FIXED half fixed_half, vector half h) of the base tile at
// (FIXED block `block`, vector block vb), chosen among the candidates with selects.
template <tile_axis FIXED, register_tile_type Tile>
__device__ __forceinline__ typename Tile::pair_type line_pair(const Tile& src, int block, int fixed_half, int vb, int h) {
  constexpr int fixed_blocks = FIXED == tile_axis::rows ? Tile::row_blocks : Tile::col_blocks;
  typename Tile::pair_type chosen = src.pairs[0][0][0];
#pragma unroll
  for (int b = 0; b < fixed_blocks; ++b) {
#pragma unroll
    for (int fh = 0; fh < fragment::HALVES; ++fh) {
      const int q = FIXED == tile_axis::rows ? fragment::quadrant(fh, h) : fragment::quadrant(h, fh);
      const auto& candidate = FIXED == tile_axis::rows ? src.pairs[b][vb][q] : src.pairs[vb][b][q];
      if (b == block && fh == fixed_half) chosen = candidate;
    }
  }
  return chosen;
}

template <typename Pair>
__device__ __forceinline__ Pair shuffle_pair(Pair pair, int lane) {
  if constexpr (std::is_same_v<Pair, float2>) {
    return {__shfl_sync(ALL_LANES, pair.x, lane), __shfl_sync(ALL_LANES, pair.y, lane)};
  } else {
    return pair_from_bits<Pair>(__shfl_sync(ALL_LANES, pair_bits(pair), lane));
  }
}

// dst = line `index` of src across the FIXED axis: a row (FIXED == rows) or a column.
template <tile_axis FIXED, register_vector_type V, register_tile_type Tile>
__device__ __forceinline__ void line(V& dst, const Tile& src, int index) {
  constexpr tile_axis along = other_axis(FIXED);
  static_assert(V::length == extent<Tile>(along), "the vector needs one entry per element of the line");
  static_assert(V::layout == fragment::vector_layout_along(Tile::layout, along),
                "the vector must be laid out like the tile's lines: per_col_vector<Tile> for a row, "
                "per_row_vector<Tile> for a column");
  const int block = index / BASE_TILE;
  const int within = index % BASE_TILE;
  const int fixed_half = within / fragment::CORE;
  if constexpr (fragment::pair_axis(Tile::layout) == along) {
    // The line's entries run along the pairs: they sit on the lanes of group `within % CORE`, and
    // this lane needs those of its own thread_in_group, a whole pair at a time.
    const int source = (within % fragment::CORE) * fragment::THREADS_PER_GROUP + fragment::thread_in_group();
    for_each_slot<V>([&](int vb, int s) {
      if (s % fragment::PAIR != 0) return;
      const int h = s / fragment::PAIR;
      const auto pair = shuffle_pair(line_pair<FIXED>(src, block, fixed_half, vb, h), source);
      dst.values[vb][s] = convert<typename V::element>(pair.x);
      dst.values[vb][s + 1] = convert<typename V::element>(pair.y);
    });
  } else {
    // The line crosses the pairs: element within % PAIR of thread (within % CORE) / PAIR of this
    // lane's own group holds this lane's entries.
    const int source = fragment::group_id() * fragment::THREADS_PER_GROUP + (within % fragment::CORE) / fragment::PAIR;
    const bool second = within % fragment::PAIR != 0;
    for_each_slot<V>([&](int vb, int h) {
      const auto pair = shuffle_pair(line_pair<FIXED>(src, block, fixed_half, vb, h), source);
      dst.values[vb][h] = convert<typename V::element>(second ? pair.y : pair.x);
    });
  }
}

}  // namespace detail

template <register_vector_type V, register_tile_type Tile>
__device__ __forceinline__ void row(V& dst, const Tile& src, int index) { detail::line<tile_axis::rows>(dst, src, index); }
template <register_vector_type V, register_tile_type Tile>
__device__ __forceinline__ void column(V& dst, const Tile& src, int index) { detail::line<tile_axis::cols>(dst, src, index); }

}  // namespace tk::warp
