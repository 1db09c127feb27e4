// Register tiles and vectors to and from global memory, destination first:
//
//   load(t, src, row_stride);    t[i][j] = src[i * row_stride + j]
//   store(dst, row_stride, t);
//   store(dst, row_stride, t, rows);   the same for tile rows i < rows only (a tail of positions)
//   load(v, src);  store(dst, v);   v[i] = src[i]
//   load(v, src, n);  store(dst, v, n);   the same for entries i < n only (v[i] = 0 past n)
//
// Element types convert on the way. Row-layout tiles (and, on load, vectors of thread_in_group layout)
// move a pair per access, so src/dst must be aligned to two elements and row_stride even; col-layout tiles move single elements. Vector stores
// come from one copy of each entry (every lane holds one). Tiles are loaded whole: callers that need
// bounds use TMA or shared memory.
#pragma once

#include "../../types/register_tile.cuh"

namespace tk::warp {
namespace detail {

// Where pair element e of quadrant q of base tile (br, bc) sits in a row-major matrix at `origin`.
template <register_layout L, typename U>
__device__ __forceinline__ U* pair_element_pointer(U* origin, int row_stride, int br, int bc, int q, int e) {
  const fragment::coord at = fragment::pair_element_coord<L>(q, e);
  return origin + (BASE_TILE * br + at.row) * row_stride + BASE_TILE * bc + at.col;
}

}  // namespace detail

template <register_tile_type D, typename U>
  requires is_register_element<U>
__device__ __forceinline__ void load(D& dst, const U* src, int row_stride) {
  using global_pair = packed_pair_t<U>;
  for_each_pair<D>([&](int br, int bc, int q) {
    const auto at = [&](int e) { return detail::pair_element_pointer<D::layout>(src, row_stride, br, bc, q, e); };
    global_pair pair;
    if constexpr (D::layout == register_layout::row) {
      pair = *reinterpret_cast<const global_pair*>(at(0));
    } else {
      pair = global_pair{*at(0), *at(1)};
    }
    dst.pairs[br][bc][q] = convert_pair<typename D::pair_type>(pair);
  });
}

template <typename U, register_tile_type T>
  requires is_register_element<U>
__device__ __forceinline__ void store(U* dst, int row_stride, const T& src) {
  using global_pair = packed_pair_t<U>;
  for_each_pair<T>([&](int br, int bc, int q) {
    const auto at = [&](int e) { return detail::pair_element_pointer<T::layout>(dst, row_stride, br, bc, q, e); };
    const global_pair pair = convert_pair<global_pair>(src.pairs[br][bc][q]);
    if constexpr (T::layout == register_layout::row) {
      *reinterpret_cast<global_pair*>(at(0)) = pair;
    } else {
      *at(0) = pair.x;
      *at(1) = pair.y;
    }
  });
}

template <typename U, register_tile_type T>
  requires is_register_element<U> && (T::layout == register_layout::row)
__device__ __forceinline__ void store(U* dst, int row_stride, const T& src, int rows) {
  using global_pair = packed_pair_t<U>;
  for_each_pair<T>([&](int br, int bc, int q) {
    const fragment::coord at = fragment::pair_element_coord<T::layout>(q, 0);
    const int row = BASE_TILE * br + at.row;
    if (row >= rows) return;
    *reinterpret_cast<global_pair*>(dst + row * row_stride + BASE_TILE * bc + at.col) =
        convert_pair<global_pair>(src.pairs[br][bc][q]);
  });
}

template <register_vector_type V, typename U>
  requires is_register_element<U>
__device__ __forceinline__ void load(V& dst, const U* src) {
  if constexpr (V::layout == vector_layout::thread_in_group) {
    // Slots 2h and 2h + 1 hold adjacent entries (a tile column pair): one access for both.
    for_each_slot<V>([&](int b, int s) {
      if (s % fragment::PAIR != 0) return;
      const auto pair = *reinterpret_cast<const packed_pair_t<U>*>(src + BASE_TILE * b + fragment::vector_entry<V::layout>(s));
      dst.values[b][s] = convert<typename V::element>(pair.x);
      dst.values[b][s + 1] = convert<typename V::element>(pair.y);
    });
  } else {
    for_each_slot<V>([&](int b, int s) {
      dst.values[b][s] = convert<typename V::element>(src[BASE_TILE * b + fragment::vector_entry<V::layout>(s)]);
    });
  }
}

template <typename U, register_vector_type V>
  requires is_register_element<U>
__device__ __forceinline__ void store(U* dst, const V& src) {
  if (!fragment::holds_first_copy<V::layout>()) return;
  for_each_slot<V>([&](int b, int s) {
    dst[BASE_TILE * b + fragment::vector_entry<V::layout>(s)] = convert<U>(src.values[b][s]);
  });
}

// Bounded forms, for vectors that run past the end of their data (a tail of rows or columns).
template <register_vector_type V, typename U>
  requires is_register_element<U>
__device__ __forceinline__ void load(V& dst, const U* src, int count) {
  for_each_slot<V>([&](int b, int s) {
    const int i = BASE_TILE * b + fragment::vector_entry<V::layout>(s);
    dst.values[b][s] = i < count ? convert<typename V::element>(src[i]) : numeric<typename V::element>::from_float(0.0f);
  });
}

template <typename U, register_vector_type V>
  requires is_register_element<U>
__device__ __forceinline__ void store(U* dst, const V& src, int count) {
  if (!fragment::holds_first_copy<V::layout>()) return;
  for_each_slot<V>([&](int b, int s) {
    const int i = BASE_TILE * b + fragment::vector_entry<V::layout>(s);
    if (i < count) dst[i] = convert<U>(src.values[b][s]);
  });
}

}  // namespace tk::warp
