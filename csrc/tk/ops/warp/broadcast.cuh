// Row and column broadcasts, destination first:
//
//   sub_row(s, s, row_max_of_s);   s[i][j] -= m[i]     (m: per_row_vector<decltype(s)>)
//   div_row(o, o, row_sum_of_p);   o[i][j] /= l[i]
//   mul_col(t, t, w);              t[i][j] *= w[j]     (w: per_col_vector<decltype(t)>)
//
// The vector must be laid out like the tile's rows (columns); that is checked at compile time.
#pragma once

#include "maps.cuh"

namespace tk::warp {

template <register_tile_type D, typename A, typename V>
__device__ __forceinline__ void add_row(D& dst, const A& a, const V& v) { map<op::add>(dst, a, broadcast<tile_axis::rows, V>{v}); }
template <register_tile_type D, typename A, typename V>
__device__ __forceinline__ void sub_row(D& dst, const A& a, const V& v) { map<op::sub>(dst, a, broadcast<tile_axis::rows, V>{v}); }
template <register_tile_type D, typename A, typename V>
__device__ __forceinline__ void mul_row(D& dst, const A& a, const V& v) { map<op::mul>(dst, a, broadcast<tile_axis::rows, V>{v}); }
template <register_tile_type D, typename A, typename V>
__device__ __forceinline__ void div_row(D& dst, const A& a, const V& v) { map<op::div>(dst, a, broadcast<tile_axis::rows, V>{v}); }

template <register_tile_type D, typename A, typename V>
__device__ __forceinline__ void add_col(D& dst, const A& a, const V& v) { map<op::add>(dst, a, broadcast<tile_axis::cols, V>{v}); }
template <register_tile_type D, typename A, typename V>
__device__ __forceinline__ void sub_col(D& dst, const A& a, const V& v) { map<op::sub>(dst, a, broadcast<tile_axis::cols, V>{v}); }
template <register_tile_type D, typename A, typename V>
__device__ __forceinline__ void mul_col(D& dst, const A& a, const V& v) { map<op::mul>(dst, a, broadcast<tile_axis::cols, V>{v}); }
template <register_tile_type D, typename A, typename V>
__device__ __forceinline__ void div_col(D& dst, const A& a, const V& v) { map<op::div>(dst, a, broadcast<tile_axis::cols, V>{v}); }

}  // namespace tk::warp
