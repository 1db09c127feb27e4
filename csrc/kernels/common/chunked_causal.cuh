// What the chunked causal linear attention forward kernels (Based, generic linear attention) share:
// the task order, the stage loads, the per-chunk epilogue and the host-side checks and parameters.
//
// One task is one (batch, head) sequence and VALUE_BLOCK of its value columns; one consumer
// warpgroup walks the sequence in chunks of CHUNK positions. Each stage holds the chunk's q, k
// (CHUNK x FEATURES) and its block of v (CHUNK x VALUE_BLOCK). After each chunk the kernel hands its
// running state to the next chunk as 16-bit copies in shared memory (its own scratch) and the
// chunk's output to TMA through one of two staging tiles (store_chunk).
#pragma once

#include <string>
#include <utility>

#include "kernels/common/causal_problem.h"
#include "kernels/common/heads_layout.cuh"
#include "tk/tk.cuh"

namespace tk::chunked_causal {

constexpr int64_t MAX_GRID_TASKS = (int64_t(1) << 31) - 1;
constexpr int64_t MAX_SEQUENCE = int64_t(1) << 30;  // TMA's 32-bit coordinates, with room
constexpr int MAX_VALUE_DIM = 256;
// Output staging tiles a consumer alternates between, so TMA stores one while the next is written.
constexpr int STAGING_TILES = 2;
using staging_ring = pipeline::tma_store_ring<STAGING_TILES>;

// Why a kernel that splits v into blocks of `value_block` columns cannot take these q, k, v sizes
// (the feature dim is each kernel's own check). Forward and backward kernels share it.
inline std::string sequence_shape_reason(const heads_view& q, const heads_view& k, const heads_view& v,
                                         int value_block) {
  if (v.dim % value_block != 0 || v.dim > MAX_VALUE_DIM) {
    return "the value dim must be a multiple of " + std::to_string(value_block) + " up to " +
           std::to_string(MAX_VALUE_DIM);
  }
  for (const heads_view* t : {&k, &v}) {
    if (t->batch != q.batch || t->heads != q.heads || t->rows != q.rows) return "q, k and v must match";
  }
  if (k.dim != q.dim) return "q and k must share the feature dim";
  if (q.batch < 1 || q.heads < 1 || q.rows < 1) return "every size must be at least 1";
  if (q.rows > MAX_SEQUENCE) return "the sequence must fit TMA coordinates";
  if (q.batch * q.heads * (v.dim / value_block) > MAX_GRID_TASKS) {
    return "B * H * Dv / " + std::to_string(value_block) + " must fit one grid";
  }
  return {};
}

template <typename T, int FEATURES, int CHUNK, int VALUE_BLOCK>
struct kernel_base {
  using qk_tile = shared_tile<T, CHUNK, FEATURES>;
  using value_tile = shared_tile<T, CHUNK, VALUE_BLOCK>;  // also the output's staging
  using output = warpgroup::accumulator<VALUE_BLOCK>;
  using row_vector = per_row_vector<output, float>;

  struct stage {
    qk_tile q, k;
    value_tile v;
  };
  static constexpr uint32_t stage_bytes[] = {2 * qk_tile::bytes + value_tile::bytes};

  struct params {
    CUtensorMap q, k, v, out;
    float* denominator;
    int rows, heads, batch, value_blocks;
    float eps;
    bool normalize;
  };

  enum class barrier_id : int {
    chunk_done = FIRST_NAMED_BARRIER,  // the warpgroup's products of a chunk are done
    copies_written,                    // the state's copies and the output tile are written
    count,
  };
  static_assert(fits_named_barriers<barrier_id>());

  // ------------------------------------------------------------------------------ producer

  __host__ __device__ static pipeline::head_block_order tasks(const params& p) {
    return {p.value_blocks, p.heads, p.batch, false};
  }

