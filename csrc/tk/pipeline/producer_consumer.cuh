// The load-compute-store-finish template: a kernel is a plan plus hooks that read like its
// algorithm; the template supplies shared memory, barriers, the register split, the task loop and
// the stage bookkeeping (built from block.cuh, stage_ring.cuh and tile_scheduler.cuh, which kernels
// that do not fit it use directly).
//
//   producer (warpgroup 0, one thread)   per task: the resident tiles, once; then each iteration's
//                                        stage, part by part, into a ring of `stages`
//   consumers (warpgroups 1..n)          per task: compute, the mainloop, which waits for and
//                                        releases each stage part itself (so it decides how long a
//                                        stage stays in use); store, the epilogue
//
// A kernel K supplies (members in brackets are optional):
//   plan        stages, consumer_warpgroups, producer_registers, consumer_registers, [blocks_per_sm]
//   params      the __grid_constant__ kernel argument
//   tasks(params) -> task order (tile_scheduler.cuh), __host__ __device__. The grid is one block per
//               task or persistent (launch's `grid`): kernels are correct for both
//   iterations(params, task) -> stages the task consumes (>= 0): GEMM's K steps, attention's visible
//               key blocks, a sequence's chunks
//   stage, stage_bytes[]   the tiles of one stage, and the bytes each separately released part of
//               it delivers (one entry, unless consumers release parts at different times)
//   load(params, task, iteration, part, stage&, mbarrier& full)           producer thread
//   [prefetch(params)]   producer thread, once (e.g. the TMA descriptors into the cache)
//   [resident, resident_bytes, load_resident(params, task, resident&, mbarrier& full)]
//               tiles loaded once per task (attention's Q); store may reuse them as staging, and the
//               next task's resident load waits until every consumer's store has returned
//   [scratch]   shared memory the consumers keep across iterations and tasks (running states,
//               epilogue staging), synchronised by the kernel
//   [init(params, scratch&, consumer)]   once per consumer warpgroup, before its first task
//   consumer_state   registers a consumer warpgroup keeps (accumulators), constructed once
//   compute(const task_context<K>&, consumer_state&, stage_inputs<K>&)   ctx.iterations stages
//   [store(const task_context<K>&, consumer_state&)]                       the task's epilogue
//   [finish(params, scratch&, consumer)]                                   before the block exits
//
// An optional hook that a kernel leaves out is not called (the has_* concepts below detect them):
// a kernel whose compute stores its own results as it goes writes no empty store. The concept
// pipeline_kernel<K> is this list; launch checks it part by part, so that a kernel is told which
// member it lacks, and a member named like an optional hook but not callable as one (say, a store
// taking its context by non-const reference) is an error, not a hook silently skipped.
//
// Kernels that share a plan and tiles (a backward's two gradient kernels) are best members of the
// shared class template, defined out of line and deriving from it (linear_attention_bwd.cu): their
// hooks then name its members directly, where a kernel merely deriving from it would have to
// re-declare each one (members of a dependent base are not found by unqualified lookup).
#pragma once

#include <cuda_runtime.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <utility>

#include "../common.cuh"
#include "../sync/fence.cuh"
#include "../sync/mbarrier.cuh"
#include "block.cuh"
#include "stage_ring.cuh"
#include "tile_scheduler.cuh"

namespace tk::pipeline {

struct none {};

namespace detail {
template <typename K> struct resident_type { using type = none; };
template <typename K> requires requires { typename K::resident; } struct resident_type<K> { using type = typename K::resident; };
template <typename K> struct scratch_type { using type = none; };
template <typename K> requires requires { typename K::scratch; } struct scratch_type<K> { using type = typename K::scratch; };
}  // namespace detail

template <typename K> using resident_of = typename detail::resident_type<K>::type;
template <typename K> using scratch_of = typename detail::scratch_type<K>::type;
template <typename K> constexpr bool has_resident = !std::is_same_v<resident_of<K>, none>;
template <typename K> using task_of = typename task_scheduler<decltype(K::tasks(std::declval<typename K::params>()))>::task_type;
template <typename K> constexpr int stage_parts = int(std::size(K::stage_bytes));
template <typename K> using ring_of = stage_ring<K::stages, stage_parts<K>>;
// A constant, so device code never needs the array itself.
template <typename K, int PART> constexpr uint32_t part_bytes = K::stage_bytes[PART];

template <typename K>
struct kernel_storage {
  typename K::stage stages[K::stages];
  [[no_unique_address]] resident_of<K> resident;
  [[no_unique_address]] scratch_of<K> scratch;
  ring_of<K> ring;
  mbarrier resident_full;  // the task's resident tiles have landed
  mbarrier resident_free;  // every consumer warp is done with them
};

// What a consumer hook knows about the task at hand.
template <typename K>
struct task_context {
  const typename K::params& params;
  task_of<K> task;
  int iterations;
  int consumer;  // this consumer warpgroup's index, 0 .. consumer_warpgroups - 1
  resident_of<K>& resident;
  scratch_of<K>& scratch;
};

// The consumers' side of the ring for one task: iteration i's stage is at first().advanced_by(i).
template <typename K>
struct stage_inputs {
  using position = typename ring_of<K>::position;

