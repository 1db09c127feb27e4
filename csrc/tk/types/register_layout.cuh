// How a warp spreads a register tile over its 32 lanes.
//
// The layout is the fragment layout of mma.m16n8k16, which ldmatrix/stmatrix/movmatrix move and
// wgmma's register operands and accumulators reuse. A BASE_TILE x BASE_TILE base tile is four
// CORE x CORE core matrices ("quadrants"). In every quadrant a lane's groupID (lane / 4) picks one
// line and its threadID_in_group (lane % 4) picks two adjacent elements on that line, packed in one
// 32-bit (16-bit types) or 64-bit (float) register pair:
//
//   row layout: the pair is (row = groupID, cols = 2 * threadID_in_group + {0, 1})
//   col layout: the pair is (rows = 2 * threadID_in_group + {0, 1}, col = groupID)
//
// Quadrant q covers rows [CORE * row_half(q), ...) and cols [CORE * col_half(q), ...) of the base
// tile, numbered q = row_half + 2 * col_half: the order of mma's A registers a0..a3 and of wgmma's
// accumulator registers, so a fragment is the base tile's registers taken in order.
#pragma once

#include "../common.cuh"

namespace tk {

// Which tile axis a lane's packed pair runs along.
enum class register_layout {
  row,  // pairs are horizontal: mma's A (M x K), C and D, and B stored transposed (N x K)
  col,  // pairs are vertical: mma's B (K x N), and A stored transposed (K x M)
};

enum class tile_axis { rows, cols };

namespace fragment {

constexpr int CORE = BASE_TILE / 2;                       // side of a core matrix (quadrant)
constexpr int HALVES = BASE_TILE / CORE;                  // quadrants along each side of a base tile
constexpr int QUADRANTS = HALVES * HALVES;                // packed registers per lane and base tile
constexpr int PAIR = 2;                                   // elements in a packed register
constexpr int GROUPS = CORE;                              // one core-matrix line per group of lanes
constexpr int THREADS_PER_GROUP = WARP_THREADS / GROUPS;  // lanes sharing a line, one pair each
static_assert(THREADS_PER_GROUP * PAIR == CORE, "a group's pairs must cover one core-matrix line");
static_assert(QUADRANTS * PAIR * WARP_THREADS == BASE_TILE * BASE_TILE, "a warp must hold a base tile");

__host__ __device__ constexpr int row_half(int quadrant) { return quadrant % HALVES; }
__host__ __device__ constexpr int col_half(int quadrant) { return quadrant / HALVES; }
__host__ __device__ constexpr int quadrant(int row_half, int col_half) { return row_half + HALVES * col_half; }
__host__ __device__ constexpr int half_along(tile_axis axis, int q) { return axis == tile_axis::rows ? row_half(q) : col_half(q); }
// The quadrant that holds the same core matrix once the base tile is transposed.
__host__ __device__ constexpr int transposed(int q) { return quadrant(col_half(q), row_half(q)); }

// The tile axis along which a layout's pairs run.
__host__ __device__ constexpr tile_axis pair_axis(register_layout layout) {
  return layout == register_layout::row ? tile_axis::cols : tile_axis::rows;
}

__device__ __forceinline__ int group_id() { return lane_id() / THREADS_PER_GROUP; }
__device__ __forceinline__ int thread_in_group() { return lane_id() % THREADS_PER_GROUP; }

struct coord {
  int row;
  int col;
};

// Where element `e` of this lane's pair in quadrant `q` sits, relative to its base tile.
template <register_layout L>
__device__ __forceinline__ coord pair_element_coord(int q, int e) {
  const int line = group_id();
  const int along = PAIR * thread_in_group() + e;
  if constexpr (L == register_layout::row) {
    return {CORE * row_half(q) + line, CORE * col_half(q) + along};
  } else {
    return {CORE * row_half(q) + along, CORE * col_half(q) + line};
  }
}

}  // namespace fragment
}  // namespace tk
