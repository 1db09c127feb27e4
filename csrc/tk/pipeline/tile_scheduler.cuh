// Which tasks a block works on, and in what order.
//
// A task order maps an index to a task (count(), at(index)); a block takes tasks b, b + grid,
// b + 2 grid, ... So a grid of one block per task runs each task on its own block, and a persistent
// grid (one block per SM, read from the device, never assumed) strides over them; kernels are
// written once for both.
//
//   grouped_tile_order   output tiles of a matrix product: tile rows are taken `group_rows` at a
//                        time and, inside a group, tiles go down a column before moving right, so
//                        the blocks running together share a few rows of A and columns of B in L2
//   head_block_order     blocks of the sequences of a (batch, head) grid: consecutive tasks are
//                        consecutive blocks of one head, which share its keys and values in L2
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <stdexcept>
#include <string>

#include "../common.cuh"

namespace tk::pipeline {

struct output_tile {
  int row;  // tile index along M
  int col;  // tile index along N
};

struct grouped_tile_order {
  int tiles_m;
  int tiles_n;
  int group_rows;

  __host__ __device__ int count() const { return tiles_m * tiles_n; }

  __host__ __device__ output_tile at(int index) const {
    const int tiles_per_group = group_rows * tiles_n;
    const int group = index / tiles_per_group;
    const int first_row = group * group_rows;
    const int rows_in_group = min(group_rows, tiles_m - first_row);
    const int in_group = index - group * tiles_per_group;
    return {first_row + in_group % rows_in_group, in_group / rows_in_group};
  }
};

struct head_block {
  int batch;
  int head;
  int block;  // along the sequence
};

struct head_block_order {
  int blocks;  // per sequence
  int heads;
  int batches;
  // A head's blocks from the last to the first: under a causal mask the last see the most keys, so
  // the longest tasks start first and the grid ends on short ones.
  bool last_block_first;

  __host__ __device__ int count() const { return blocks * heads * batches; }

  __host__ __device__ head_block at(int index) const {
    const int block = index % blocks;
    const int sequence = index / blocks;
    return {sequence / heads, sequence % heads, last_block_first ? blocks - 1 - block : block};
  }
};

template <typename Order>
struct task_scheduler {
  Order order;
  using task_type = decltype(order.at(0));

  struct work {
    int index;
    task_type task;
  };

  __device__ bool valid(const work& w) const { return w.index < order.count(); }
  __device__ work first() const { return at(blockIdx.x); }
  __device__ work next(const work& w) const { return at(w.index + gridDim.x); }

 private:
  __device__ work at(int index) const { return {index, index < order.count() ? order.at(index) : task_type{}}; }
};

constexpr int MAX_CACHED_DEVICES = 64;

// Streaming multiprocessors of `device`, read once per device.
inline int sm_count(int device) {
  static std::array<std::atomic<int>, MAX_CACHED_DEVICES> cached{};  // 0: not read yet
  const bool cacheable = device >= 0 && device < MAX_CACHED_DEVICES;
  if (cacheable) {
    if (const int count = cached[device].load(std::memory_order_relaxed); count > 0) return count;
  }
  int count = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) throw std::runtime_error(std::string("tk: cannot read the SM count: ") + cudaGetErrorString(err));
  if (cacheable) cached[device].store(count, std::memory_order_relaxed);
  return count;
}

// A persistent grid: one block per SM, fewer when there are fewer tasks.
inline int persistent_grid(int tasks, int device) { return std::min(tasks, sm_count(device)); }

}  // namespace tk::pipeline
