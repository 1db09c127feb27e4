// Masks on register tiles: elements outside a region become a value (-inf before a softmax, 0 in a
// probability tile), destination first:
//
//   mask(s, origin, [&](int row, int col) { return col < n_keys; }, -INFINITY);   keep where true
//   tril(s, origin, diagonal, -INFINITY);      keep col <= row + diagonal (a causal mask)
//
// `origin` is where the tile's element (0, 0) sits in the caller's coordinates (e.g. a warp's first
// query row and a block's first key), so predicates see the problem's own rows and columns and a
// tile never needs to know which block it is.
#pragma once

#include "maps.cuh"

namespace tk::warp {

template <register_tile_type Tile, typename Keep>
__device__ __forceinline__ void mask(Tile& tile, fragment::coord origin, Keep&& keep, float value) {
  using T = typename Tile::element;
  const T masked = numeric<T>::from_float(value);
  for_each_pair<Tile>([&](int br, int bc, int q) {
#pragma unroll
    for (int e = 0; e < fragment::PAIR; ++e) {
      const fragment::coord at = fragment::pair_element_coord<Tile::layout>(q, e);
      auto& pair = tile.pairs[br][bc][q];
      if (!keep(origin.row + BASE_TILE * br + at.row, origin.col + BASE_TILE * bc + at.col)) {
        (e == 0 ? pair.x : pair.y) = masked;
      }
    }
  });
}

template <register_tile_type Tile>
__device__ __forceinline__ void tril(Tile& tile, fragment::coord origin, int diagonal, float value) {
  mask(tile, origin, [diagonal](int row, int col) { return col <= row + diagonal; }, value);
}

}  // namespace tk::warp
