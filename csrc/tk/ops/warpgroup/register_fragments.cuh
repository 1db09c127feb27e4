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
// row-layout register tile: the tile's pairs, taken in order, are d_0 .. d_{N/2-1}. A register A
// operand (bf16/half, 4 registers a0..a3 per k16 step) is likewise the 4 quadrants of one 16 x 16
// row-layout base tile of the warp's rows.
//
// warpgroup::accumulator<N> (wgmma.cuh) holds those registers. A warp's view of it is a
// register_tile<float, 16 * M_BLOCKS, N>: row block m holds the warp's rows of M-block m, i.e.
// warpgroup tile rows [64 m + 16 w, 64 m + 16 w + 16).
#pragma once

#include "../../types/register_tile.cuh"
#include "wgmma.cuh"

namespace tk::warpgroup {

constexpr int WGMMA_M = WARPGROUP_WARPS * BASE_TILE;  // rows of one wgmma: BASE_TILE per warp
constexpr int WGMMA_K = BASE_TILE;                    // K of one bf16/half wgmma
constexpr int WGMMA_MAX_N = 256;

// The register A operand of one k16 step of a bf16/half wgmma, in PTX order (a0..a3).
struct a_operand_fragment {
  uint32_t a[fragment::QUADRANTS];
};

namespace detail {

struct tile_slot {
  int col_block;
  int quadrant;
  int element;
};

// Where accumulator register d_k of a lane sits in the lane's register tile (see the top comment).
__host__ __device__ constexpr tile_slot accumulator_slot(int k) {
  constexpr int per_chunk = fragment::HALVES * fragment::PAIR;  // an 8-column chunk: two rows of a pair
  const int chunk = k / per_chunk;
  return {chunk / fragment::HALVES,
          fragment::quadrant((k / fragment::PAIR) % fragment::HALVES, chunk % fragment::HALVES), k % fragment::PAIR};
}

// The mapping is the tile's storage order, so converting is free (register renaming).
__host__ __device__ constexpr bool accumulator_is_storage_order(int registers) {
  for (int k = 0; k < registers; ++k) {
    const tile_slot slot = accumulator_slot(k);
    if ((slot.col_block * fragment::QUADRANTS + slot.quadrant) * fragment::PAIR + slot.element != k) return false;
  }
  return true;
}
static_assert(accumulator_is_storage_order(accumulator<WGMMA_MAX_N>::registers));

template <int N, register_tile_type Tile>
__host__ __device__ constexpr void check_accumulator_tile() {
  static_assert(accumulator<N>::rows == WGMMA_M && accumulator<N>::registers * WARP_THREADS == BASE_TILE * N,
                "a wgmma accumulator gives each warp BASE_TILE rows");
  static_assert(std::is_same_v<typename Tile::element, float> && Tile::layout == register_layout::row,
                "a wgmma f32 accumulator maps onto a float row-layout register tile");
  static_assert(Tile::cols == N, "the register tile must be N columns wide");
}

template <register_tile_type Tile>
__device__ __forceinline__ decltype(auto) tile_element(Tile& tile, int m_block, int k) {
  const tile_slot slot = accumulator_slot(k);
  auto& pair = tile.pairs[m_block][slot.col_block][slot.quadrant];
  return slot.element == 0 ? pair.x : pair.y;
}

}  // namespace detail

// This warp's first row in the warpgroup tile, for row block m_block of its register tiles.
__device__ __forceinline__ int warp_row(int m_block) { return WGMMA_M * m_block + BASE_TILE * warp_in_warpgroup(); }

// Row block m_block of dst = the accumulator of the wgmma that computed M-block m_block.
// m_block is a compile-time constant in practice (unrolled loops), never a runtime index.
template <register_tile_type Tile, int N>
__device__ __forceinline__ void copy(Tile& dst, const accumulator<N>& src, int m_block) {
  detail::check_accumulator_tile<N, Tile>();
#pragma unroll
  for (int k = 0; k < accumulator<N>::registers; ++k) detail::tile_element(dst, m_block, k) = src.data[k];
}

template <int N, register_tile_type Tile>
__device__ __forceinline__ void copy(accumulator<N>& dst, const Tile& src, int m_block) {
  detail::check_accumulator_tile<N, Tile>();
#pragma unroll
  for (int k = 0; k < accumulator<N>::registers; ++k) dst.data[k] = detail::tile_element(src, m_block, k);
}

// The A operand of the k16 step k_block of a register-sourced wgmma, from row block m_block of a
// 16-bit row-layout tile (the warp's rows of that M-block, K along the columns).
template <register_tile_type Tile>
__device__ __forceinline__ a_operand_fragment a_operand(const Tile& a, int m_block, int k_block) {
  static_assert(is_16bit_float<typename Tile::element>, "a register wgmma A operand is bf16 or half: copy() a float tile first");
  static_assert(Tile::layout == register_layout::row,
                "a register wgmma A operand has its pairs along K: use a row-layout (M x K) tile");
  a_operand_fragment operand;
#pragma unroll
  for (int q = 0; q < fragment::QUADRANTS; ++q) operand.a[q] = pair_bits(a.pairs[m_block][k_block][q]);
  return operand;
}

}  // namespace tk::warpgroup
