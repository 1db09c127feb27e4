// GEMM on the tile core: C = A * B (+ bias), one 128 x 256 tile of C per block and step (or
// 128 x 64 for problems with few tiles: narrow_tile_plan).
//
//   producer (1 warpgroup)      TMA: A tile (128 x 64) and B tile (64 x 256) into a ring of stages
//   consumers (2 warpgroups)    wgmma: each owns 64 rows of the tile, acc (64 x 256 fp32) += A B
//   epilogue (consumers)        + bias, * c_scale, convert, stmatrix into swizzled staging, TMA store;
//                               the store drains while the next tile's mainloop runs. Or, under an
//                               accumulating plan (accumulating<Plan>), C (fp32) += acc straight from
//                               the registers: each element read and written by the thread that holds it
//
// Tails need no code: TMA zero-fills what lies past M, N or K on load (zeros add nothing to the
// products) and drops what lies past M or N on store.
#pragma once

#include <climits>
#include <string>
#include <utility>

#include "gemm.h"
#include "tk/tk.cuh"

namespace tk::gemm {

using warpgroup::operand_major;

// The tile plan. Shared memory: 4 stages x (16 + 32) KB of operands + 2 x 2 x 8 KB of output
// staging = 224 KB of the 227 KB a block may have. Alternatives measured side by side
// (benchmarks/tune_gemm.py: 3 stages with wider staging, one staging slot, 24/240 registers,
// raster groups of 4 or 16, TMA boxes of 64 rows, 128 x 128 tiles) were within run-to-run noise
// of this plan or slower; benchmarks/results/gemm.md has the numbers.
struct tile_plan {
  static constexpr int block_m = 128;
  static constexpr int block_n = 256;
  static constexpr int block_k = 64;  // one 128-byte swizzle span of 16-bit elements
  static constexpr int consumer_warpgroups = 2;
  static constexpr int stages = 4;
  static constexpr int store_cols = 64;  // columns per epilogue TMA store
  static constexpr int store_slots = 2;  // staging buffers per consumer: one fills while one drains
  static constexpr int group_rows = 8;   // tile rows per group of the raster order
  static constexpr int box_rows = 256;   // rows per TMA box of an operand tile (at most 256)
  // The producer only issues TMA; each consumer holds a 128-register accumulator plus addressing.
  static constexpr int producer_registers = 40;
  static constexpr int consumer_registers = 232;
  // Speed of a k-step per output element, relative to this plan (see narrow_tile_plan).
  static constexpr double relative_rate = 1.0;
  // Whether the epilogue adds the product into an fp32 C instead of writing C (accumulating below).
  static constexpr bool accumulates_c = false;
};

// The plan for problems with too few 128 x 256 tiles to occupy the SMs, chosen by
// faster_with_narrow_tiles below. Case in point: the weight gradients of the K and V projections
// of a Llama-3.2-1B training step, 512 x 2048 outputs over K = 16384 tokens: 32 tiles of 128 x 256,
// so 100 of 132 SMs idle through 256 k-steps, against 128 tiles of 128 x 64 (cuBLAS's nvjet
// picks 128 x 64 there too). Each consumer's wgmma is 64 x 64 x 16 (32 accumulator registers).
// Shared memory: 8 stages x (16 + 8) KB of operands + 2 consumers x 8 KB of staging = 208 KB (a
// ninth stage would need 232 KB). More stages than the default because a stage holds a quarter of
// the work: the same bytes in flight cover the TMA latency. One 64-column store chunk per tile,
// so one staging slot.
struct narrow_tile_plan : tile_plan {
  static constexpr int block_n = 64;
  static constexpr int stages = 8;
  static constexpr int store_slots = 1;
  // A narrow tile reads more shared memory per product: per 16-deep k slice the two consumers
  // issue 2 x N/2 = N cycles of tensor work against 2 x (2 KB of A + 32 N bytes of B) / 128 B per
  // cycle = 32 + N/2 cycles of shared-memory reads: 64 against 64 at N = 64 (no slack), 256
  // against 160 at N = 256. Measured on the same H100 step (results/profile_training_llama_1b_
  // reference.json), cuBLAS's 128 x 64 kernel ran these products at 592 TFLOP/s against 740-750
  // for its 256 x 128 kernel on the large ones: 0.8; we take 0.75 to leave the default plan every
  // case that is close.
  static constexpr double relative_rate = 0.75;
};

// Plan with an epilogue that adds the fp32 accumulator into an fp32 C (C += A B [* c_scale]) where the
// default one writes C in the element type through TMA. A plan rather than a flag of gemm_kernel's own, so
// that the existing kernels keep their template arguments (their names and code unchanged). Registers: the
// accumulator (128) plus one batch of C's old values (2 per pair): accumulate_batch base tiles of 16 x 16
// per warp at a time, 4 pairs each, all their loads issued before the first add (the stores of a batch
// may alias the next batch's loads as far as the compiler knows, so each batch is one round trip to memory:
// 4 per 128 x 256 tile against a k-loop of 16 k-steps or more where it is used).
template <typename Base>
struct accumulating : Base {
  static constexpr bool accumulates_c = true;
  static constexpr int accumulate_batch = 4;
};

// Where an accumulating epilogue adds: C's fp32 elements, rows row_stride elements apart. A base of the
// kernel's params (empty for the other plans: a member, even [[no_unique_address]], grew the device-side
// parameter block of every kernel from 512 to 936 bytes under nvcc 13.0, a base leaves it as it was).
struct accumulation_target {
  struct {
    float* data;
    int64_t row_stride;
  } c_sum;
};
struct no_accumulation_target {};

// An operand tile of MN x K elements as shared memory holds it for the given major-ness.
template <typename T, int MN, int K, operand_major MAJOR, int BOX_ROWS>
using operand_tile =
    std::conditional_t<MAJOR == operand_major::k,
                       shared_tile<T, MN, K, widest_swizzle(K * int(sizeof(T))), (MN < BOX_ROWS ? MN : BOX_ROWS)>,
                       shared_tile<T, K, MN, widest_swizzle(MN * int(sizeof(T))), (K < BOX_ROWS ? K : BOX_ROWS)>>;

template <typename T, operand_major A_MAJOR, operand_major B_MAJOR, bool HAS_BIAS, typename Plan = tile_plan,
          bool SCALES_C = false>
struct gemm_kernel {
  using plan = Plan;
  static constexpr int stages = Plan::stages;
  static constexpr int consumer_warpgroups = Plan::consumer_warpgroups;
  static constexpr int producer_registers = Plan::producer_registers;
  static constexpr int consumer_registers = Plan::consumer_registers;
  static constexpr int rows_per_consumer = Plan::block_m / consumer_warpgroups;
  static_assert(rows_per_consumer == warpgroup::WGMMA_M, "each consumer warpgroup owns one 64-row wgmma block");
  static_assert(Plan::block_n % Plan::store_cols == 0 && (Plan::block_n / Plan::store_cols) % Plan::store_slots == 0,
                "store chunks cycle through the staging slots a whole number of times per tile");

