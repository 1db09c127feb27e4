// Which output tiles a persistent block works on, and in what order.
//
// The grid has one block per SM (read from the device, never assumed); block b takes tiles
// b, b + grid, b + 2 grid, ... of a grouped order: tile rows are taken `group_rows` at a time and,
// inside a group, tiles go down a column before moving right. The blocks running together then
// share a few rows of A and columns of B, which stay in L2.
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

template <typename Order>
struct persistent_scheduler {
  Order order;

  struct work {
    int index;
    output_tile tile;
  };

  __device__ bool valid(const work& w) const { return w.index < order.count(); }
  __device__ work first() const { return at(blockIdx.x); }
  __device__ work next(const work& w) const { return at(w.index + gridDim.x); }

 private:
  __device__ work at(int index) const {
    return {index, index < order.count() ? order.at(index) : output_tile{0, 0}};
  }
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

// A persistent grid: one block per SM, fewer when there are fewer tiles.
inline int persistent_grid(int tiles, int device) { return std::min(tiles, sm_count(device)); }

}  // namespace tk::pipeline
