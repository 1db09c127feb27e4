// Small kernels that exercise one tile-core primitive each (tests/test_core_pipeline.py):
//   tma_round_trip   TMA prefetch and load into a swizzled tile, read back element-wise, TMA store
//   wgmma_product    64 x N x 64 product from shared operands of either major-ness (+ bias epilogue)
//   wgmma_registers  the same with A from registers
//   pipeline_sums    every hook of the producer/consumer template (two-part stages, a resident tile,
//                    scratch kept across tasks) with 1..4 stages, persistent and one-task grids
//   pipeline_bare_sums the template with only its required hooks (no store, prefetch, init, finish,
//                    resident tiles or scratch)
//   store_ring_tiles tiles written one after another through a TMA store ring of 1..3 slots
//   publish_tile     two warpgroups' ordinary stores, published to one thread's TMA store
//   turn_order       the order in which 1..3 warpgroups take the turns of a turn rotation
//   pipeline_kernel  (compile time) which kernels the template's contract accepts and which it rejects
#include "core_kernels.h"
#include "tk/tk.cuh"

namespace tk::core_tests {
namespace {

using warpgroup::operand_major;

// Calls f.template operator()<T>() for the runtime element type.
template <typename F>
cudaError_t with_element(element e, F&& f) {
  if (e == element::bf16) return f.template operator()<bf16>();
  if (e == element::fp16) return f.template operator()<half>();
  return f.template operator()<float>();
}

// ------------------------------------------------------------------------ TMA round trip

template <typename Tile>
struct round_trip_shared {
  Tile tile;
  mbarrier loaded;
};

template <typename Tile>
__global__ void tma_round_trip_kernel(const __grid_constant__ CUtensorMap in, const __grid_constant__ CUtensorMap out,
                                      typename Tile::element* dense, int row0, int col0) {
  auto& s = pipeline::block_storage<round_trip_shared<Tile>>();
  const int index[2] = {row0, col0};
  if (threadIdx.x == 0) {
    s.loaded.init(1);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tma::prefetch_descriptor(in);
    tma::prefetch<Tile>(in, index);  // an L2 hint: the load below must see the same data either way
    s.loaded.arrive_expect_tx(Tile::bytes);
    tma::load(s.tile, in, s.loaded, index);
  }
  s.loaded.wait(0);
  for (int i = threadIdx.x; i < Tile::rows * Tile::cols; i += blockDim.x) {
    dense[i] = s.tile.at(i / Tile::cols, i % Tile::cols);
  }
  if (threadIdx.x == 0) {
    tma::store(out, s.tile, index);
    tma::commit_stores();
    tma::wait_stores<0>();
  }
}

template <typename T, int COLS, int BOX_ROWS>
cudaError_t run_round_trip(const round_trip_args& a, cudaStream_t stream) {
  using Tile = shared_tile<T, 64, COLS, widest_swizzle(COLS * int(sizeof(T))), BOX_ROWS>;
  const CUtensorMap in = make_tma_map<Tile>(matrix_layout(static_cast<T*>(const_cast<void*>(a.in)), a.rows, a.cols, a.in_row_stride));
  const CUtensorMap out = make_tma_map<Tile>(matrix_layout(static_cast<T*>(a.out), a.rows, a.cols, a.out_row_stride));
  return pipeline::launch(tma_round_trip_kernel<Tile>, 1, WARPGROUP_THREADS, pipeline::shared_bytes<round_trip_shared<Tile>>,
                          stream, in, out, static_cast<T*>(a.dense), a.row0, a.col0);
}

// ---------------------------------------------------------------------------------- wgmma

constexpr int PRODUCT_M = 64;
constexpr int PRODUCT_K = 64;

template <typename T, int N, operand_major A_MAJOR, operand_major B_MAJOR>
struct product_shared {
  std::conditional_t<A_MAJOR == operand_major::k, shared_tile<T, PRODUCT_M, PRODUCT_K>, shared_tile<T, PRODUCT_K, PRODUCT_M>> a;
  std::conditional_t<B_MAJOR == operand_major::k, shared_tile<T, N, PRODUCT_K>, shared_tile<T, PRODUCT_K, N>> b;
  shared_tile<T, PRODUCT_M, N> c;
  mbarrier loaded;
};

template <typename T, int N, operand_major A_MAJOR, operand_major B_MAJOR, bool A_IN_REGISTERS>
__global__ void wgmma_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                             const __grid_constant__ CUtensorMap c_map, const T* a_dense, const T* bias,
                             float* out32) {
  using S = product_shared<T, N, A_MAJOR, B_MAJOR>;
  S& s = pipeline::block_storage<S>();
  const int origin[2] = {0, 0};
  if (threadIdx.x == 0) {
    s.loaded.init(1);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    s.loaded.arrive_expect_tx((A_IN_REGISTERS ? 0 : decltype(s.a)::bytes) + decltype(s.b)::bytes);
    if (!A_IN_REGISTERS) tma::load(s.a, a_map, s.loaded, origin);
    tma::load(s.b, b_map, s.loaded, origin);
  }
  s.loaded.wait(0);

  warpgroup::accumulator<N> acc;
  if constexpr (A_IN_REGISTERS) {
    // Each warp's 16 rows of the dense row-major A (64 x 64) as a register tile.
    register_tile<T, BASE_TILE, PRODUCT_K> a_regs;
    warp::load(a_regs, a_dense + warpgroup::warp_row() * PRODUCT_K, PRODUCT_K);
    warpgroup::fence();
    warpgroup::mma<B_MAJOR>(acc, a_regs, s.b, 0, false);
    warpgroup::commit();
    warpgroup::wait<0>(acc, a_regs);
  } else {
    warpgroup::fence();
    warpgroup::mma<A_MAJOR, B_MAJOR>(acc, s.a, 0, s.b, 0, false);
    warpgroup::commit();
    warpgroup::wait<0>(acc);
  }
  warp::store(out32 + warpgroup::warp_row() * N, N, acc);

  // The GEMM epilogue: + bias, stmatrix into the swizzled tile, TMA store.
  per_col_vector<decltype(acc)> bias_columns;
  warp::load(bias_columns, bias, N);
  warp::add_col(acc, acc, bias_columns);
  warpgroup::store<0>(s.c, acc);
  fence_async_shared();
  __syncthreads();
  if (threadIdx.x == 0) {
    tma::store(c_map, s.c, origin);
    tma::commit_stores();
    tma::wait_stores<0>();
  }
}

template <typename T, int N, operand_major A_MAJOR, operand_major B_MAJOR, bool A_IN_REGISTERS>
cudaError_t run_product(const product_args& p, cudaStream_t stream) {
  using S = product_shared<T, N, A_MAJOR, B_MAJOR>;
  const bool b_k = B_MAJOR == operand_major::k;
  T* a = static_cast<T*>(const_cast<void*>(p.a));
  T* b = static_cast<T*>(const_cast<void*>(p.b));
  // A is square (64 x 64), so it is stored 64 x 64 whichever its major-ness.
  static_assert(PRODUCT_M == PRODUCT_K);
  const CUtensorMap a_map = make_tma_map<decltype(S::a)>(matrix_layout(a, PRODUCT_M, PRODUCT_K, PRODUCT_K));
  const CUtensorMap b_map = make_tma_map<decltype(S::b)>(
      b_k ? matrix_layout(b, N, PRODUCT_K, PRODUCT_K) : matrix_layout(b, PRODUCT_K, N, N));
  const CUtensorMap c_map = make_tma_map<decltype(S::c)>(matrix_layout(static_cast<T*>(p.out16), PRODUCT_M, N, N));
  return pipeline::launch(wgmma_kernel<T, N, A_MAJOR, B_MAJOR, A_IN_REGISTERS>, 1, WARPGROUP_THREADS, pipeline::shared_bytes<S>,
                          stream, a_map, b_map, c_map, a, static_cast<const T*>(p.bias), p.out32);
}

template <typename T, int N>
cudaError_t run_product_variants(const product_args& p, cudaStream_t stream) {
  constexpr auto k = operand_major::k, mn = operand_major::mn;
  if (p.a_in_registers) return p.b_mn_major ? run_product<T, N, k, mn, true>(p, stream) : run_product<T, N, k, k, true>(p, stream);
  if (p.a_mn_major) return p.b_mn_major ? run_product<T, N, mn, mn, false>(p, stream) : run_product<T, N, mn, k, false>(p, stream);
  return p.b_mn_major ? run_product<T, N, k, mn, false>(p, stream) : run_product<T, N, k, k, false>(p, stream);
}

// ------------------------------------------------------------------------ pipeline: column sums

// Every hook of the producer/consumer template at once. A task is the output tile (r, c): 64
// columns of `iterations` 64-row blocks of x and y, plus the 64 x 64 block (r, c) of z:
//   out[r, col] = sum over the task's rows of (x + 2 y)[:, col] + 3 * sum of z's block (r, c)
//   tasks_before[r, c] = how many tasks the block ran before this one
// x and y arrive as the two parts of a stage, each released as soon as the consumers have read it;
// z is the task's resident tile; the task count lives in scratch shared memory, which must persist
// across a persistent block's tasks. The weights 1, 2, 3 tell the three sources apart.
template <int STAGES, int CONSUMERS>
struct pipeline_sum_plan {
  static constexpr int stages = STAGES;
  static constexpr int consumer_warpgroups = CONSUMERS;
  static constexpr int producer_registers = 40;
  static constexpr int consumer_registers = 232;
  static constexpr int block = 64;  // rows and columns of a tile
};

template <int STAGES, int CONSUMERS>
struct pipeline_sum_kernel : pipeline_sum_plan<STAGES, CONSUMERS> {
  using pipeline_sum_plan<STAGES, CONSUMERS>::block;
  static constexpr int consumer_threads = CONSUMERS * WARPGROUP_THREADS;
  static constexpr int rows_per_pass = consumer_threads / block;