  using a_tile = operand_tile<T, Plan::block_m, Plan::block_k, A_MAJOR, Plan::box_rows>;
  using b_tile = operand_tile<T, Plan::block_n, Plan::block_k, B_MAJOR, Plan::box_rows>;
  using c_tile = shared_tile<T, rows_per_consumer, Plan::store_cols>;
  using accumulator = warpgroup::accumulator<Plan::block_n>;

  struct stage {
    a_tile a;
    b_tile b;
  };
  static constexpr uint32_t stage_bytes[] = {a_tile::bytes + b_tile::bytes};

  struct scratch {
    c_tile c[consumer_warpgroups][Plan::store_slots];  // epilogue staging
  };

  struct consumer_state {
    accumulator acc;
  };

  // c_sum (accumulating plans only, whose C is no tensor map: params.c unused) comes from the base.
  struct params : std::conditional_t<Plan::accumulates_c, accumulation_target, no_accumulation_target> {
    CUtensorMap a;  // A as stored, boxes of a_tile
    CUtensorMap b;
    CUtensorMap c;
    const T* bias;
    int m, n, k;
    pipeline::grouped_tile_order order;
    const float* c_scale;  // read by SCALES_C kernels only; last, so that the other members keep their offsets
  };
  using context = pipeline::task_context<gemm_kernel>;

