// Warp-level tensor-core products on register tiles (mma.sync m16n8k16, bf16/half in, fp32
// accumulate), destination first; d may be c:
//
//   mma_AB  (d, a, b, c);   d = a   · b   + c    a: M x K row    b: K x N col
//   mma_ABt (d, a, b, c);   d = a   · bᵀ  + c    a: M x K row    b: N x K row
//   mma_AtB (d, a, b, c);   d = aᵀ  · b   + c    a: K x M col    b: K x N col
//   mma_AtBt(d, a, b, c);   d = aᵀ  · bᵀ  + c    a: K x M col    b: N x K row
//
// c and d are M x N float row-layout tiles. The tensor core wants both operands' pairs along K, which
// is what fixes each operand's layout above; any other layout is a compile error.
#pragma once

#include "../../types/register_tile.cuh"

namespace tk::warp {
namespace detail {

// One mma.m16n8k16: the shape of the instruction in base-tile terms.
constexpr int MMA_N = fragment::CORE;                        // an instruction covers one column half
constexpr int MMA_A_REGISTERS = fragment::QUADRANTS;         // a whole 16 x 16 base tile of A
constexpr int MMA_B_REGISTERS = BASE_TILE / fragment::CORE;  // the K halves of one column half of B
constexpr int MMA_ACCUMULATORS = BASE_TILE * MMA_N / WARP_THREADS;

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[MMA_ACCUMULATORS], const uint32_t (&a)[MMA_A_REGISTERS],
                                             const uint32_t (&b)[MMA_B_REGISTERS]) {
  if constexpr (std::is_same_v<T, bf16>) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    static_assert(std::is_same_v<T, half>, "mma operands are bf16 or half");
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// The register of operand `tile` that holds quadrant q of the logical base tile (outer, inner), where
// a TRANSPOSED operand is stored as its transpose (base tile (inner, outer), quadrant transposed).
template <bool TRANSPOSED, register_tile_type Tile>
__device__ __forceinline__ uint32_t operand_register(const Tile& tile, int outer, int inner, int q) {
  if constexpr (TRANSPOSED) {
    return pair_bits(tile.pairs[inner][outer][fragment::transposed(q)]);
  } else {
    return pair_bits(tile.pairs[outer][inner][q]);
  }
}

template <bool A_TRANSPOSED, bool B_TRANSPOSED, register_tile_type D, register_tile_type A, register_tile_type B,
          register_tile_type C>
__device__ __forceinline__ void mma(D& d, const A& a, const B& b, const C& c) {
  constexpr int m = A_TRANSPOSED ? A::cols : A::rows;
  constexpr int k = A_TRANSPOSED ? A::rows : A::cols;
  constexpr int b_k = B_TRANSPOSED ? B::cols : B::rows;
  constexpr int n = B_TRANSPOSED ? B::rows : B::cols;
  static_assert(A::layout == (A_TRANSPOSED ? register_layout::col : register_layout::row),
                "mma: A's pairs must run along K: a row-layout M x K tile (mma_AB, mma_ABt) or a col-layout "
                "K x M tile (mma_AtB, mma_AtBt)");
  static_assert(B::layout == (B_TRANSPOSED ? register_layout::row : register_layout::col),
                "mma: B's pairs must run along K: a col-layout K x N tile (mma_AB, mma_AtB) or a row-layout "
                "N x K tile (mma_ABt, mma_AtBt)");
  static_assert(k == b_k, "mma: A and B disagree on K");
  static_assert(std::is_same_v<typename A::element, typename B::element> && is_16bit_float<typename A::element>,
                "mma: A and B are both bf16 or both half");
  static_assert(std::is_same_v<D, C>, "mma: d and c have the same type");
  static_assert(std::is_same_v<typename D::element, float> && D::layout == register_layout::row,
                "mma: the accumulator is a float row-layout tile");
  static_assert(D::rows == m && D::cols == n, "mma: the accumulator must be M x N");

  for_each_base_tile<D>([&](int mb, int nb) {
#pragma unroll
    for (int n_half = 0; n_half < fragment::HALVES; ++n_half) {
      // The accumulator of one column half is quadrants (row half 0, n_half) and (row half 1, n_half).
      const float2 top = c.pairs[mb][nb][fragment::quadrant(0, n_half)];
      const float2 bottom = c.pairs[mb][nb][fragment::quadrant(1, n_half)];
      float acc[MMA_ACCUMULATORS] = {top.x, top.y, bottom.x, bottom.y};
#pragma unroll
      for (int kb = 0; kb < k / BASE_TILE; ++kb) {
        uint32_t a_regs[MMA_A_REGISTERS];
#pragma unroll
        for (int q = 0; q < MMA_A_REGISTERS; ++q) a_regs[q] = operand_register<A_TRANSPOSED>(a, mb, kb, q);
        uint32_t b_regs[MMA_B_REGISTERS];
#pragma unroll
        for (int k_half = 0; k_half < MMA_B_REGISTERS; ++k_half) {
          b_regs[k_half] = operand_register<B_TRANSPOSED>(b, kb, nb, fragment::quadrant(k_half, n_half));
        }
        mma_m16n8k16<typename A::element>(acc, a_regs, b_regs);
      }
      d.pairs[mb][nb][fragment::quadrant(0, n_half)] = {acc[0], acc[1]};
      d.pairs[mb][nb][fragment::quadrant(1, n_half)] = {acc[2], acc[3]};
    }
  });
}

}  // namespace detail

template <register_tile_type D, register_tile_type A, register_tile_type B, register_tile_type C>
__device__ __forceinline__ void mma_AB(D& d, const A& a, const B& b, const C& c) { detail::mma<false, false>(d, a, b, c); }
template <register_tile_type D, register_tile_type A, register_tile_type B, register_tile_type C>
__device__ __forceinline__ void mma_ABt(D& d, const A& a, const B& b, const C& c) { detail::mma<false, true>(d, a, b, c); }
template <register_tile_type D, register_tile_type A, register_tile_type B, register_tile_type C>
__device__ __forceinline__ void mma_AtB(D& d, const A& a, const B& b, const C& c) { detail::mma<true, false>(d, a, b, c); }
template <register_tile_type D, register_tile_type A, register_tile_type B, register_tile_type C>
__device__ __forceinline__ void mma_AtBt(D& d, const A& a, const B& b, const C& c) { detail::mma<true, true>(d, a, b, c); }

}  // namespace tk::warp