  using tile = shared_tile<bf16, block, block>;
  struct stage {
    tile x, y;
  };
  enum part : int { x_part, y_part };
  static constexpr uint32_t stage_bytes[] = {tile::bytes, tile::bytes};
  struct resident {
    tile z;
  };
  static constexpr uint32_t resident_bytes = tile::bytes;
  struct scratch {
    float partial[consumer_threads];
    int tasks_seen[CONSUMERS];
  };
  struct consumer_state {
    float sum;
  };
  struct params {
    CUtensorMap x, y, z;
    float* out;
    int* tasks_before;
    int rows, cols, iterations;
    pipeline::grouped_tile_order order;
  };
  using context = pipeline::task_context<pipeline_sum_kernel>;

  enum class barrier_id : int { partials_written = FIRST_NAMED_BARRIER, partials_read, count };
  static_assert(fits_named_barriers<barrier_id>());

  __host__ __device__ static pipeline::grouped_tile_order tasks(const params& p) { return p.order; }
  __device__ static int iterations(const params& p, pipeline::output_tile tile) {
    const int rows_left = p.rows - tile.row * p.iterations * block;
    return min(p.iterations, ceil_div(rows_left, block));
  }
  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.x);
    tma::prefetch_descriptor(p.y);
    tma::prefetch_descriptor(p.z);
  }
  __device__ static void load_resident(const params& p, pipeline::output_tile tile, resident& r, mbarrier& full) {
    const int index[2] = {tile.row * block, tile.col * block};
    tma::load(r.z, p.z, full, index);
  }
  __device__ static void load(const params& p, pipeline::output_tile tile, int i, int part, stage& s, mbarrier& full) {
    const int index[2] = {(tile.row * p.iterations + i) * block, tile.col * block};
    tma::load(part == x_part ? s.x : s.y, part == x_part ? p.x : p.y, full, index);
  }
  __device__ static int thread_index(int consumer) { return consumer * WARPGROUP_THREADS + threadIdx.x % WARPGROUP_THREADS; }
  __device__ static float column_share(const tile& t, int thread) {
    float sum = 0.0f;
    for (int row = thread / block; row < block; row += rows_per_pass) sum += __bfloat162float(t.at(row, thread % block));
    return sum;
  }

  __device__ static void init(const params&, scratch& s, int consumer) {
    if (threadIdx.x % WARPGROUP_THREADS == 0) s.tasks_seen[consumer] = 0;
  }
  __device__ static void compute(const context& ctx, consumer_state& state, pipeline::stage_inputs<pipeline_sum_kernel>& in) {
    const int t = thread_index(ctx.consumer);
    state.sum = 0.0f;
    auto at = in.first();
    for (int i = 0; i < ctx.iterations; ++i, at.advance()) {
      state.sum += column_share(in.wait(at, x_part).x, t);
      in.release(at, x_part);
      state.sum += 2.0f * column_share(in.wait(at, y_part).y, t);
      in.release(at, y_part);
    }
  }
  __device__ static void store(const context& ctx, consumer_state& state) {
    const params& p = ctx.params;
    const int t = thread_index(ctx.consumer);
    ctx.scratch.partial[t] = state.sum + 3.0f * column_share(ctx.resident.z, t);
    barrier_sync(barrier_id::partials_written, consumer_threads);
    const int col = ctx.task.col * block + t;
    if (t < block && col < p.cols) {
      float total = 0.0f;
      for (int j = 0; j < rows_per_pass; ++j) total += ctx.scratch.partial[t + block * j];
      p.out[ctx.task.row * p.cols + col] = total;
    }
    barrier_sync(barrier_id::partials_read, consumer_threads);
    if (threadIdx.x % WARPGROUP_THREADS == 0) {
      const int seen = ctx.scratch.tasks_seen[ctx.consumer]++;
      if (ctx.consumer == 0) p.tasks_before[ctx.task.row * p.order.tiles_n + ctx.task.col] = seen;
    }
  }
};