  enum class barrier_id : int {
    consumer_store = FIRST_NAMED_BARRIER,  // one per consumer warpgroup: staging free / staging written
    count = consumer_store + consumer_warpgroups,
  };
  static_assert(fits_named_barriers<barrier_id>());

  __host__ __device__ static pipeline::grouped_tile_order tasks(const params& p) { return p.order; }

  __device__ static int iterations(const params& p, pipeline::output_tile) { return ceil_div(p.k, Plan::block_k); }

  // Stage i of a tile: A[m0 : m0 + 128, k0 : k0 + 64] and B[k0 : k0 + 64, n0 : n0 + 256], indexed
  // as each is stored.
  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.a);
    tma::prefetch_descriptor(p.b);
    if constexpr (!Plan::accumulates_c) tma::prefetch_descriptor(p.c);
  }

  __device__ static void load(const params& p, pipeline::output_tile tile, int i, int, stage& s, mbarrier& full) {
    const int m0 = tile.row * Plan::block_m;
    const int n0 = tile.col * Plan::block_n;
    const int k0 = i * Plan::block_k;
    const int a_index[2] = {A_MAJOR == operand_major::k ? m0 : k0, A_MAJOR == operand_major::k ? k0 : m0};
    const int b_index[2] = {B_MAJOR == operand_major::k ? n0 : k0, B_MAJOR == operand_major::k ? k0 : n0};
    tma::load(s.a, p.a, full, a_index);
    tma::load(s.b, p.b, full, b_index);
  }

  // acc = sum over K of A[consumer's 64 rows, k0 : k0 + 64] * B[k0 : k0 + 64, :]. Each stage's
  // products stay in flight while the next stage's are issued, so a stage is released one
  // iteration late (with a single stage there is nothing to overlap with).
  __device__ static void compute(const context& ctx, consumer_state& state, pipeline::stage_inputs<gemm_kernel>& inputs) {
    constexpr int in_flight = stages > 1 ? 1 : 0;
    auto at = inputs.first();
    auto in_use = at;
    for (int i = 0; i < ctx.iterations; ++i, at.advance()) {
      const stage& s = inputs.wait(at);
      warpgroup::fence();
      warpgroup::mma<A_MAJOR, B_MAJOR>(state.acc, s.a, ctx.consumer * rows_per_consumer, s.b, 0, i > 0);
      warpgroup::commit();
      warpgroup::wait<in_flight>();
      if (i >= in_flight) {
        inputs.release(in_use);
        in_use.advance();
      }
    }
    warpgroup::wait<0>(state.acc);
    for (int i = 0; i < in_flight && i < ctx.iterations; ++i, in_use.advance()) inputs.release(in_use);
  }

  // C[rows of this consumer, n0 : n0 + 256] = acc (+ bias), in store_cols-wide chunks through the
  // staging slots; a slot is rewritten only after the TMA store that last used it has read it.
  __device__ static void store(const context& ctx, consumer_state& state) {
    const params& p = ctx.params;
    const int row0 = ctx.task.row * Plan::block_m + ctx.consumer * rows_per_consumer;
    const int n0 = ctx.task.col * Plan::block_n;
    if constexpr (HAS_BIAS) {
      per_col_vector<accumulator> bias;
      warp::load(bias, p.bias + n0, p.n - n0);
      warp::add_col(state.acc, state.acc, bias);
    }
    if constexpr (SCALES_C) warp::mul(state.acc, state.acc, *p.c_scale);
    if constexpr (Plan::accumulates_c) {
      accumulate(p, row0, n0, state.acc);
      return;
    }
    const bool issuer = is_warpgroup_leader();
    const barrier_id staging_barrier = barrier_after(barrier_id::consumer_store, ctx.consumer);
    // Each task's chunks fill the slots a whole number of times, so every task starts at slot 0.
    pipeline::tma_store_ring<Plan::store_slots> stores;
    [&]<int... CHUNK>(std::integer_sequence<int, CHUNK...>) {
      ([&] {
        c_tile& slot = ctx.scratch.c[ctx.consumer][stores.slot()];
        stores.acquire(issuer, staging_barrier);
        warpgroup::store<CHUNK * Plan::store_cols>(slot, state.acc);
        publish(staging_barrier, WARPGROUP_THREADS);  // the stmatrix writes must be visible to the copy engine
        if (issuer) {
          const int c_index[2] = {row0, n0 + CHUNK * Plan::store_cols};
          tma::store(p.c, slot, c_index);
        }
        stores.commit(issuer);
      }(), ...);
    }(std::make_integer_sequence<int, Plan::block_n / Plan::store_cols>{});
  }

  // C[rows of this consumer, n0 : n0 + 256] += acc, fp32: this warp's 16 rows, each lane's pairs (two
  // adjacent columns of a row, one 8-byte access) read in batches of Plan::accumulate_batch base tiles, then
  // added and written back; pairs past M or N are left alone (N even: a pair is inside or outside whole).
  // L2 only (.cg): a tile's C is touched once per launch.
  __device__ static void accumulate(const params& p, int row0, int n0, const accumulator& acc) {
    constexpr int batch = Plan::accumulate_batch;
    static_assert(accumulator::row_blocks == 1 && accumulator::col_blocks % batch == 0,
                  "a warp's accumulator is one row of base tiles, cut into whole batches");
    const int warp_row0 = row0 + warpgroup::warp_row();
    const int rows_left = p.m - warp_row0;
    const int cols_left = p.n - n0;
    float* origin = p.c_sum.data + int64_t(warp_row0) * p.c_sum.row_stride + n0;
#pragma unroll
    for (int first = 0; first < accumulator::col_blocks; first += batch) {
      float2* at[batch][fragment::QUADRANTS];
      float2 old[batch][fragment::QUADRANTS];
#pragma unroll
      for (int b = 0; b < batch; ++b) {
#pragma unroll
        for (int q = 0; q < fragment::QUADRANTS; ++q) {
          const fragment::coord c = fragment::pair_element_coord<register_layout::row>(q, 0);
          const int col = BASE_TILE * (first + b) + c.col;
          const bool inside = c.row < rows_left && col < cols_left;
          at[b][q] = inside ? reinterpret_cast<float2*>(origin + int64_t(c.row) * p.c_sum.row_stride + col) : nullptr;
          if (inside) old[b][q] = __ldcg(at[b][q]);
        }
      }
#pragma unroll
      for (int b = 0; b < batch; ++b) {
#pragma unroll
        for (int q = 0; q < fragment::QUADRANTS; ++q) {
          const float2 add = acc.pairs[0][first + b][q];
          if (at[b][q] != nullptr) __stcg(at[b][q], make_float2(old[b][q].x + add.x, old[b][q].y + add.y));
        }
      }
    }
  }

  // The last stores must have read shared memory before the block exits and frees it.
  __device__ static void finish(const params&, scratch&, int) {
    if (is_warpgroup_leader()) tma::wait_stores<0>();
  }
};

