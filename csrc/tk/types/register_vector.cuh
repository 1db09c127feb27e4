// Register vectors: one value per row (or column) of a register tile, spread over the warp the way
// that tile spreads its rows (or columns), so broadcasts and reductions need no data movement.
//
// A vector of LENGTH entries is LENGTH / BASE_TILE blocks; within block b, entry b * BASE_TILE + i
// (0 <= i < BASE_TILE) sits in:
//   vector_layout::group            lanes whose groupID is i % CORE; each lane keeps 2 entries per
//                                   block (slot s: i = CORE * s + groupID), copied in the 4 lanes of
//                                   its group. The per-row vector of a row-layout tile.
//   vector_layout::thread_in_group  lanes whose threadID_in_group is (i % CORE) / 2; each lane keeps
//                                   4 entries per block (slot s: i = CORE * (s / 2) +
//                                   2 * threadID_in_group + s % 2), copied in all 8 groups.
//                                   The per-column vector of a row-layout tile.
// (For a col-layout tile the two swap.) Every lane holds a valid copy of its entries.
#pragma once

#include "register_layout.cuh"
#include "register_numeric.cuh"

namespace tk {

enum class vector_layout { group, thread_in_group };

namespace fragment {

// The layout of a vector indexed along `axis` of a tile of layout `layout`.
__host__ __device__ constexpr vector_layout vector_layout_along(register_layout layout, tile_axis axis) {
  return axis == pair_axis(layout) ? vector_layout::thread_in_group : vector_layout::group;
}

__host__ __device__ constexpr int vector_slots(vector_layout layout) {
  return layout == vector_layout::group ? HALVES : HALVES * PAIR;
}

// The slot that holds pair element `e` of quadrant half `half` of a tile.
__host__ __device__ constexpr int vector_slot(vector_layout layout, int half, int e) {
  return layout == vector_layout::group ? half : PAIR * half + e;
}

// The entry (within its block) that slot `s` holds on this lane.
template <vector_layout L>
__device__ __forceinline__ int vector_entry(int s) {
  if constexpr (L == vector_layout::group) {
    return CORE * s + group_id();
  } else {
    return CORE * (s / PAIR) + PAIR * thread_in_group() + s % PAIR;
  }
}

// Whether this lane holds the first of the identical copies of its entries (the one that stores).
template <vector_layout L>
__device__ __forceinline__ bool holds_first_copy() {
  return L == vector_layout::group ? thread_in_group() == 0 : group_id() == 0;
}

}  // namespace fragment

template <typename T, int LENGTH, vector_layout LAYOUT>
struct register_vector {
  static_assert(is_register_element<T>, "register vectors hold float, bf16 or half");
  static_assert(LENGTH > 0 && LENGTH % BASE_TILE == 0, "a register vector's length must be a multiple of BASE_TILE");

  using element = T;
  static constexpr int length = LENGTH;
  static constexpr vector_layout layout = LAYOUT;
  static constexpr int blocks = LENGTH / BASE_TILE;
  static constexpr int slots = fragment::vector_slots(LAYOUT);

  // values[block][slot]: see the layout comment at the top of this file.
  T values[blocks][slots];
};

template <typename V> constexpr bool is_register_vector_v = false;
template <typename T, int L, vector_layout VL> constexpr bool is_register_vector_v<register_vector<T, L, VL>> = true;
template <typename V> concept register_vector_type = is_register_vector_v<std::remove_cvref_t<V>>;

// Calls f(b, s) for each value (block b, slot s) of a V, fully unrolled (see for_each_pair).
template <register_vector_type V, typename F>
__device__ __forceinline__ void for_each_slot(F&& f) {
#pragma unroll
  for (int b = 0; b < V::blocks; ++b) {
#pragma unroll
    for (int s = 0; s < V::slots; ++s) f(b, s);
  }
}

}  // namespace tk