template <int STAGES, int CONSUMERS>
cudaError_t run_pipeline_sums(const pipeline_sum_args& a, cudaStream_t stream) {
  using K = pipeline_sum_kernel<STAGES, CONSUMERS>;
  using tile = typename K::tile;
  const auto matrix = [&](const void* data, int rows) {
    return make_tma_map<tile>(matrix_layout(static_cast<bf16*>(const_cast<void*>(data)), rows, a.cols, a.cols));
  };
  typename K::params p;
  const int rows_per_tile = a.iterations * K::block;
  p.order = {ceil_div(a.rows, rows_per_tile), ceil_div(a.cols, K::block), a.group_rows};
  p.x = matrix(a.x, a.rows);
  p.y = matrix(a.y, a.rows);
  p.z = matrix(a.z, p.order.tiles_m * K::block);
  p.out = a.out;
  p.tasks_before = a.tasks_before;
  p.rows = a.rows;
  p.cols = a.cols;
  p.iterations = a.iterations;
  return pipeline::launch<K>(p, a.grid, stream);
}

template <int STAGES>
cudaError_t run_pipeline_sums_stages(const pipeline_sum_args& a, cudaStream_t stream) {
  return a.consumers == 1 ? run_pipeline_sums<STAGES, 1>(a, stream) : run_pipeline_sums<STAGES, 2>(a, stream);
}

