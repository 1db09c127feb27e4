// Launchers of the tile-core test kernels (tests/core/core_kernels.cu); no torch here.
#pragma once

#include <cuda_runtime.h>

namespace tk::core_tests {

enum class element { bf16, fp16, fp32 };

// Load the 64 x tile_cols tile at (row0, col0) of `in` (rows x cols, rows in_row_stride elements
// apart) into shared memory in boxes of box_rows (64 or 16) rows, copy it element-wise to `dense`
// (64 x tile_cols) and TMA-store it to the same place of `out` (rows x cols, out_row_stride apart).
struct round_trip_args {
  element dtype;
  const void* in;
  void* out;
  void* dense;
  int rows, cols, in_row_stride, out_row_stride;
  int tile_cols, box_rows;
  int row0, col0;
};
cudaError_t tma_round_trip(const round_trip_args& args, cudaStream_t stream);

// out32 = A (64 x 64) * B (64 x n) in fp32 and out16 = out32 + bias in the input type, with A and
// B stored K-major (A: 64 x 64 row-major; B: n x 64) or MN-major (A: K x M; B: 64 x n), or A read
// from registers (stored row-major).
struct product_args {
  element dtype;
  int n;
  const void* a;
  const void* b;
  const void* bias;
  bool a_mn_major, b_mn_major, a_in_registers;
  float* out32;
  void* out16;
};
cudaError_t wgmma_product(const product_args& args, cudaStream_t stream);

// The producer/consumer template with every hook (core_kernels.cu, pipeline_sum_kernel): over work
// tiles of iterations x 64 rows by 64 columns, out (tiles_m x cols, fp32) = column sums of x + 2 y
// (rows x cols, bf16) plus 3 x the column sums of z's 64-row block per tile (z: tiles_m * 64 x cols,
// bf16), and tasks_before (tiles_m x tiles_n, int32) = the tasks a block ran before each tile; on
// `grid` blocks.
struct pipeline_sum_args {
  const void* x;
  const void* y;
  const void* z;
  float* out;
  int* tasks_before;
  int rows, cols, iterations;
  int stages, consumers, group_rows, grid;
};
cudaError_t pipeline_sums(const pipeline_sum_args& args, cudaStream_t stream);

// The producer/consumer template with its required hooks only (core_kernels.cu, bare_sum_kernel):
// out (tiles_m x cols, fp32) = column sums of x (rows x cols, bf16) over work tiles of iterations x
// 64 rows, written by compute itself; on `grid` blocks.
cudaError_t pipeline_bare_sums(const void* x, float* out, int rows, int cols, int iterations, int grid,
                               cudaStream_t stream);

// One warpgroup writes `tiles` 64 x 64 fp32 tiles through a store ring of `slots` (1 to 3) staging
// tiles and TMA-stores tile t to rows 64 t of `out` (64 tiles x 64, contiguous); element (r, c) of
// tile t is 4096 t + 64 r + c.
cudaError_t store_ring_tiles(float* out, int tiles, int slots, cudaStream_t stream);

// Two warpgroups each write half of a 64 x 64 fp32 tile with ordinary stores and publish it; one
// thread TMA-stores the whole tile to `out` (64 x 64, contiguous): element (r, c) is 64 r + c.
cudaError_t publish_tile(float* out, cudaStream_t stream);

// `members` warpgroups (1 to 3) take `rounds` turns each in a turn rotation; order (members x
// rounds int32) receives the warpgroup that took each turn, in the order they were taken.
cudaError_t turn_order(int* order, int members, int rounds, cudaStream_t stream);

}  // namespace tk::core_tests