  __device__ static int iterations(const params& p, pipeline::head_block) { return ceil_div(p.rows, CHUNK); }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.q);
    tma::prefetch_descriptor(p.k);
    tma::prefetch_descriptor(p.v);
    tma::prefetch_descriptor(p.out);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int chunk, int, stage& s, mbarrier& full) {
    const int qk_index[4] = {task.batch, task.head, chunk * CHUNK, 0};
    const int v_index[4] = {task.batch, task.head, chunk * CHUNK, task.block * VALUE_BLOCK};
    tma::load(s.q, p.q, full, qk_index);
    tma::load(s.k, p.k, full, qk_index);
    tma::load(s.v, p.v, full, v_index);
  }

  // ------------------------------------------------------------------------------ consumers

  // Normalising: the chunk's denominators out (one value block writes them, rows past N dropped),
  // then O /= denominator + eps.
  template <typename Context>
  __device__ static void normalize(const Context& ctx, output& o, row_vector& den, int chunk) {
    if (!ctx.params.normalize) return;
    store_denominator(ctx, den, chunk);
    warp::add(den, den, ctx.params.eps);
    warp::div_row(o, o, den);
  }

  // The chunk's denominators (one value block writes them), rows past N dropped.
  template <typename Context>
  __device__ static void store_denominator(const Context& ctx, const row_vector& den, int chunk) {
    const params& p = ctx.params;
    if (ctx.task.block != 0) return;
    const int row = chunk * CHUNK + warpgroup::warp_row();
    warp::store(p.denominator + (int64_t(ctx.task.batch) * p.heads + ctx.task.head) * p.rows + row, den, p.rows - row);
  }

  // Hands the state to the next chunk (write_copies(), only when there is one) and the output tile
  // to TMA through the staging ring, so that one store is in flight while the next is written.
  template <typename Context, typename WriteCopies>
  __device__ static void store_chunk(const Context& ctx, value_tile (&staging)[STAGING_TILES], staging_ring& stores,
                                     const output& o, int chunk, bool leader, WriteCopies&& write_copies) {
    value_tile& tile = staging[stores.slot()];
    stores.acquire(leader, barrier_id::chunk_done);
    if (chunk + 1 < ctx.iterations) write_copies();
    warpgroup::store<0>(tile, o);
    // The stmatrix writes must be visible to wgmma and to the copy engine.
    publish(barrier_id::copies_written, WARPGROUP_THREADS);
    if (leader) {
      const int index[4] = {ctx.task.batch, ctx.task.head, chunk * CHUNK, ctx.task.block * VALUE_BLOCK};
      tma::store(ctx.params.out, tile, index);
    }
    stores.commit(leader);
  }

  template <typename Scratch>
  __device__ static void finish(const params&, Scratch&, int) {
    staging_ring::drain();
  }

  // ------------------------------------------------------------------------------ host

  // Why the kernel cannot take these q, k, v sizes (the feature dim is the caller's check).
  static std::string sequence_shape_reason(const causal_forward_problem& p) {
    return chunked_causal::sequence_shape_reason(p.q, p.k, p.v, VALUE_BLOCK);
  }

  static heads_view out_view(const causal_forward_problem& pr) {
    return contiguous_view(pr.out, pr.v.batch, pr.v.heads, pr.v.rows, pr.v.dim);
  }

  // Why TMA cannot move these tensors' tiles.
  static std::string layout_reasons(const causal_forward_problem& pr) {
    for (const auto& [name, view] : {std::pair{"q", pr.q}, std::pair{"k", pr.k}}) {
      if (std::string r = layout_reason<qk_tile, T>(name, view); !r.empty()) return r;
    }
    for (const auto& [name, view] : {std::pair{"v", pr.v}, std::pair{"out", out_view(pr)}}) {
      if (std::string r = layout_reason<value_tile, T>(name, view); !r.empty()) return r;
    }
    return {};
  }

  static params make_params(const causal_forward_problem& pr) {
    params p;
    p.q = make_tma_map<qk_tile>(heads_layout<T>(pr.q));
    p.k = make_tma_map<qk_tile>(heads_layout<T>(pr.k));
    p.v = make_tma_map<value_tile>(heads_layout<T>(pr.v));
    p.out = make_tma_map<value_tile>(heads_layout<T>(out_view(pr)));
    p.denominator = pr.denominator;
    p.rows = int(pr.q.rows);
    p.heads = int(pr.q.heads);
    p.batch = int(pr.q.batch);
    p.value_blocks = int(pr.v.dim / VALUE_BLOCK);
    p.eps = pr.eps;
    p.normalize = pr.normalize;
    return p;
  }
};

}  // namespace tk::chunked_causal