// ------------------------------------------------------------------------------- host side

template <typename T>
global_layout<T, 2> layout_of(const void* data, int64_t rows, int64_t cols, int64_t row_stride) {
  return matrix_layout(static_cast<T*>(const_cast<void*>(data)), rows, cols, row_stride);
}

template <typename T>
global_layout<T, 2> layout_of(const stored_matrix& s) {
  return layout_of<T>(s.data, s.rows, s.cols, s.row_stride);
}

// Why kernel K cannot run problem p (empty if it can).
template <typename K>
std::string unsupported_reason_for(const problem& p) {
  using T = typename K::a_tile::element;
  const int64_t a_rows = p.a_major == major::k ? p.m : p.k;
  const int64_t a_cols = p.a_major == major::k ? p.k : p.m;
  const int64_t b_rows = p.b_major == major::k ? p.n : p.k;
  const int64_t b_cols = p.b_major == major::k ? p.k : p.n;
  if (p.m < 1 || p.n < 1 || p.k < 1) return "M, N and K must be at least 1";
  if (p.m > INT_MAX || p.n > INT_MAX || p.k > INT_MAX) return "M, N and K must fit TMA's 32-bit coordinates";
  if (p.a.rows != a_rows || p.a.cols != a_cols) return "A's stored shape does not match M, K and its major-ness";
  if (p.b.rows != b_rows || p.b.cols != b_cols) return "B's stored shape does not match K, N and its major-ness";
  if (std::string r = tma_unsupported_reason<typename K::a_tile>(layout_of<T>(p.a)); !r.empty()) return "A: " + r;
  if (std::string r = tma_unsupported_reason<typename K::b_tile>(layout_of<T>(p.b)); !r.empty()) return "B: " + r;
  if (p.c_row_stride < p.n) return "C's rows must be at least N elements apart";
  if constexpr (K::plan::accumulates_c) {
    if (!p.accumulates_c) return "this kernel adds into C (accumulates_c)";
    if (p.bias != nullptr) return "accumulating into C takes no bias";
    if (p.a_major != major::mn || p.b_major != major::mn) return "accumulating into C takes A and B MN-major";
    if (p.n % 2 != 0 || p.c_row_stride % 2 != 0 || reinterpret_cast<uintptr_t>(p.c) % sizeof(float2) != 0) {
      return "an fp32 C to accumulate into needs N and its row stride even and 8-byte alignment";
    }
    return {};
  } else {
    if (p.accumulates_c) return "this kernel writes C (no accumulates_c)";
  }
  if (std::string r = tma_unsupported_reason<typename K::c_tile>(layout_of<T>(p.c, p.m, p.n, p.c_row_stride));
      !r.empty()) {
    return "C: " + r;
  }
  return {};
}