// The template with its required hooks only: compute sums its columns and writes them itself.
struct bare_sum_kernel : pipeline_sum_plan<2, 1> {

  using tile = shared_tile<bf16, block, block>;
  struct stage {
    tile x;
  };
  static constexpr uint32_t stage_bytes[] = {tile::bytes};
  struct consumer_state {};
  struct params {
    CUtensorMap x;
    float* out;
    int rows, cols, iterations;
    pipeline::grouped_tile_order order;
  };
  using context = pipeline::task_context<bare_sum_kernel>;

  __host__ __device__ static pipeline::grouped_tile_order tasks(const params& p) { return p.order; }
  __device__ static int iterations(const params& p, pipeline::output_tile tile) {
    return min(p.iterations, ceil_div(p.rows - tile.row * p.iterations * block, block));
  }
  __device__ static void load(const params& p, pipeline::output_tile tile, int i, int, stage& s, mbarrier& full) {
    const int index[2] = {(tile.row * p.iterations + i) * block, tile.col * block};
    tma::load(s.x, p.x, full, index);
  }
  // Thread t < 64 sums column t of the task's rows (rows past the end arrive as zeros).
  __device__ static void compute(const context& ctx, consumer_state&, pipeline::stage_inputs<bare_sum_kernel>& in) {
    const int t = threadIdx.x % WARPGROUP_THREADS;
    float sum = 0.0f;
    auto at = in.first();
    for (int i = 0; i < ctx.iterations; ++i, at.advance()) {
      const tile& x = in.wait(at).x;
      if (t < block) {
        for (int row = 0; row < block; ++row) sum += __bfloat162float(x.at(row, t));
      }
      in.release(at);
    }
    const int col = ctx.task.col * block + t;
    if (t < block && col < ctx.params.cols) ctx.params.out[ctx.task.row * ctx.params.cols + col] = sum;
  }
};
static_assert(!pipeline::has_store<bare_sum_kernel> && !pipeline::has_prefetch<bare_sum_kernel> &&
              !pipeline::has_init<bare_sum_kernel> && !pipeline::has_finish<bare_sum_kernel>);
