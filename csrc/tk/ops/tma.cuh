// The Tensor Memory Accelerator (bulk tensor copies) between global layouts and shared tiles.
//
// One instruction moves one box: Tile::box_rows rows of one panel of a tile (see shared_tile.cuh),
// so moving a tile issues panels x boxes_per_panel copies. Coordinates are element indices of the
// tile's first row and column, outermost dimension first, matching global_layout::shape: {row, col}
// for a matrix, {batch, head, row, col} for a 4-D layout. Boxes that cross the layout's edge are
// zero-filled on load and clipped on store by the hardware.
//
// Loads complete on an mbarrier (whose phase expects `Tile::bytes`: the full box is always
// counted, padding included). Stores form bulk groups: commit_stores() closes one and
// wait_stores_read<n>() waits until at most n groups still read shared memory.
#pragma once

#include <cuda.h>

#include "../common.cuh"
#include "../sync/mbarrier.cuh"
#include "../types/shared_tile.cuh"

namespace tk::tma {

namespace detail {

// Inner-first hardware coordinates of box `b` of panel `p` of a tile at `index` (outermost first).
template <typename Tile, int RANK>
struct box_coordinates {
  int c[RANK];
  __device__ box_coordinates(const int (&index)[RANK], int p, int b) {
    c[0] = index[RANK - 1] + p * Tile::panel_cols;
    c[1] = index[RANK - 2] + b * Tile::box_rows;
    for (int d = 2; d < RANK; ++d) c[d] = index[RANK - 1 - d];
  }
};

// Shared address of box `b` of panel `p`: boxes stack rows inside their panel.
template <typename Tile>
__device__ __forceinline__ uint32_t box_address(const Tile& tile, int p, int b) {
  return shared_address(tile.panel(p)) + uint32_t(b * Tile::box_rows * Tile::swizzle_bytes);
}

template <int RANK>
__device__ __forceinline__ void load_box(uint32_t dst, const CUtensorMap* map, uint32_t bar, const int (&c)[RANK]) {
  const uint64_t m = reinterpret_cast<uint64_t>(map);
  if constexpr (RANK == 2) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
        ::"r"(dst), "l"(m), "r"(bar), "r"(c[0]), "r"(c[1]) : "memory");
  } else if constexpr (RANK == 3) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
        ::"r"(dst), "l"(m), "r"(bar), "r"(c[0]), "r"(c[1]), "r"(c[2]) : "memory");
  } else if constexpr (RANK == 4) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
        ::"r"(dst), "l"(m), "r"(bar), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]) : "memory");
  } else {
    static_assert(RANK == 5, "TMA boxes have 2 to 5 dimensions here");
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];"
        ::"r"(dst), "l"(m), "r"(bar), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]) : "memory");
  }
}

template <int RANK>
__device__ __forceinline__ void store_box(const CUtensorMap* map, uint32_t src, const int (&c)[RANK]) {
  const uint64_t m = reinterpret_cast<uint64_t>(map);
  if constexpr (RANK == 2) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"(m), "r"(src), "r"(c[0]), "r"(c[1]) : "memory");
  } else if constexpr (RANK == 3) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];"
                 ::"l"(m), "r"(src), "r"(c[0]), "r"(c[1]), "r"(c[2]) : "memory");
  } else if constexpr (RANK == 4) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 ::"l"(m), "r"(src), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]) : "memory");
  } else {
    static_assert(RANK == 5, "TMA boxes have 2 to 5 dimensions here");
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];"
                 ::"l"(m), "r"(src), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]) : "memory");
  }
}

template <int RANK>
__device__ __forceinline__ void prefetch_box(const CUtensorMap* map, const int (&c)[RANK]) {
  const uint64_t m = reinterpret_cast<uint64_t>(map);
  if constexpr (RANK == 2) {
    asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"(m), "r"(c[0]), "r"(c[1])
                 : "memory");
  } else if constexpr (RANK == 3) {
    asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];" ::"l"(m), "r"(c[0]),
                 "r"(c[1]), "r"(c[2]) : "memory");
  } else if constexpr (RANK == 4) {
    asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];" ::"l"(m), "r"(c[0]),
                 "r"(c[1]), "r"(c[2]), "r"(c[3]) : "memory");
  } else {
    static_assert(RANK == 5, "TMA boxes have 2 to 5 dimensions here");
    asm volatile("cp.async.bulk.prefetch.tensor.5d.L2.global.tile [%0, {%1, %2, %3, %4, %5}];" ::"l"(m), "r"(c[0]),
                 "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]) : "memory");
  }
}

}  // namespace detail

// Pull the descriptor into the constant cache before its first use (one thread).
__device__ __forceinline__ void prefetch_descriptor(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}

// Load the tile whose first element is at `index`; completes `Tile::bytes` on `bar`. One thread.
template <typename Tile, int RANK>
__device__ __forceinline__ void load(Tile& dst, const CUtensorMap& map, mbarrier& bar, const int (&index)[RANK]) {
  const uint32_t bar_address = shared_address(&bar);
#pragma unroll
  for (int p = 0; p < Tile::panels; ++p) {
#pragma unroll
    for (int b = 0; b < Tile::boxes_per_panel; ++b) {
      detail::box_coordinates<Tile, RANK> box(index, p, b);
      detail::load_box<RANK>(detail::box_address(dst, p, b), &map, bar_address, box.c);
    }
  }
}

// Store the tile to `index` (clipped at the layout's edges). One thread; closes no group.
template <typename Tile, int RANK>
__device__ __forceinline__ void store(const CUtensorMap& map, const Tile& src, const int (&index)[RANK]) {
#pragma unroll
  for (int p = 0; p < Tile::panels; ++p) {
#pragma unroll
    for (int b = 0; b < Tile::boxes_per_panel; ++b) {
      detail::box_coordinates<Tile, RANK> box(index, p, b);
      detail::store_box<RANK>(&map, detail::box_address(src, p, b), box.c);
    }
  }
}

// Warm L2 with the tile at `index` without touching shared memory.
template <typename Tile, int RANK>
__device__ __forceinline__ void prefetch(const CUtensorMap& map, const int (&index)[RANK]) {
#pragma unroll
  for (int p = 0; p < Tile::panels; ++p) {
#pragma unroll
    for (int b = 0; b < Tile::boxes_per_panel; ++b) {
      detail::box_coordinates<Tile, RANK> box(index, p, b);
      detail::prefetch_box<RANK>(&map, box.c);
    }
  }
}

// Alignment of both ends of a bulk (non-tensor) copy or reduction, and the granule of its size.
constexpr int BULK_ALIGNMENT_BYTES = 16;

// dst[i] += src[i] for `bytes` of floats from shared to global memory, element-wise and atomic per
// element (a bulk reduction: the copy engine does the adds, so the issuing warp moves on). One
// thread; joins the thread's open bulk group like a store. Both addresses and bytes are multiples of
// BULK_ALIGNMENT_BYTES.
__device__ __forceinline__ void reduce_add(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               ::"l"(dst), "r"(shared_address(src)), "r"(bytes)
               : "memory");
}

// Close the bulk group of the stores issued so far by this thread.
__device__ __forceinline__ void commit_stores() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Wait until at most `PENDING` of this thread's store groups still read their shared source.
template <int PENDING>
__device__ __forceinline__ void wait_stores_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(PENDING) : "memory");
}

// Wait until at most `PENDING` of this thread's store groups are still writing global memory.
template <int PENDING>
__device__ __forceinline__ void wait_stores() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(PENDING) : "memory");
}

}  // namespace tk::tma