// The time a plan takes on problem p, in units of one default-plan k-step: the persistent grid
// runs ceil(tiles / SMs) rounds of tiles (the last one possibly part-filled), each of ceil(K /
// block_k) k-steps whose cost scales with the tile's area over the plan's relative rate. The
// epilogue is left out: it is the same bytes under either plan.
template <typename Plan>
double estimated_steps(const problem& p, int sms) {
  const int64_t tiles = ceil_div<int64_t>(p.m, Plan::block_m) * ceil_div<int64_t>(p.n, Plan::block_n);
  const int64_t rounds = ceil_div<int64_t>(tiles, sms);
  const double step = double(Plan::block_m * Plan::block_n) / (tile_plan::block_m * tile_plan::block_n) / Plan::relative_rate;
  return double(rounds) * double(ceil_div<int64_t>(p.k, Plan::block_k)) * step;
}

// True where narrow tiles are expected to finish first: problems whose 128 x 256 tiles leave most
// SMs idle. Ties stay on the default plan. Of the Llama-3.2-1B training products only the K and V
// weight gradients (32 tiles) take narrow tiles; the others (128 to 4096 tiles, rounds 97% occupied
// on 132 SMs) keep the default plan.
inline bool faster_with_narrow_tiles(const problem& p, int sms) {
  return estimated_steps<narrow_tile_plan>(p, sms) < estimated_steps<tile_plan>(p, sms);
}

// SMs of the current device (cached per device), for the plan choice.
inline int current_sm_count() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) device = 0;
  return pipeline::sm_count(device);
}

// Encode the tensor maps and launch kernel K over a persistent grid.
template <typename K>
cudaError_t launch_with(const problem& p, cudaStream_t stream) {
  using T = typename K::a_tile::element;
  using Plan = typename K::plan;
  typename K::params params;
  params.a = make_tma_map<typename K::a_tile>(layout_of<T>(p.a));
  params.b = make_tma_map<typename K::b_tile>(layout_of<T>(p.b));
  if constexpr (Plan::accumulates_c) {
    params.c = {};
    params.c_sum = {static_cast<float*>(p.c), p.c_row_stride};
  } else {
    params.c = make_tma_map<typename K::c_tile>(layout_of<T>(p.c, p.m, p.n, p.c_row_stride));
  }
  params.bias = static_cast<const T*>(p.bias);
  params.c_scale = p.c_scale;
  params.m = int(p.m);
  params.n = int(p.n);
  params.k = int(p.k);
  params.order = {int(ceil_div<int64_t>(p.m, Plan::block_m)), int(ceil_div<int64_t>(p.n, Plan::block_n)), Plan::group_rows};
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  return pipeline::launch<K>(params, pipeline::persistent_grid(params.order.count(), device), stream);
}

}  // namespace tk::gemm