static_assert(pipeline::has_store<pipeline_sum_kernel<1, 1>> && pipeline::has_prefetch<pipeline_sum_kernel<1, 1>> &&
              pipeline::has_init<pipeline_sum_kernel<1, 1>>);

// ---------------------------------------------------------------------------- TMA store ring

using fp32_tile = shared_tile<float, 64, 64>;

template <int SLOTS>
struct store_ring_shared {
  fp32_tile staging[SLOTS];
};

enum class ring_barrier : int { slot_free = FIRST_NAMED_BARRIER, slot_written, count };
static_assert(fits_named_barriers<ring_barrier>());

// Every thread writes its share of each tile straight after the ring hands out the slot, so a slot
// handed out before its previous store has read it would show in `out`.
template <int SLOTS>
__global__ void store_ring_kernel(const __grid_constant__ CUtensorMap out, int tiles) {
  auto& s = pipeline::block_storage<store_ring_shared<SLOTS>>();
  pipeline::tma_store_ring<SLOTS> ring;
  const bool leader = is_warpgroup_leader();
  for (int t = 0; t < tiles; ++t) {
    fp32_tile& tile = s.staging[ring.slot()];
    ring.acquire(leader, ring_barrier::slot_free);
    for (int i = threadIdx.x; i < fp32_tile::rows * fp32_tile::cols; i += WARPGROUP_THREADS) {
      tile.at(i / fp32_tile::cols, i % fp32_tile::cols) = float(t * fp32_tile::rows * fp32_tile::cols + i);
    }
    publish(ring_barrier::slot_written, WARPGROUP_THREADS);
    if (leader) {
      const int index[2] = {t * fp32_tile::rows, 0};
      tma::store(out, tile, index);
    }
    ring.commit(leader);
  }
  pipeline::tma_store_ring<SLOTS>::drain();
}

template <int SLOTS>
cudaError_t run_store_ring(float* out, int tiles, cudaStream_t stream) {
  const CUtensorMap map = make_tma_map<fp32_tile>(matrix_layout(out, tiles * fp32_tile::rows, fp32_tile::cols, fp32_tile::cols));
  return pipeline::launch(store_ring_kernel<SLOTS>, 1, WARPGROUP_THREADS, pipeline::shared_bytes<store_ring_shared<SLOTS>>,
                          stream, map, tiles);
}

// --------------------------------------------------------------------------------- publish

constexpr int PUBLISHERS = 2;  // warpgroups writing the tile

struct publish_shared {
  fp32_tile tile;
};

enum class publish_barrier : int { written = FIRST_NAMED_BARRIER, count };
static_assert(fits_named_barriers<publish_barrier>());

