// The warp-specialised producer/consumer pipeline every tile kernel is written in.
//
// Warpgroup 0 is the producer: one thread issues TMA loads into a ring of `stages` shared
// buffers. Warpgroups 1..consumers compute from them and write the results. Per stage, `full`
// completes when the loads have landed (arrival + transaction bytes) and `empty` when every
// consumer warp has finished reading. Both sides walk the same sequence of (tile, iteration), so
// stage and phase are a ring position each side advances on its own.
//
// A kernel K supplies the work; the template supplies shared memory, barriers, register split,
// the persistent tile loop and the stage bookkeeping:
//
//   static constexpr int stages, consumer_warpgroups, producer_registers, consumer_registers;
//   static constexpr uint32_t stage_bytes;     // bytes the loads of one stage deliver
//   using params;                               // the __grid_constant__ kernel argument
//   using stage_storage, store_storage;         // one stage's input tiles; consumers' output staging
//   using consumer_state;                       // registers a consumer warpgroup keeps over a tile
//   static scheduler(params) -> persistent_scheduler<...>
//   static iterations(params, tile) -> int      // pipeline stages a tile consumes (>= 1)
//   static prefetch(params)                     // producer thread, once
//   static load(params, tile, iteration, stage_storage&, mbarrier& full)      // producer thread
//   static compute(consumer_state&, const stage_storage&, iteration, consumer) // issue + commit MMAs
//   static store(params, consumer_state&, tile, store_storage&, consumer)     // the tile's epilogue
//   static finish(params, store_storage&, consumer)                            // before exit
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <set>
#include <utility>

#include "../common.cuh"
#include "../ops/warpgroup/registers.cuh"
#include "../ops/warpgroup/wgmma.cuh"
#include "../sync/mbarrier.cuh"
#include "../types/shared_tile.cuh"
#include "tile_scheduler.cuh"

namespace tk::pipeline {

template <int STAGES>
struct ring_position {
  int stage = 0;
  uint32_t phase = 0;  // parity of the lap; flips each time the ring wraps

  __device__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
};

template <typename K>
struct shared_storage {
  typename K::stage_storage stage[K::stages];
  typename K::store_storage store;
  mbarrier full[K::stages];
  mbarrier empty[K::stages];
};

template <typename K>
constexpr int threads = (1 + K::consumer_warpgroups) * WARPGROUP_THREADS;

// Dynamic shared memory to request: the storage plus room to align its start to a swizzle period.
template <typename K>
constexpr size_t shared_bytes = sizeof(shared_storage<K>) + SWIZZLE_PERIOD_BYTES;

// Dynamic shared memory one Hopper block may opt into (227 KB).
constexpr size_t MAX_SHARED_BYTES_PER_BLOCK = 227 * 1024;

template <typename K>
constexpr bool fits_register_file() {
  return K::producer_registers * WARPGROUP_THREADS +
             K::consumer_registers * K::consumer_warpgroups * WARPGROUP_THREADS <=
         warpgroup::REGISTER_FILE;
}

template <typename K>
__global__ void __launch_bounds__(threads<K>, 1) producer_consumer_kernel(const __grid_constant__ typename K::params params) {
  static_assert(K::stages >= 1, "at least one stage");
  static_assert(fits_register_file<K>(), "the register split exceeds the register file");
  static_assert(shared_bytes<K> <= MAX_SHARED_BYTES_PER_BLOCK, "the stages and staging exceed shared memory");
  extern __shared__ uint8_t shared_raw[];
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(shared_raw) + SWIZZLE_PERIOD_BYTES - 1) &
                            ~uintptr_t(SWIZZLE_PERIOD_BYTES - 1);
  auto& smem = *reinterpret_cast<shared_storage<K>*>(aligned);
  constexpr int consumer_warps = K::consumer_warpgroups * WARPGROUP_WARPS;

  if (threadIdx.x == 0) {
    for (int s = 0; s < K::stages; ++s) {
      smem.full[s].init(1);
      smem.empty[s].init(consumer_warps);
    }
    fence_barrier_init();
  }
  __syncthreads();

  const auto scheduler = K::scheduler(params);
  if (warpgroup_id() == 0) {
    warpgroup::decrease_registers<K::producer_registers>();
    if (warp_in_warpgroup() == 0 && lane_id() == 0) {
      K::prefetch(params);
      ring_position<K::stages> write;
      for (auto work = scheduler.first(); scheduler.valid(work); work = scheduler.next(work)) {
        const int iterations = K::iterations(params, work.tile);
        for (int i = 0; i < iterations; ++i, write.advance()) {
          // A fresh barrier counts the phase before its first as complete: the first lap never waits.
          smem.empty[write.stage].wait(write.phase ^ 1);
          smem.full[write.stage].arrive_expect_tx(K::stage_bytes);
          K::load(params, work.tile, i, smem.stage[write.stage], smem.full[write.stage]);
        }
      }
    }
  } else {
    warpgroup::increase_registers<K::consumer_registers>();
    const int consumer = warpgroup_id() - 1;
    // The MMAs of one stage stay in flight while the next stage's are issued, so a stage is
    // released one iteration late; with a single stage there is nothing to overlap with.
    constexpr int in_flight = K::stages > 1 ? 1 : 0;
    typename K::consumer_state state;
    ring_position<K::stages> read;
    ring_position<K::stages> release;
    for (auto work = scheduler.first(); scheduler.valid(work); work = scheduler.next(work)) {
      const int iterations = K::iterations(params, work.tile);
      for (int i = 0; i < iterations; ++i, read.advance()) {
        smem.full[read.stage].wait(read.phase);
        K::compute(state, smem.stage[read.stage], i, consumer);
        warpgroup::wait<in_flight>();
        if (i >= in_flight) {
          if (lane_id() == 0) smem.empty[release.stage].arrive();
          release.advance();
        }
      }
      warpgroup::wait<0>();
      for (int i = 0; i < in_flight && i < iterations; ++i, release.advance()) {
        if (lane_id() == 0) smem.empty[release.stage].arrive();
      }
      K::store(params, state, work.tile, smem.store, consumer);
    }
    K::finish(params, smem.store, consumer);
  }
}

// Raise `kernel`'s dynamic shared-memory limit on the current device, once per (kernel, device).
// Keyed by the kernel's address, so extensions built from the same headers never share an entry.
inline cudaError_t allow_shared_bytes(const void* kernel, size_t bytes) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> configured;
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const std::lock_guard<std::mutex> lock(mutex);
  if (configured.count({kernel, device}) != 0) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (err == cudaSuccess) configured.insert({kernel, device});
  return err;
}

// Launch K over a persistent grid of `grid` blocks on `stream`.
template <typename K>
cudaError_t launch(const typename K::params& params, int grid, cudaStream_t stream) {
  const auto kernel = producer_consumer_kernel<K>;
  if (const cudaError_t err = allow_shared_bytes(reinterpret_cast<const void*>(kernel), shared_bytes<K>);
      err != cudaSuccess) {
    return err;
  }
  kernel<<<grid, threads<K>, shared_bytes<K>, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace tk::pipeline
