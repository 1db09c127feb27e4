// Register tiles to and from shared tiles, destination first:
//
//   load(q_regs, q_smem);               the whole register tile from the shared tile's origin
//   load(k_regs, kv_smem, 16, 0);       from rows 16.., cols 0.. (offsets: multiples of 8)
//   store(o_smem, o_regs);
//
// 16-bit shared tiles move through ldmatrix/stmatrix (.trans for col-layout register tiles), one
// instruction per base tile; float shared tiles through plain vector (row layout) or scalar (col
// layout) accesses. Element types convert on the way (e.g. a float accumulator stored to a bf16 tile).
// The warp's lanes must all take part (the instructions are .sync.aligned).
#pragma once

#include <concepts>

#include "../../types/register_tile.cuh"

namespace tk {

// What these loads and stores need from a shared tile type S (tk::shared_tile satisfies it):
//   typename S::element               float, bf16 or half
//   S::rows, S::cols                  its shape
//   S::offset(row, col) -> uint32     byte offset of element (row, col) from the object's address,
//                                     swizzle included
// and the object itself sits in shared memory. The swizzle may only permute whole 16-byte chunks:
// each 16-byte aligned run of a row (8 16-bit or 4 float elements starting at a multiple of 8 or 4)
// stays contiguous at offset(row, first column), as with the 32/64/128-byte TMA/wgmma swizzles.
template <typename S>
concept shared_tile_like = requires(int row, int col) {
  typename S::element;
  { S::rows } -> std::convertible_to<int>;
  { S::cols } -> std::convertible_to<int>;
  { S::offset(row, col) } -> std::convertible_to<uint32_t>;
} && is_register_element<typename S::element>;

namespace warp {
namespace detail {

constexpr int CHUNK_BYTES = 16;  // the unit swizzles move, and one ldmatrix/stmatrix line
static_assert(fragment::CORE * int(sizeof(bf16)) == CHUNK_BYTES, "an ldmatrix line is one 16-bit core-matrix line");
static_assert(fragment::QUADRANTS * fragment::CORE == WARP_THREADS, "ldmatrix.x4 takes one line address per lane");

template <shared_tile_like S>
__device__ __forceinline__ uint32_t element_address(const S& tile, int row, int col) {
  return tk::shared_address(&tile) + S::offset(row, col);
}

template <bool TRANSPOSE>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&regs)[fragment::QUADRANTS], uint32_t address) {
  if constexpr (TRANSPOSE) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
                 : "r"(address)
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
                 : "r"(address)
                 : "memory");
  }
}

template <bool TRANSPOSE>
__device__ __forceinline__ void stmatrix_x4(uint32_t address, const uint32_t (&regs)[fragment::QUADRANTS]) {
  if constexpr (TRANSPOSE) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :
                 : "r"(address), "r"(regs[0]), "r"(regs[1]), "r"(regs[2]), "r"(regs[3])
                 : "memory");
  } else {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :
                 : "r"(address), "r"(regs[0]), "r"(regs[1]), "r"(regs[2]), "r"(regs[3])
                 : "memory");
  }
}

__device__ __forceinline__ float ld_shared(uint32_t address) {
  float value;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(value) : "r"(address) : "memory");
  return value;
}
__device__ __forceinline__ float2 ld_shared_pair(uint32_t address) {
  float2 value;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(value.x), "=f"(value.y) : "r"(address) : "memory");
  return value;
}
__device__ __forceinline__ void st_shared(uint32_t address, float value) {
  asm volatile("st.shared.f32 [%0], %1;\n" : : "r"(address), "f"(value) : "memory");
}
__device__ __forceinline__ void st_shared_pair(uint32_t address, float2 value) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" : : "r"(address), "f"(value.x), "f"(value.y) : "memory");
}

