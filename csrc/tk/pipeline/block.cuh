// What every warp-specialised block needs, whether or not its kernel is written on the template
// (producer_consumer.cuh):
//
//   block_storage<Storage>()            the block's dynamic shared memory as a Storage, aligned to
//                                       the swizzle period every TMA/wgmma tile needs
//   shared_bytes<Storage>               the dynamic shared memory to request for it
//   warp_specialized<Plan>(producer, consumer)
//                                       the role split: warpgroup 0 gives registers back and one of
//                                       its threads runs producer(); every other warpgroup takes
//                                       them and runs consumer(index)
//   launch(kernel, grid, block, shared bytes, stream, args...)
//                                       on a stream, the kernel's shared-memory limit raised when a
//                                       launch needs more than it allows so far
//   resident_blocks_per_sm(&blocks, kernel, threads, shared bytes)
//                                       the occupancy query, answered once per kernel and device
//
// A Plan names consumer_warpgroups, producer_registers and consumer_registers, and optionally
// blocks_per_sm (default 1): how many of its blocks must fit one SM's register file together.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "../common.cuh"
#include "../ops/warpgroup/registers.cuh"
#include "../types/shared_tile.cuh"

namespace tk::pipeline {

// Dynamic shared memory one Hopper block may opt into (227 KB).
constexpr size_t MAX_SHARED_BYTES_PER_BLOCK = 227 * 1024;
// An SM's shared memory, which the blocks resident on it share (228 KB on sm_90).
constexpr size_t MAX_SHARED_BYTES_PER_SM = 228 * 1024;

// The storage plus room to align its start to a swizzle period.
template <typename Storage>
constexpr size_t shared_bytes = sizeof(Storage) + SWIZZLE_PERIOD_BYTES;

template <typename Storage>
__device__ __forceinline__ Storage& block_storage() {
  static_assert(shared_bytes<Storage> <= MAX_SHARED_BYTES_PER_BLOCK, "the block's tiles exceed shared memory");
  extern __shared__ uint8_t shared_raw[];
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(shared_raw) + SWIZZLE_PERIOD_BYTES - 1) &
                            ~uintptr_t(SWIZZLE_PERIOD_BYTES - 1);
  return *reinterpret_cast<Storage*>(aligned);
}

template <typename Plan>
constexpr int block_threads = (1 + Plan::consumer_warpgroups) * WARPGROUP_THREADS;

template <typename Plan>
constexpr int blocks_per_sm() {
  if constexpr (requires { Plan::blocks_per_sm; }) {
    return Plan::blocks_per_sm;
  } else {
    return 1;
  }
}

template <typename Plan>
constexpr bool fits_register_file() {
  return (Plan::producer_registers * WARPGROUP_THREADS +
          Plan::consumer_registers * Plan::consumer_warpgroups * WARPGROUP_THREADS) *
             blocks_per_sm<Plan>() <=
         warpgroup::REGISTER_FILE;
}

// setmaxnreg needs each role to be one branch of a single if/else, under a register cap at entry
// (__launch_bounds__(block_threads<Plan>, blocks_per_sm<Plan>()) on the kernel).
// The consumer index is broadcast from lane 0 so the compiler knows it is warp-uniform: loops whose
// trip counts depend on it (rows that need masks) then keep their ring positions and wgmma
// descriptors in uniform registers instead of moving them there before every wgmma.
template <typename Plan, typename Producer, typename Consumer>
__device__ __forceinline__ void warp_specialized(Producer&& producer, Consumer&& consumer) {
  static_assert(fits_register_file<Plan>(), "the register split exceeds the register file");
  const int warpgroup = __shfl_sync(ALL_LANES, warpgroup_id(), 0);
  if (warpgroup == 0) {
    warpgroup::decrease_registers<Plan::producer_registers>();
    if (warp_in_warpgroup() == 0 && lane_id() == 0) producer();
  } else {
    warpgroup::increase_registers<Plan::consumer_registers>();
    consumer(warpgroup - 1);
  }
}

// Raise `kernel`'s dynamic shared-memory limit on the current device to at least `bytes`. The limit set
// is kept per (kernel, device) and set again only when a launch needs more: a kernel whose shared memory
// depends on the call (the norms' backward sums one or two parameter gradients) must not be held to
// what its first call asked for, since setting the attribute also lowers the limit to it. Keyed by the
// kernel's address, so extensions built from the same headers never share an entry.
inline cudaError_t allow_shared_bytes(const void* kernel, size_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> limits;
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = limits.find({kernel, device});
  if (found != limits.end() && found->second >= bytes) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (err == cudaSuccess) limits[{kernel, device}] = bytes;
  return err;
}

// Into *blocks: how many blocks of `kernel` with `threads` threads and `shared_bytes` of dynamic shared
// memory one SM of the current device holds at once. The occupancy query costs microseconds of host
// time, and its answer never changes: asked once per (kernel, device, threads, bytes).
inline cudaError_t resident_blocks_per_sm(int* blocks, const void* kernel, int threads, size_t shared_bytes) {
  using key = std::tuple<const void*, int, int, size_t>;
  static std::mutex mutex;
  static std::map<key, int> answers;
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const key k{kernel, device, threads, shared_bytes};
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto found = answers.find(k); found != answers.end()) {
    *blocks = found->second;
    return cudaSuccess;
  }
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, threads, shared_bytes);
  if (err == cudaSuccess) answers.emplace(k, *blocks);
  return err;
}

template <typename... Params>
cudaError_t resident_blocks_per_sm(int* blocks, void (*kernel)(Params...), int threads, size_t shared_bytes) {
  return resident_blocks_per_sm(blocks, reinterpret_cast<const void*>(kernel), threads, shared_bytes);
}

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                   Args&&... args) {
  if (const cudaError_t err = allow_shared_bytes(reinterpret_cast<const void*>(kernel), shared_bytes); err != cudaSuccess) {
    return err;
  }
  kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
  return cudaGetLastError();
}

}  // namespace tk::pipeline