  typename K::stage* stages;
  ring_of<K>& ring;
  position start;

  __device__ position first() const { return start; }
  __device__ const typename K::stage& wait(position at, int part = 0) const {
    ring.wait(at, part);
    return stages[at.stage];
  }
  __device__ void release(position at, int part = 0) const { ring.release(at, part); }
};

// The optional hooks, each detected by its call.
template <typename K>
concept has_prefetch = requires(const typename K::params& params) { K::prefetch(params); };
template <typename K>
concept has_init = requires(const typename K::params& params, scratch_of<K>& scratch, int consumer) {
  K::init(params, scratch, consumer);
};
template <typename K>
concept has_store = requires(const task_context<K>& ctx, typename K::consumer_state& state) { K::store(ctx, state); };
template <typename K>
concept has_finish = requires(const typename K::params& params, scratch_of<K>& scratch, int consumer) {
  K::finish(params, scratch, consumer);
};

// The required members.
template <typename K>
concept has_plan = requires {
  { K::stages } -> std::convertible_to<int>;
  { K::consumer_warpgroups } -> std::convertible_to<int>;
  { K::producer_registers } -> std::convertible_to<int>;
  { K::consumer_registers } -> std::convertible_to<int>;
};
template <typename K>
concept has_tasks = requires(const typename K::params& params, const task_of<K>& task) {
  { K::iterations(params, task) } -> std::convertible_to<int>;
};
template <typename K>
concept has_stage_loads = requires(const typename K::params& params, const task_of<K>& task, int iteration, int part,
                                   typename K::stage& stage, mbarrier& full) {
  { K::stage_bytes[0] } -> std::convertible_to<uint32_t>;
  K::load(params, task, iteration, part, stage, full);
};
template <typename K>
concept has_compute = requires(const task_context<K>& ctx, typename K::consumer_state& state, stage_inputs<K>& inputs) {
  K::compute(ctx, state, inputs);
};
template <typename K>
concept has_resident_loads = requires(const typename K::params& params, const task_of<K>& task,
                                      resident_of<K>& resident, mbarrier& full) {
  { K::resident_bytes } -> std::convertible_to<uint32_t>;
  K::load_resident(params, task, resident, full);
};
template <typename K>
concept resident_loads_if_resident = !has_resident<K> || has_resident_loads<K>;

// A member named like an optional hook must be callable as that hook, which the template would
// otherwise skip without a word. (&K::hook names one non-template member; an overloaded or
// templated one is left to its has_* concept.)
template <typename K> concept prefetch_if_named = !requires { &K::prefetch; } || has_prefetch<K>;
template <typename K> concept init_if_named = !requires { &K::init; } || has_init<K>;
template <typename K> concept store_if_named = !requires { &K::store; } || has_store<K>;
template <typename K> concept finish_if_named = !requires { &K::finish; } || has_finish<K>;

// The whole contract; launch checks it part by part, so that a kernel is told what it lacks.
template <typename K>
concept pipeline_kernel = has_plan<K> && has_tasks<K> && has_stage_loads<K> && has_compute<K> &&
                          resident_loads_if_resident<K> && prefetch_if_named<K> && init_if_named<K> &&
                          store_if_named<K> && finish_if_named<K>;

template <typename K>
constexpr void check_pipeline_kernel() {
  static_assert(has_plan<K>, "the plan needs stages, consumer_warpgroups, producer_registers, consumer_registers");
  static_assert(has_tasks<K>, "the kernel needs tasks(params), a task order, and iterations(params, task) -> int");
  static_assert(has_stage_loads<K>,
                "the kernel needs stage, stage_bytes[] and load(params, task, iteration, part, stage&, mbarrier&)");
  static_assert(has_compute<K>,
                "the kernel needs compute(const task_context<K>&, consumer_state&, stage_inputs<K>&)");
  static_assert(resident_loads_if_resident<K>,
                "resident tiles need resident_bytes and load_resident(params, task, resident&, mbarrier&)");
  static_assert(prefetch_if_named<K>, "prefetch is not callable as the hook prefetch(params)");
  static_assert(init_if_named<K>, "init is not callable as the hook init(params, scratch&, consumer)");
  static_assert(store_if_named<K>, "store is not callable as the hook store(const task_context<K>&, consumer_state&)");
  static_assert(finish_if_named<K>, "finish is not callable as the hook finish(params, scratch&, consumer)");
}

template <typename K>
__global__ void __launch_bounds__(block_threads<K>, blocks_per_sm<K>()) producer_consumer_kernel(const __grid_constant__ typename K::params params) {
  static_assert(K::stages >= 1, "at least one stage");
  kernel_storage<K>& smem = block_storage<kernel_storage<K>>();
  constexpr int consumer_warps = K::consumer_warpgroups * WARPGROUP_WARPS;
  if (threadIdx.x == 0) {
    smem.ring.init(consumer_warps);
    smem.resident_full.init(1);
    smem.resident_free.init(consumer_warps);
    fence_barrier_init();
  }
  __syncthreads();
  const task_scheduler<decltype(K::tasks(params))> scheduler{K::tasks(params)};

  warp_specialized<K>(
      [&] {
        if constexpr (has_prefetch<K>) K::prefetch(params);
        typename ring_of<K>::position write;
        uint32_t task_parity = 0;
        for (auto work = scheduler.first(); scheduler.valid(work); work = scheduler.next(work), task_parity ^= 1) {
          if constexpr (has_resident<K>) {
            // The previous task's stores are done with the resident tiles (a fresh barrier lets the first pass).
            smem.resident_free.wait(task_parity ^ 1);
            smem.resident_full.arrive_expect_tx(K::resident_bytes);
            K::load_resident(params, work.task, smem.resident, smem.resident_full);
          }
          const int iterations = K::iterations(params, work.task);
          for (int i = 0; i < iterations; ++i, write.advance()) {
            [&]<int... PART>(std::integer_sequence<int, PART...>) {
              ((K::load(params, work.task, i, PART, smem.stages[write.stage],
                        smem.ring.acquire(write, part_bytes<K, PART>, PART))),
               ...);
            }(std::make_integer_sequence<int, stage_parts<K>>{});
          }
        }
      },
      [&](int consumer) {
        if constexpr (has_init<K>) K::init(params, smem.scratch, consumer);
        typename K::consumer_state state;
        typename ring_of<K>::position read;
        uint32_t task_parity = 0;
        for (auto work = scheduler.first(); scheduler.valid(work); work = scheduler.next(work), task_parity ^= 1) {
          const task_context<K> ctx{params, work.task, K::iterations(params, work.task), consumer, smem.resident,
                                    smem.scratch};
          if constexpr (has_resident<K>) smem.resident_full.wait(task_parity);
          stage_inputs<K> inputs{smem.stages, smem.ring, read};
          K::compute(ctx, state, inputs);
          if constexpr (has_store<K>) K::store(ctx, state);
          read = read.advanced_by(ctx.iterations);
          if constexpr (has_resident<K>) {
            __syncwarp();
            if (lane_id() == 0) smem.resident_free.arrive();
          }
        }
        if constexpr (has_finish<K>) K::finish(params, smem.scratch, consumer);
      });
}

template <typename K>
constexpr size_t kernel_shared_bytes = shared_bytes<kernel_storage<K>>;

// Launch K on `grid` blocks: K::tasks(params).count() for one block per task, or persistent_grid().
template <typename K>
cudaError_t launch(const typename K::params& params, int grid, cudaStream_t stream) {
  check_pipeline_kernel<K>();
  return launch(producer_consumer_kernel<K>, dim3(grid), block_threads<K>, kernel_shared_bytes<K>, stream, params);
}

}  // namespace tk::pipeline