// The shared-tile coordinates of the line this lane names to ldmatrix/stmatrix for base tile
// (br, bc): lane l names line l % CORE of quadrant l / CORE, whose registers come back as regs[q].
__device__ __forceinline__ fragment::coord matrix_line(int br, int bc) {
  const int q = lane_id() / fragment::CORE;
  return {BASE_TILE * br + fragment::CORE * fragment::row_half(q) + lane_id() % fragment::CORE,
          BASE_TILE * bc + fragment::CORE * fragment::col_half(q)};
}

// Element (row, col) of S at this lane's pair element e in quadrant q of base tile (br, bc) of a
// tile of layout L placed at (row0, col0).
template <register_layout L, shared_tile_like S>
__device__ __forceinline__ uint32_t pair_element_address(const S& tile, int row0, int col0, int br, int bc, int q, int e) {
  const fragment::coord at = fragment::pair_element_coord<L>(q, e);
  return element_address(tile, row0 + BASE_TILE * br + at.row, col0 + BASE_TILE * bc + at.col);
}

}  // namespace detail

template <register_tile_type D, shared_tile_like S>
__device__ __forceinline__ void load(D& dst, const S& src, int row0 = 0, int col0 = 0) {
  static_assert(D::rows <= S::rows && D::cols <= S::cols, "load: the register tile must fit in the shared tile");
  constexpr bool col_layout = D::layout == register_layout::col;
  if constexpr (is_16bit_float<typename S::element>) {
    for_each_base_tile<D>([&](int br, int bc) {
      const fragment::coord line = detail::matrix_line(br, bc);
      uint32_t regs[fragment::QUADRANTS];
      detail::ldmatrix_x4<col_layout>(regs, detail::element_address(src, row0 + line.row, col0 + line.col));
#pragma unroll
      for (int q = 0; q < fragment::QUADRANTS; ++q) {
        dst.pairs[br][bc][q] =
            convert_pair<typename D::pair_type>(pair_from_bits<packed_pair_t<typename S::element>>(regs[q]));
      }
    });
  } else {
    for_each_pair<D>([&](int br, int bc, int q) {
      const auto address = [&](int e) {
        return detail::pair_element_address<D::layout>(src, row0, col0, br, bc, q, e);
      };
      float2 pair;
      if constexpr (col_layout) {
        pair = {detail::ld_shared(address(0)), detail::ld_shared(address(1))};
      } else {  // a row pair is 8 bytes at an even column: inside one 16-byte chunk
        pair = detail::ld_shared_pair(address(0));
      }
      dst.pairs[br][bc][q] = convert_pair<typename D::pair_type>(pair);
    });
  }
}

template <shared_tile_like S, register_tile_type T>
__device__ __forceinline__ void store(S& dst, const T& src, int row0 = 0, int col0 = 0) {
  static_assert(T::rows <= S::rows && T::cols <= S::cols, "store: the register tile must fit in the shared tile");
  constexpr bool col_layout = T::layout == register_layout::col;
  if constexpr (is_16bit_float<typename S::element>) {
    for_each_base_tile<T>([&](int br, int bc) {
      uint32_t regs[fragment::QUADRANTS];
#pragma unroll
      for (int q = 0; q < fragment::QUADRANTS; ++q) {
        regs[q] = pair_bits(convert_pair<packed_pair_t<typename S::element>>(src.pairs[br][bc][q]));
      }
      const fragment::coord line = detail::matrix_line(br, bc);
      detail::stmatrix_x4<col_layout>(detail::element_address(dst, row0 + line.row, col0 + line.col), regs);
    });
  } else {
    for_each_pair<T>([&](int br, int bc, int q) {
      const auto address = [&](int e) {
        return detail::pair_element_address<T::layout>(dst, row0, col0, br, bc, q, e);
      };
      const float2 pair = convert_pair<float2>(src.pairs[br][bc][q]);
      if constexpr (col_layout) {
        detail::st_shared(address(0), pair.x);
        detail::st_shared(address(1), pair.y);
      } else {
        detail::st_shared_pair(address(0), pair);
      }
    });
  }
}

}  // namespace warp
}  // namespace tk