// Warpgroup w writes rows [32 w, 32 w + 32); thread 0, of warpgroup 0, stores all of them.
__global__ void publish_kernel(const __grid_constant__ CUtensorMap out) {
  auto& s = pipeline::block_storage<publish_shared>();
  constexpr int rows_each = fp32_tile::rows / PUBLISHERS;
  const int first = warpgroup_id() * rows_each * fp32_tile::cols;
  for (int i = threadIdx.x % WARPGROUP_THREADS; i < rows_each * fp32_tile::cols; i += WARPGROUP_THREADS) {
    s.tile.at((first + i) / fp32_tile::cols, (first + i) % fp32_tile::cols) = float(first + i);
  }
  publish(publish_barrier::written, PUBLISHERS * WARPGROUP_THREADS);
  if (threadIdx.x == 0) {
    const int origin[2] = {0, 0};
    tma::store(out, s.tile, origin);
    tma::commit_stores();
    tma::wait_stores_read<0>();
  }
}

// --------------------------------------------------------------------------- turn rotation

constexpr int MAX_TURNS = 1024;

template <int MEMBERS>
struct turn_barriers {
  enum class id : int { first = FIRST_NAMED_BARRIER, count = first + MEMBERS };
  static_assert(fits_named_barriers<id>());
};

// Each turn, the member's leader appends its index to `takers` in shared memory. Member 0 lingers
// before each of its entries, so a rotation that let the others run ahead would show in `takers`.
template <int MEMBERS>
__global__ void turn_order_kernel(int* order, int rounds) {
  using id = typename turn_barriers<MEMBERS>::id;
  __shared__ int takers[MAX_TURNS];
  __shared__ int taken;
  if (threadIdx.x == 0) taken = 0;
  __syncthreads();
  const turn_rotation<id, MEMBERS> turns{id::first, warpgroup_id()};
  turns.grant_first();
  for (int round = 0; round < rounds; ++round) {
    turns.wait();
    if (is_warpgroup_leader()) {
      if (turns.member == 0) __nanosleep(1000);
      takers[taken] = turns.member;
      ++taken;
      __threadfence_block();
    }
    turns.pass(round + 1 == rounds);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < taken; i += blockDim.x) order[i] = takers[i];
}

template <int MEMBERS>
cudaError_t run_turn_order(int* order, int rounds, cudaStream_t stream) {
  if (MEMBERS * rounds > MAX_TURNS) return cudaErrorInvalidValue;
  return pipeline::launch(turn_order_kernel<MEMBERS>, 1, MEMBERS * WARPGROUP_THREADS, 0, stream, order, rounds);
}

template <int BOX_ROWS>
cudaError_t tma_round_trip_boxes(const round_trip_args& a, cudaStream_t stream) {
  return with_element(a.dtype, [&]<typename T>() {
    constexpr int span = 128 / int(sizeof(T));  // columns of one 128-byte swizzle span
    if (a.tile_cols == span / 4) return run_round_trip<T, span / 4, BOX_ROWS>(a, stream);  // 32-byte swizzle
    if (a.tile_cols == span / 2) return run_round_trip<T, span / 2, BOX_ROWS>(a, stream);  // 64-byte swizzle
    if (a.tile_cols == span) return run_round_trip<T, span, BOX_ROWS>(a, stream);
    return run_round_trip<T, 2 * span, BOX_ROWS>(a, stream);  // two 128-byte panels
  });
}

}  // namespace

// ------------------------------------------------------------ the template's contract (compile time)

// pipeline_kernel, which launch checks: the test kernels above fill it in. The probes are
// declarations only (the checks never call them; outside the anonymous namespace, so that unused
// declarations draw no warning): the members every kernel needs but compute; then compute and a
// store added; then a store taking its context by non-const reference, which the template could
// not call and would otherwise skip without a word.
static_assert(pipeline::pipeline_kernel<bare_sum_kernel> && pipeline::pipeline_kernel<pipeline_sum_kernel<2, 2>>);

