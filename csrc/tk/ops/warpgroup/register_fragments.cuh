// wgmma's register fragments in terms of the warps' register tiles.
//
// wgmma.mma_async.m64nNk16 spreads its 64 x N accumulator over the 4 warps of a warpgroup: warp w
// holds rows [16 w, 16 w + 16), as the mma.m16n8k16 C fragment repeated over N / 8 column chunks
// (PTX ISA, "Register Fragments", wgmma .m64nNk16, accumulator D). For the f32 accumulator, register
// d_k of a lane (0 <= k < N / 2) is
//
//   row = groupID + 8 * ((k / 2) % 2),   col = 8 * (k / 4) + 2 * threadID_in_group + k % 2
//
// which is element k % 2 of quadrant ((k / 2) % 2, (k / 4) % 2) of base tile k / 8 of a float
// row-layout register tile: the tile's pairs, taken in order, are d_0 .. d_{N/2-1}. That is why
// warpgroup::accumulator<N> simply is that tile (wgmma.cuh), proven below. A register A operand
// (bf16/half, 4 registers a0..a3 per k16 step) is likewise the 4 quadrants of one 16 x 16 row-layout
// base tile of the warp's rows.
#pragma once

#include "../../types/register_tile.cuh"
#include "wgmma.cuh"

namespace tk::warpgroup {
namespace detail {

struct tile_slot {
  int col_block;
  int quadrant;
  int element;
};

// Where the PTX ISA puts accumulator register d_k in the lane's register tile (the top comment).
__host__ __device__ constexpr tile_slot accumulator_slot(int k) {
  constexpr int per_chunk = fragment::HALVES * fragment::PAIR;  // an 8-column chunk: two rows of a pair
  const int chunk = k / per_chunk;
  return {chunk / fragment::HALVES,
          fragment::quadrant((k / fragment::PAIR) % fragment::HALVES, chunk % fragment::HALVES), k % fragment::PAIR};
}

// The mapping is the tile's storage order, so the accumulator needs no conversion at all.
__host__ __device__ constexpr bool accumulator_is_storage_order(int registers) {
  for (int k = 0; k < registers; ++k) {
    const tile_slot slot = accumulator_slot(k);
    if ((slot.col_block * fragment::QUADRANTS + slot.quadrant) * fragment::PAIR + slot.element != k) return false;
  }
  return true;
}
static_assert(accumulator_is_storage_order(WGMMA_MAX_N / fragment::PAIR));
static_assert(sizeof(accumulator<WGMMA_MAX_N>) == WGMMA_MAX_N / fragment::PAIR * sizeof(float),
              "an accumulator holds N / 2 floats per lane: d_0 .. d_{N/2-1}");

}  // namespace detail

// The 4 registers of the A operand of k16 step `k_block` of a register-sourced wgmma: the warp's
// rows of a 16-bit row-layout tile (K along its columns).
template <register_tile_type Tile>
__device__ __forceinline__ void a_operand(uint32_t (&a)[fragment::QUADRANTS], const Tile& tile, int k_block) {
  static_assert(is_16bit_float<typename Tile::element>, "a register wgmma A operand is bf16 or half: warp::copy a float tile first");
  static_assert(Tile::layout == register_layout::row,
                "a register wgmma A operand has its pairs along K: use a row-layout (M x K) tile");
  static_assert(Tile::rows == BASE_TILE, "a register wgmma A operand is the warp's 16 rows of the warpgroup's 64");
#pragma unroll
  for (int q = 0; q < fragment::QUADRANTS; ++q) a[q] = pair_bits(tile.pairs[0][k_block][q]);
}

// acc (+)= A * B[0 : K, b_mn0 : b_mn0 + N] with A (64 x K) from registers: each warp's 16 rows of
// the warpgroup's A as a 16-bit row-layout tile (e.g. P = softmax(S) converted with warp::copy).
// `accumulate` false overwrites acc. Issues only: the caller commits, waits and pins A.
template <operand_major B_MAJOR, int N, register_tile_type TileA, typename TileB>
__device__ __forceinline__ void mma(accumulator<N>& acc, const TileA& a, const TileB& b, int b_mn0, bool accumulate) {
  static_assert(std::is_same_v<typename TileA::element, typename TileB::element>, "A and B must have one element type");
  static_assert(TileA::cols == k_extent<B_MAJOR, TileB>(), "A's columns and B's K extent must agree");
#pragma unroll
  for (int k_block = 0; k_block < TileA::col_blocks; ++k_block) {
    uint32_t fragment_a[fragment::QUADRANTS];
    a_operand(fragment_a, a, k_block);
    mma<B_MAJOR>(acc, fragment_a, b, b_mn0, WGMMA_K * k_block, accumulate || k_block > 0);
  }
}

}  // namespace tk::warpgroup
