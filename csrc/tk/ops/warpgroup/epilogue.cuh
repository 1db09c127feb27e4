// What a warpgroup does with a finished accumulator: write it, converted to 16-bit, into a swizzled
// shared tile from which TMA stores it.
#pragma once

#include "../../common.cuh"
#include "../../types/shared_tile.cuh"
#include "../warp/layout.cuh"
#include "../warp/shared_memory.cuh"
#include "wgmma.cuh"

namespace tk::warpgroup {

// dst (64 x Tile::cols) = acc[:, FIRST_COL : FIRST_COL + Tile::cols], converted to Tile::element:
// each warp writes its 16 rows (stmatrix, through warp::store).
template <int FIRST_COL, typename Tile, int N>
__device__ __forceinline__ void store(Tile& dst, const accumulator<N>& acc) {
  static_assert(Tile::rows == WGMMA_M, "the tile holds the warpgroup's 64 rows");
  warp::store(dst, warp::columns<FIRST_COL, Tile::cols>(acc), warp_row(), 0);
}

}  // namespace tk::warpgroup