struct probe_without_compute {
  static constexpr int stages = 1;
  static constexpr int consumer_warpgroups = 1;
  static constexpr int producer_registers = 40;
  static constexpr int consumer_registers = 232;
  struct stage {
    shared_tile<bf16, 64, 64> x;
  };
  static constexpr uint32_t stage_bytes[] = {sizeof(stage)};
  struct consumer_state {};
  struct params {
    pipeline::grouped_tile_order order;
  };
  __host__ __device__ static pipeline::grouped_tile_order tasks(const params& p);
  __device__ static int iterations(const params& p, pipeline::output_tile tile);
  __device__ static void load(const params& p, pipeline::output_tile tile, int i, int part, stage& s, mbarrier& full);
};
struct probe_with_store : probe_without_compute {
  using context = pipeline::task_context<probe_with_store>;
  __device__ static void compute(const context& ctx, consumer_state& state, pipeline::stage_inputs<probe_with_store>& in);
  __device__ static void store(const context& ctx, consumer_state& state);
};
struct probe_with_mutable_store : probe_without_compute {
  using context = pipeline::task_context<probe_with_mutable_store>;
  __device__ static void compute(const context& ctx, consumer_state& state,
                                 pipeline::stage_inputs<probe_with_mutable_store>& in);
  __device__ static void store(context& ctx, consumer_state& state);
};
static_assert(!pipeline::has_compute<probe_without_compute> && !pipeline::pipeline_kernel<probe_without_compute>);
static_assert(pipeline::has_store<probe_with_store> && pipeline::pipeline_kernel<probe_with_store>);
static_assert(!pipeline::store_if_named<probe_with_mutable_store> && pipeline::has_compute<probe_with_mutable_store> &&
              !pipeline::pipeline_kernel<probe_with_mutable_store>);

cudaError_t tma_round_trip(const round_trip_args& a, cudaStream_t stream) {
  return a.box_rows == 16 ? tma_round_trip_boxes<16>(a, stream) : tma_round_trip_boxes<64>(a, stream);
}

cudaError_t wgmma_product(const product_args& p, cudaStream_t stream) {
  const auto for_n = [&]<typename T>() {
    if (p.n == 64) return run_product_variants<T, 64>(p, stream);
    if (p.n == 128) return run_product_variants<T, 128>(p, stream);
    return run_product_variants<T, 256>(p, stream);
  };
  return p.dtype == element::bf16 ? for_n.template operator()<bf16>() : for_n.template operator()<half>();
}

cudaError_t pipeline_sums(const pipeline_sum_args& a, cudaStream_t stream) {
  switch (a.stages) {
    case 1: return run_pipeline_sums_stages<1>(a, stream);
    case 2: return run_pipeline_sums_stages<2>(a, stream);
    case 3: return run_pipeline_sums_stages<3>(a, stream);
    default: return run_pipeline_sums_stages<4>(a, stream);
  }
}

cudaError_t store_ring_tiles(float* out, int tiles, int slots, cudaStream_t stream) {
  if (slots == 1) return run_store_ring<1>(out, tiles, stream);
  if (slots == 2) return run_store_ring<2>(out, tiles, stream);
  return run_store_ring<3>(out, tiles, stream);
}

cudaError_t publish_tile(float* out, cudaStream_t stream) {
  const CUtensorMap map = make_tma_map<fp32_tile>(matrix_layout(out, fp32_tile::rows, fp32_tile::cols, fp32_tile::cols));
  return pipeline::launch(publish_kernel, 1, PUBLISHERS * WARPGROUP_THREADS, pipeline::shared_bytes<publish_shared>, stream, map);
}

cudaError_t turn_order(int* order, int members, int rounds, cudaStream_t stream) {
  if (members == 1) return run_turn_order<1>(order, rounds, stream);
  if (members == 2) return run_turn_order<2>(order, rounds, stream);
  return run_turn_order<3>(order, rounds, stream);
}

cudaError_t pipeline_bare_sums(const void* x, float* out, int rows, int cols, int iterations, int grid,
                               cudaStream_t stream) {
  using K = bare_sum_kernel;
  K::params p;
  p.order = {ceil_div(rows, iterations * K::block), ceil_div(cols, K::block), 1};
  p.x = make_tma_map<K::tile>(matrix_layout(static_cast<bf16*>(const_cast<void*>(x)), rows, cols, cols));
  p.out = out;
  p.rows = rows;
  p.cols = cols;
  p.iterations = iterations;
  return pipeline::launch<K>(p, grid, stream);
}

}  // namespace tk::core_tests
