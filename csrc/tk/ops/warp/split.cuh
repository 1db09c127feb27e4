// fp32 values as two bf16 parts, for tensor-core products at fp32-level accuracy:
//
//   split(hi, lo, t);    hi = bf16(t), lo = bf16(t - hi)   (float tile -> two bf16 tiles of its shape)
//
// t - hi is exact in float, so hi + lo carries t to about 16 significant bits (|t - hi - lo| <=
// 2^-17 |t|) with fp32's exponent range. A product a b of split operands kept as three products,
// a_hi b_hi + a_hi b_lo + a_lo b_hi with fp32 accumulation, drops only a_lo b_lo (<= 2^-18 |a b|):
// three bf16 mma.sync per product instead of one fp32 product the tensor cores do not have.
#pragma once

#include "../../types/register_tile.cuh"

namespace tk {

// (hi, lo) of a float pair, both rounded to nearest.
__device__ __forceinline__ void split_pair(float2 value, bf16_2& hi, bf16_2& lo) {
  hi = __float22bfloat162_rn(value);
  const float2 rounded = __bfloat1622float2(hi);
  lo = __float22bfloat162_rn({value.x - rounded.x, value.y - rounded.y});
}

namespace warp {

template <register_tile_type H, register_tile_type L, register_tile_type S>
__device__ __forceinline__ void split(H& hi, L& lo, const S& src) {
  static_assert(std::is_same_v<typename S::element, float> && std::is_same_v<typename H::element, bf16> &&
                    std::is_same_v<typename L::element, bf16>,
                "split: a float tile into bf16 hi and lo tiles");
  static_assert(H::rows == S::rows && H::cols == S::cols && H::layout == S::layout && L::rows == S::rows &&
                    L::cols == S::cols && L::layout == S::layout,
                "split: hi and lo have the source's shape and layout");
  for_each_pair<S>([&](int br, int bc, int q) { split_pair(src.pairs[br][bc][q], hi.pairs[br][bc][q], lo.pairs[br][bc][q]); });
}

}  // namespace warp
}  // namespace tk
