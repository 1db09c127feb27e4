// Elementwise maps over register tiles and vectors, destination first:
//
//   exp2(t, t); mul(t, t, 0.125f); add(t, a, b); max(v, v, w); copy(bf16_tile, float_tile); zero(t);
//
// Every element is widened to float, mapped, and rounded once to the destination's type, so
// mixed-type operands and dtype conversion (copy) take the same path. Where that equals one packed
// 16-bit instruction (mul of 16-bit tiles and vectors of the destination's type, no scalars), the
// pairs go through it instead: same results, a fifth of the instructions. An operand is a register tile
// of the destination's shape and layout, a scalar, or (tiles only) a vector broadcast along rows or
// columns (broadcast.cuh). The destination may alias any operand.
#pragma once

#include <cuda/std/limits>

#include "../../types/register_tile.cuh"

namespace tk {
namespace op {

// Elementwise functions on float; the reductions' identities sit with the functions they belong to.
// Transcendentals and division use the hardware approximations (MUFU: about 2^-22 relative error),
// as the softmax-style kernels built on them want.
struct copy { __device__ static float apply(float x) { return x; } };
struct exp2 {
  __device__ static float apply(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
  }
};
struct exp { __device__ static float apply(float x) { return __expf(x); } };
struct log2 { __device__ static float apply(float x) { return __log2f(x); } };
struct neg { __device__ static float apply(float x) { return -x; } };
struct add {
  static constexpr float identity = 0.0f;
  __device__ static float apply(float a, float b) { return a + b; }
};
struct sub { __device__ static float apply(float a, float b) { return a - b; } };
struct mul {
  __device__ static float apply(float a, float b) { return a * b; }
  // On two packed 16-bit pairs: the exact product of two bf16 (fp16) values fits a float, so one
  // rounding of the packed product equals the float path's.
  template <typename P>
  __device__ static P apply_packed(P a, P b) { return __hmul2(a, b); }
};
struct div { __device__ static float apply(float a, float b) { return __fdividef(a, b); } };
struct max {
  static constexpr float identity = -cuda::std::numeric_limits<float>::infinity();
  __device__ static float apply(float a, float b) { return fmaxf(a, b); }
};
struct min {
  static constexpr float identity = cuda::std::numeric_limits<float>::infinity();
  __device__ static float apply(float a, float b) { return fminf(a, b); }
};

}  // namespace op

// A vector applied along one axis of a tile: entry i meets every element of row i (AXIS == rows)
// or of column i (AXIS == cols).
template <tile_axis AXIS, register_vector_type V>
struct broadcast {
  static constexpr tile_axis axis = AXIS;
  using vector_type = V;
  const V& vector;
};

template <typename X> constexpr bool is_broadcast_v = false;
template <tile_axis A, typename V> constexpr bool is_broadcast_v<broadcast<A, V>> = true;

template <typename X> concept register_object = register_tile_type<X> || register_vector_type<X>;

namespace warp {
namespace detail {

// Operand x at quadrant q of base tile (br, bc) of a Dst-shaped tile, widened to float.
template <register_tile_type Dst, typename X>
__device__ __forceinline__ float2 tile_operand(const X& x, int br, int bc, int q) {
  if constexpr (register_tile_type<X>) {
    static_assert(X::rows == Dst::rows && X::cols == Dst::cols, "elementwise tile operands must have the destination's shape");
    static_assert(X::layout == Dst::layout,
                  "elementwise tile operands must have the destination's layout (convert one with swap_layout)");
    return to_float2(x.pairs[br][bc][q]);
  } else if constexpr (is_broadcast_v<X>) {
    using V = typename X::vector_type;
    constexpr tile_axis axis = X::axis;
    static_assert(V::length == extent<Dst>(axis), "a broadcast vector needs one entry per row (per column) of the tile");
    static_assert(V::layout == fragment::vector_layout_along(Dst::layout, axis),
                  "a broadcast vector must be laid out like the tile's lines: declare it as "
                  "per_row_vector<Tile> (sub_row, ...) or per_col_vector<Tile> (sub_col, ...)");
    const int block = axis == tile_axis::rows ? br : bc;
    const int half = fragment::half_along(axis, q);
    const auto entry = [&](int e) {
      return numeric<typename V::element>::to_float(x.vector.values[block][fragment::vector_slot(V::layout, half, e)]);
    };
    return {entry(0), entry(1)};
  } else {
    static_assert(std::is_arithmetic_v<X>, "an elementwise operand is a register tile, a broadcast vector or a scalar");
    return {float(x), float(x)};
  }
}

// Operand x at slot s of block b of a Dst-shaped vector, widened to float.
template <register_vector_type Dst, typename X>
__device__ __forceinline__ float vector_operand(const X& x, int b, int s) {
  if constexpr (register_vector_type<X>) {
    static_assert(X::length == Dst::length && X::layout == Dst::layout,
                  "elementwise vector operands must have the destination's length and layout");
    return numeric<typename X::element>::to_float(x.values[b][s]);
  } else {
    static_assert(std::is_arithmetic_v<X>, "an elementwise vector operand is a register vector or a scalar");
    return float(x);
  }
}

template <typename Op, typename... Pairs>
__device__ __forceinline__ float2 apply_pairwise(Pairs... operands) {
  return {Op::apply(operands.x...), Op::apply(operands.y...)};
}

}  // namespace detail

// dst = Op(x...), element by element.
namespace detail {

// Whether x holds elements of type T (a tile, or a vector broadcast along a tile); scalars do not.
template <typename T, typename X> constexpr bool holds_elements_of = false;
template <typename T, register_tile_type X> constexpr bool holds_elements_of<T, X> = std::is_same_v<typename X::element, T>;
template <typename T, tile_axis A, typename V>
constexpr bool holds_elements_of<T, broadcast<A, V>> = std::is_same_v<typename V::element, T>;

template <typename Op, typename Dst, typename... X>
constexpr bool maps_packed = is_16bit_float<typename Dst::element> && (holds_elements_of<typename Dst::element, X> && ...) &&
                             requires(typename Dst::pair_type p) { Op::apply_packed(p, p); };

// Operand x at quadrant q of base tile (br, bc) of a Dst-shaped tile, as a packed pair of Dst's type.
template <register_tile_type Dst, typename X>
__device__ __forceinline__ typename Dst::pair_type packed_operand(const X& x, int br, int bc, int q) {
  if constexpr (register_tile_type<X>) {
    static_assert(X::rows == Dst::rows && X::cols == Dst::cols && X::layout == Dst::layout,
                  "elementwise tile operands must have the destination's shape and layout");
    return x.pairs[br][bc][q];
  } else {
    using V = typename X::vector_type;
    constexpr tile_axis axis = X::axis;
    static_assert(V::length == extent<Dst>(axis) && V::layout == fragment::vector_layout_along(Dst::layout, axis),
                  "a broadcast vector must be laid out like the tile's lines");
    const int block = axis == tile_axis::rows ? br : bc;
    const int half = fragment::half_along(axis, q);
    return {x.vector.values[block][fragment::vector_slot(V::layout, half, 0)],
            x.vector.values[block][fragment::vector_slot(V::layout, half, 1)]};
  }
}

}  // namespace detail

template <typename Op, register_tile_type Dst, typename... X>
__device__ __forceinline__ void map(Dst& dst, const X&... x) {
  if constexpr (detail::maps_packed<Op, Dst, X...>) {
    for_each_pair<Dst>([&](int br, int bc, int q) { dst.pairs[br][bc][q] = Op::apply_packed(detail::packed_operand<Dst>(x, br, bc, q)...); });
  } else {
    for_each_pair<Dst>([&](int br, int bc, int q) {
      const float2 result = detail::apply_pairwise<Op>(detail::tile_operand<Dst>(x, br, bc, q)...);
      dst.pairs[br][bc][q] = numeric<typename Dst::element>::pair_from_float2(result);
    });
  }
}

template <typename Op, register_vector_type Dst, typename... X>
__device__ __forceinline__ void map(Dst& dst, const X&... x) {
  for_each_slot<Dst>([&](int b, int s) {
    dst.values[b][s] = numeric<typename Dst::element>::from_float(Op::apply(detail::vector_operand<Dst>(x, b, s)...));
  });
}

// copy converts between element types; shapes and layouts must match.
template <register_object D, typename S> __device__ __forceinline__ void copy(D& dst, const S& src) { map<op::copy>(dst, src); }
template <register_object D, typename S> __device__ __forceinline__ void exp2(D& dst, const S& src) { map<op::exp2>(dst, src); }
template <register_object D, typename S> __device__ __forceinline__ void exp(D& dst, const S& src) { map<op::exp>(dst, src); }
template <register_object D, typename S> __device__ __forceinline__ void log2(D& dst, const S& src) { map<op::log2>(dst, src); }
template <register_object D, typename S> __device__ __forceinline__ void neg(D& dst, const S& src) { map<op::neg>(dst, src); }

template <register_object D, typename A, typename B>
__device__ __forceinline__ void add(D& dst, const A& a, const B& b) { map<op::add>(dst, a, b); }
template <register_object D, typename A, typename B>
__device__ __forceinline__ void sub(D& dst, const A& a, const B& b) { map<op::sub>(dst, a, b); }
template <register_object D, typename A, typename B>
__device__ __forceinline__ void mul(D& dst, const A& a, const B& b) { map<op::mul>(dst, a, b); }
template <register_object D, typename A, typename B>
__device__ __forceinline__ void div(D& dst, const A& a, const B& b) { map<op::div>(dst, a, b); }
template <register_object D, typename A, typename B>
__device__ __forceinline__ void max(D& dst, const A& a, const B& b) { map<op::max>(dst, a, b); }
template <register_object D, typename A, typename B>
__device__ __forceinline__ void min(D& dst, const A& a, const B& b) { map<op::min>(dst, a, b); }

template <register_object D> __device__ __forceinline__ void fill(D& dst, float value) { map<op::copy>(dst, value); }
template <register_object D> __device__ __forceinline__ void zero(D& dst) { fill(dst, 0.0f); }
template <register_object D> __device__ __forceinline__ void neg_infty(D& dst) { fill(dst, op::max::identity); }

}  // namespace warp
}  // namespace tk
