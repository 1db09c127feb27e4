// Generic causal linear attention backward: grad_q, grad_k, grad_v of
// out_i = sum_{j<=i} (q_i . k_j) v_j (/ (denominator_i + eps)), phi = identity, F in {16, ..., 256}.
//
// With A_ij = q_i . k_j (j <= i), g = grad_out and, normalised, d_i = denominator_i + eps:
//   g~_i = g_i / d_i,  c_i = -(g_i . out_i) / d_i       (unnormalised: g~ = g, c = 0)
//   dA_ij = g~_i . v_j + c_i
//   grad_q = dA K,  grad_k = dA^T Q,  grad_v = A^T G~
// (c is the gradient of the denominator, i.e. of a value column of ones.)
//
// The Based backward's decomposition (based_attention_bwd.cu) with phi = identity, so the states
// are plain K^T V / Q^T G~ slabs as in the forward (linear_attention_fwd.cu) and no VJP of phi.
// Four launches on one stream, no atomics (bitwise reproducible); the statistics and reduce
// kernels and the workspace are chunked_causal_bwd.cuh's:
//   statistics_kernel   (normalised only) per row: 1 / d_i and c_i, over all Dv columns
//   dq_kernel           one task = one (batch, head) and a value block (64 columns up to F = 128, 32 at
//                       F = 256: value_block_for); walks the chunks
//                       first to last like the forward, keeping M = sum_{j earlier} k_j v_j^T
//                       (ceil(F / 64) slabs of wgmma accumulators, read back through a 16-bit copy)
//                       and, for c, the fp32 key sum sum_{j earlier} k_j:
//                         dP = G V^T;  dA = tril(dP / d + c)
//                         grad_q = dA K  +  (G M^T) / d  +  c key_sum       (64 features at a time)
//   dkdv_kernel         its mirror: walks the chunks last to first keeping R = sum_{i later} q_i g~_i^T
//                       (slabs) and, for c, the fp32 sum_{i later} c_i q_i:
//                         S^T = K Q^T, dP^T = V G^T;  keys j are rows, queries i >= j columns
//                         grad_v = triu(S^T / d) G  +  K R
//                         grad_k = triu(dP^T / d + c) Q  +  V R^T  +  query_sum    (64 features at a time)
//                         R_t += (Q_t^T / d) G,  each query's column scaled by 1 / d_i
//   reduce_kernel       grad_q and grad_k: the sum over value blocks of the fp32 partials the two
//                       kernels write (both contract over all of Dv), in the input dtype; skipped
//                       when one block covers Dv (Dv <= 64 up to F = 128): the kernels store them
// F = 256 with Dv <= 64 instead runs the F = 128 kernels on each half of the features (no partials,
// no reduce; grad_v of the two halves added: run_feature_halves).
// The c terms belong to value block 0 alone. grad_v needs no reduction: its columns are the block's.
//
// grad_q and grad_k are produced a piece of 64 features (F at F < 64) at a time and stored as fp32
// partials: the in-chunk product (register A operand: dA or dS^T) and the earlier/later state's
// product (both operands in shared memory) go into two accumulators for grad_q (only the state's
// term is divided by d), into one for grad_k.
// Positions past N arrive as zeros from TMA with zero statistics, so they add nothing to the
// states, and reach only rows that are never stored (the partials' rows are padded to whole chunks).
//
// Registers (232, or 240 for dq and 256 for dkdv at F = 256, per consumer thread): a state slab is
// VALUE_BLOCK / 2 registers, a piece accumulator 32 more at F >= 64 (two in dq). Shared memory: dq's
// stage is 64 * F * 2 + 2 * 64 * VALUE_BLOCK * 2 bytes, dkdv's 2 * 64 * F * 2 + 2 * 64 * VALUE_BLOCK * 2;
// three stages up to F = 64, two above; registers allow two blocks an SM up to F = 128 (shared
// memory, with 64-column blocks, one: at Dv = 64 there are only B * H tasks anyway).
#include "kernels/common/chunked_causal_bwd.cuh"
#include "linear_attention.h"
#include "tk/tk.cuh"

namespace tk::linear {
namespace {

using warpgroup::operand_major;
namespace causal_backward = tk::causal_backward;

using kernel_dtypes = one_of<element_type::bf16, element_type::fp16>;
using feature_dims = one_of<16, 32, 64, 128, 256>;

constexpr int CHUNK = causal_backward::CHUNK;              // positions per chunk: the rows of one wgmma
constexpr int SLAB_FEATURES = warpgroup::WGMMA_M;          // feature rows per state slab

// Value columns per task: 64 up to F = 128, where a 64-column block's states and accumulators fit
// the registers, so that Dv = 64 takes one block and needs no partials; the minimum, 32, at F = 256.
constexpr int WIDE_VALUE_BLOCK = 2 * causal_backward::VALUE_BLOCK;
constexpr int value_block_for(int features) {
  return features <= 2 * SLAB_FEATURES ? WIDE_VALUE_BLOCK : causal_backward::VALUE_BLOCK;
}

// grad_q's piece: dA K + (G M^T) / d + c key_sum.
struct earlier_query_gradient {
  __device__ static float apply(float own, float earlier, float inverse_denominator, float denominator_grad,
                                float key_sum) {
    return own + earlier * inverse_denominator + denominator_grad * key_sum;
  }
};

// What the two gradient kernels share: the plan, the tiles, the statistics and the transposed loads.
// The kernels are its members (defined below, deriving from it), so that their hooks name all of
// this directly and the pipeline template still finds the plan as K::stages etc.
template <typename T, int FEATURES>
struct gradient_common {
  struct dq_kernel;
  struct dkdv_kernel;

  static constexpr bool wide = FEATURES > 2 * SLAB_FEATURES;
  static constexpr int VALUE_BLOCK = value_block_for(FEATURES);
  static constexpr int consumer_warpgroups = 1;
  static constexpr int stages = FEATURES <= SLAB_FEATURES ? 3 : 2;
  static constexpr int blocks_per_sm = wide ? 1 : 2;
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = wide ? 240 : 232;

  static constexpr int SLABS = ceil_div(FEATURES, SLAB_FEATURES);
  static constexpr int PIECE = FEATURES < SLAB_FEATURES ? FEATURES : SLAB_FEATURES;  // gradient features at a time
  static constexpr int PIECES = FEATURES / PIECE;
  // Each slab's register operand pins a buffer until the update after the next is issued.
  static constexpr int OPERAND_BUFFERS = SLABS > 1 ? 2 : 1;
  static_assert(FEATURES % BASE_TILE == 0 && (FEATURES < SLAB_FEATURES || FEATURES % SLAB_FEATURES == 0),
                "a warp owns whole base tiles of features; slabs are whole");

  using qk_tile = shared_tile<T, CHUNK, FEATURES>;
  using value_tile = shared_tile<T, CHUNK, VALUE_BLOCK>;       // v, grad_out (and grad_v's staging)
  using state_copy_tile = shared_tile<T, FEATURES, VALUE_BLOCK>;
  using scores = warpgroup::accumulator<CHUNK>;                // a warp's 16 rows x 64 columns
  using weights = register_tile<T, BASE_TILE, CHUNK>;          // a scores tile as a wgmma operand
  using state = warpgroup::accumulator<VALUE_BLOCK>;           // a slab: the warp's 16 feature rows
  using feature_cols = register_tile<T, CHUNK, BASE_TILE, register_layout::col>;  // 16 features of a chunk
  using feature_rows = register_tile<T, BASE_TILE, CHUNK>;     // their transpose: A of a state update
  using feature_sums = per_row_vector<feature_rows, float>;    // an fp32 sum over the warp's 16 features
  using piece = warpgroup::accumulator<PIECE>;                 // 16 positions x a piece of the features
  using piece_vector = per_col_vector<piece, float>;
  using row_vector = per_row_vector<scores, float>;            // the warp's 16 rows
  using chunk_vector = per_col_vector<scores, float>;          // the chunk's 64 positions
  static_assert(std::is_same_v<chunk_vector, per_col_vector<feature_rows, float>>,
                "one vector type serves every per-position use");
  using gradient_shape = causal_backward::gradient_shape<FEATURES>;

  enum class barrier_id : int {
    chunk_done = FIRST_NAMED_BARRIER,  // the warpgroup's products of a chunk are done
    copies_written,                    // the state's copies (and grad_v's tile) are written
    count,
  };
  static_assert(fits_named_barriers<barrier_id>());

  // The warp's first feature row of slab t; the warp owns none when it is F or more.
  __device__ static int first_feature(int slab) { return slab * SLAB_FEATURES + warpgroup::warp_row(); }

  // The warp's rows of X_t^T over the chunk's positions (zero rows past F).
  __device__ static void transposed_features(feature_rows& dst, const qk_tile& x, int slab) {
    const int feature0 = first_feature(slab);
    if (feature0 < FEATURES) {
      feature_cols cols;
      warp::load(cols, x, 0, feature0);
      warp::transpose(dst, cols);
    } else {
      warp::zero(dst);
    }
  }

  // The state's 16-bit copy and (carrying c) its fp32 feature sums, each warp its own feature rows.
  template <typename States, typename Sums>
  __device__ static void write_copies(state_copy_tile& copy, float* sums_copy, const States& states, const Sums& sums,
                                      bool carries_delta) {
#pragma unroll
    for (int t = 0; t < SLABS; ++t) {
      const int feature0 = first_feature(t);
      if (feature0 >= FEATURES) continue;
      warp::store(copy, states[t], feature0, 0);
      if (carries_delta) warp::store(sums_copy + feature0, sums[t]);
    }
  }
};

// ------------------------------------------------------------------------------------ grad_q

template <typename T, int FEATURES>
struct gradient_common<T, FEATURES>::dq_kernel : gradient_common {
  struct stage {
    qk_tile k;
    value_tile v, g;
  };
  static constexpr uint32_t stage_bytes[] = {qk_tile::bytes + 2 * value_tile::bytes};

  struct scratch {
    state_copy_tile state_copy;  // M's 16-bit copy: B of G M^T
    float key_sum[FEATURES];     // the key sum's fp32 copy, for every warp's queries
  };

  struct params {
    CUtensorMap k, v, grad_out;
    gradient_shape shape;
    T* grad_q;  // written here when one value block covers Dv
  };
  using context = pipeline::task_context<dq_kernel>;
  using inputs = pipeline::stage_inputs<dq_kernel>;

  struct consumer_state {
    state m[SLABS];               // sum_j k_j v_j^T over the earlier chunks
    feature_sums key_sum[SLABS];  // sum_j k_j over the earlier chunks (value block 0, normalised)
  };

  __host__ __device__ static pipeline::head_block_order tasks(const params& p) {
    return {p.shape.value_blocks, p.shape.heads, p.shape.batch, false};
  }
  __device__ static int iterations(const params& p, pipeline::head_block) { return ceil_div(p.shape.rows, CHUNK); }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.k);
    tma::prefetch_descriptor(p.v);
    tma::prefetch_descriptor(p.grad_out);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int chunk, int, stage& s, mbarrier& full) {
    const int k_index[4] = {task.batch, task.head, chunk * CHUNK, 0};
    const int v_index[4] = {task.batch, task.head, chunk * CHUNK, task.block * VALUE_BLOCK};
    tma::load(s.k, p.k, full, k_index);
    tma::load(s.v, p.v, full, v_index);
    tma::load(s.g, p.grad_out, full, v_index);
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const gradient_shape& sh = ctx.params.shape;
    const int warp_row0 = warpgroup::warp_row();
    const bool carries_delta = sh.normalize && ctx.task.block == 0;
#pragma unroll
    for (int t = 0; t < SLABS; ++t) {
      warp::zero(st.m[t]);
      warp::zero(st.key_sum[t]);
    }
    // Zero copies, so that the first chunk's earlier terms need no branch (a wgmma on one side of
    // a branch makes ptxas serialise the accumulators).
    write_copies(ctx.scratch.state_copy, ctx.scratch.key_sum, st.m, st.key_sum, carries_delta);
    publish(barrier_id::copies_written, WARPGROUP_THREADS);

    auto at = in.first();
    for (int chunk = 0; chunk < ctx.iterations; ++chunk, at.advance()) {
      const stage& s = in.wait(at);

      scores dp;
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(dp, s.g, 0, s.v, 0, false);
      warpgroup::commit();
      row_vector inverse_denominator, denominator_grad;
      sh.load_statistics(inverse_denominator, denominator_grad, ctx.task, chunk * CHUNK + warp_row0, carries_delta);
      warpgroup::wait<0>(dp);

      // Inside the chunk: dA = tril(dP / d + c).
      warp::mul_row(dp, dp, inverse_denominator);
      warp::add_row(dp, dp, denominator_grad);
      warp::tril(dp, {warp_row0, 0}, 0, 0.0f);
      weights da;
      warp::copy(da, dp);

      // grad_q a piece at a time: dA K_t and the earlier chunks' G M_t^T, combined with c key_sum_t.
#pragma unroll
      for (int t = 0; t < PIECES; ++t) {
        piece own, earlier;
        warpgroup::fence();
        warpgroup::mma<operand_major::k, operand_major::k>(earlier, s.g, 0, ctx.scratch.state_copy, t * PIECE, false);
        warpgroup::mma<operand_major::mn>(own, da, s.k, t * PIECE, false);
        warpgroup::commit();
        piece_vector key_sum;
        if (carries_delta) {
          warp::load(key_sum, ctx.scratch.key_sum + t * PIECE);
        } else {
          warp::zero(key_sum);
        }
        warpgroup::wait<0>(own, earlier, da);
        warp::map<earlier_query_gradient>(own, own, earlier, broadcast<tile_axis::rows, row_vector>{inverse_denominator},
                                          broadcast<tile_axis::rows, row_vector>{denominator_grad},
                                          broadcast<tile_axis::cols, piece_vector>{key_sum});
        sh.store_gradient(sh.partial_q, ctx.params.grad_q, ctx.task, chunk * CHUNK + warp_row0, t * PIECE, own);
      }

      // This chunk into the state (and the key sum). Each update's register operand stays pinned
      // until the update after the next is issued.
      feature_rows operand[OPERAND_BUFFERS];
#pragma unroll
      for (int t = 0; t < SLABS; ++t) {
        feature_rows& k_t = operand[t % OPERAND_BUFFERS];
        transposed_features(k_t, s.k, t);
        if (carries_delta) warp::row_sum(st.key_sum[t], k_t, st.key_sum[t]);
        warpgroup::fence();
        warpgroup::mma<operand_major::mn>(st.m[t], k_t, s.v, 0, true);
        warpgroup::commit();
        if constexpr (OPERAND_BUFFERS > 1) {
          warpgroup::wait<1>(operand[(t + 1) % OPERAND_BUFFERS]);
        } else {
          warpgroup::wait<1>();
        }
      }
      warpgroup::wait<0>();
#pragma unroll
      for (int b = 0; b < OPERAND_BUFFERS; ++b) warpgroup::pin(operand[b]);
#pragma unroll
      for (int t = 0; t < SLABS; ++t) warpgroup::pin(st.m[t]);
      in.release(at);

      barrier_sync(barrier_id::chunk_done, WARPGROUP_THREADS);
      if (chunk + 1 < ctx.iterations) {
        write_copies(ctx.scratch.state_copy, ctx.scratch.key_sum, st.m, st.key_sum, carries_delta);
      }
      publish(barrier_id::copies_written, WARPGROUP_THREADS);  // the stmatrix writes must be visible to wgmma
    }
  }
};

// ------------------------------------------------------------------------------- grad_k, grad_v

template <typename T, int FEATURES>
struct gradient_common<T, FEATURES>::dkdv_kernel : gradient_common {
  // At F = 256, R (64 registers), the two piece accumulators and grad_v outgrow 240 registers:
  // the whole register file of its one block an SM.
  static constexpr int consumer_registers = wide ? 256 : gradient_common::consumer_registers;

  struct stage {
    qk_tile q, k;
    value_tile v, g;
  };
  static constexpr uint32_t stage_bytes[] = {2 * qk_tile::bytes + 2 * value_tile::bytes};

  struct scratch {
    state_copy_tile state_copy;  // R's 16-bit copy: B of K R and of V R^T
    value_tile staging[chunked_causal::STAGING_TILES];  // grad_v of alternate chunks, while TMA stores the other
    float query_sum[FEATURES];   // the c-weighted query sum's fp32 copy, for every warp's keys
  };

  struct params {
    CUtensorMap q, k, v, grad_out, grad_v;
    gradient_shape shape;
    T* grad_k;  // written here when one value block covers Dv
  };
  using context = pipeline::task_context<dkdv_kernel>;
  using inputs = pipeline::stage_inputs<dkdv_kernel>;

  struct consumer_state {
    state r[SLABS];                 // sum_i q_i g~_i^T over the later chunks
    feature_sums query_sum[SLABS];  // sum_i c_i q_i over the later chunks (value block 0, normalised)
    chunked_causal::staging_ring grad_v_stores;  // picks the staging tile of each grad_v chunk
  };

  __host__ __device__ static pipeline::head_block_order tasks(const params& p) {
    return {p.shape.value_blocks, p.shape.heads, p.shape.batch, false};
  }
  __device__ static int iterations(const params& p, pipeline::head_block) { return ceil_div(p.shape.rows, CHUNK); }
  // Iteration i works on chunk last - i.
  __device__ static int chunk_of(const params& p, int iteration) { return iterations(p, {}) - 1 - iteration; }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.q);
    tma::prefetch_descriptor(p.k);
    tma::prefetch_descriptor(p.v);
    tma::prefetch_descriptor(p.grad_out);
    tma::prefetch_descriptor(p.grad_v);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int iteration, int, stage& s,
                              mbarrier& full) {
    const int chunk = chunk_of(p, iteration);
    const int qk_index[4] = {task.batch, task.head, chunk * CHUNK, 0};
    const int v_index[4] = {task.batch, task.head, chunk * CHUNK, task.block * VALUE_BLOCK};
    tma::load(s.q, p.q, full, qk_index);
    tma::load(s.k, p.k, full, qk_index);
    tma::load(s.v, p.v, full, v_index);
    tma::load(s.g, p.grad_out, full, v_index);
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const gradient_shape& sh = ctx.params.shape;
    const int warp_row0 = warpgroup::warp_row();
    const bool leader = is_warpgroup_leader();
    const bool carries_delta = sh.normalize && ctx.task.block == 0;
#pragma unroll
    for (int t = 0; t < SLABS; ++t) {
      warp::zero(st.r[t]);
      warp::zero(st.query_sum[t]);
    }
    // Zero copies: the last chunk's later terms need no branch.
    write_copies(ctx.scratch.state_copy, ctx.scratch.query_sum, st.r, st.query_sum, carries_delta);
    publish(barrier_id::copies_written, WARPGROUP_THREADS);

    auto at = in.first();
    for (int iteration = 0; iteration < ctx.iterations; ++iteration, at.advance()) {
      const int chunk = chunk_of(ctx.params, iteration);
      const stage& s = in.wait(at);

      // Keys j are the warp's rows, the chunk's queries i the columns.
      scores sc, dp;
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(sc, s.k, 0, s.q, 0, false);
      warpgroup::mma<operand_major::k, operand_major::k>(dp, s.v, 0, s.g, 0, false);
      warpgroup::commit();
      weights a, ds;
      {
        // The statistics are read again (from L1) where R needs them: registers are short.
        chunk_vector inverse_denominator, denominator_grad;
        sh.load_statistics(inverse_denominator, denominator_grad, ctx.task, chunk * CHUNK, carries_delta);
        warpgroup::wait<0>(sc, dp);

        // Inside the chunk (queries i >= keys j): dS^T = dP^T / d + c, A^T / d.
        const auto later_query = [](int key, int query) { return query >= key; };
        warp::mul_col(dp, dp, inverse_denominator);
        warp::add_col(dp, dp, denominator_grad);
        warp::mask(dp, {warp_row0, 0}, later_query, 0.0f);
        warp::copy(ds, dp);
        warp::mul_col(sc, sc, inverse_denominator);
        warp::mask(sc, {warp_row0, 0}, later_query, 0.0f);
        warp::copy(a, sc);
      }

      // grad_v = A^T G~ (the 1 / d is in a) + K R (R's copy: the later chunks).
      state grad_v;
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(grad_v, a, s.g, 0, false);
      warpgroup::mma<operand_major::k, operand_major::mn>(grad_v, s.k, 0, ctx.scratch.state_copy, 0, true);
      warpgroup::commit();

      // grad_k a piece at a time: the later chunks' V R_t^T, then dS^T Q_t into the same accumulator
      // (neither is scaled), plus query_sum_t.
#pragma unroll
      for (int t = 0; t < PIECES; ++t) {
        piece grad_k;
        warpgroup::fence();
        warpgroup::mma<operand_major::k, operand_major::k>(grad_k, s.v, 0, ctx.scratch.state_copy, t * PIECE, false);
        warpgroup::mma<operand_major::mn>(grad_k, ds, s.q, t * PIECE, true);
        warpgroup::commit();
        warpgroup::wait<0>(grad_k, ds, a, grad_v);
        if (carries_delta) {
          piece_vector query_sum;
          warp::load(query_sum, ctx.scratch.query_sum + t * PIECE);
          warp::add_col(grad_k, grad_k, query_sum);
        }
        sh.store_gradient(sh.partial_k, ctx.params.grad_k, ctx.task, chunk * CHUNK + warp_row0, t * PIECE, grad_k);
      }

      // This chunk into R: Q_t^T with each query's column scaled by 1 / d, times G; and c q into
      // the query sum (fp32).
      chunk_vector inverse_denominator, denominator_grad;
      sh.load_statistics(inverse_denominator, denominator_grad, ctx.task, chunk * CHUNK, carries_delta);
      feature_rows operand[OPERAND_BUFFERS];
#pragma unroll
      for (int t = 0; t < SLABS; ++t) {
        feature_rows& q_t = operand[t % OPERAND_BUFFERS];
        transposed_features(q_t, s.q, t);
        if (carries_delta) {
          scores weighted;  // the warp's 16 features x the chunk's queries, times c
          warp::copy(weighted, q_t);
          warp::mul_col(weighted, weighted, denominator_grad);
          warp::row_sum(st.query_sum[t], weighted, st.query_sum[t]);
        }
        warp::mul_col(q_t, q_t, inverse_denominator);
        warpgroup::fence();
        warpgroup::mma<operand_major::mn>(st.r[t], q_t, s.g, 0, true);
        warpgroup::commit();
        if constexpr (OPERAND_BUFFERS > 1) {
          warpgroup::wait<1>(operand[(t + 1) % OPERAND_BUFFERS]);
        } else {
          warpgroup::wait<1>();
        }
      }
      warpgroup::wait<0>();
#pragma unroll
      for (int b = 0; b < OPERAND_BUFFERS; ++b) warpgroup::pin(operand[b]);
#pragma unroll
      for (int t = 0; t < SLABS; ++t) warpgroup::pin(st.r[t]);
      in.release(at);

      store_chunk(ctx, st, grad_v, chunk, iteration + 1 < ctx.iterations, carries_delta, leader);
    }
  }

  // Hands R to the next chunk (its copies) and grad_v's tile to TMA through the staging ring, so
  // that one store is in flight while the next is written.
  __device__ static void store_chunk(const context& ctx, consumer_state& st, const state& grad_v, int chunk, bool more,
                                     bool carries_delta, bool leader) {
    value_tile& staging = ctx.scratch.staging[st.grad_v_stores.slot()];
    st.grad_v_stores.acquire(leader, barrier_id::chunk_done);
    if (more) write_copies(ctx.scratch.state_copy, ctx.scratch.query_sum, st.r, st.query_sum, carries_delta);
    warpgroup::store<0>(staging, grad_v);
    // The stmatrix writes must be visible to wgmma and to the copy engine.
    publish(barrier_id::copies_written, WARPGROUP_THREADS);
    if (leader) {
      const int index[4] = {ctx.task.batch, ctx.task.head, chunk * CHUNK, ctx.task.block * VALUE_BLOCK};
      tma::store(ctx.params.grad_v, staging, index);
    }
    st.grad_v_stores.commit(leader);
  }

  __device__ static void finish(const params&, scratch&, int) { chunked_causal::staging_ring::drain(); }
};

// ----------------------------------------------------------------------------------- host

using causal_backward::workspace_view;

// gradient_stride: elements between rows of grad_q / grad_k (F, or 2F for a feature half).
template <typename T, int FEATURES>
cudaError_t run_dq(const backward_problem& pr, const workspace_view& w, int gradient_stride, cudaStream_t stream) {
  using K = typename gradient_common<T, FEATURES>::dq_kernel;
  typename K::params p;
  p.k = make_tma_map<typename K::qk_tile>(heads_layout<T>(pr.k));
  p.v = make_tma_map<typename K::value_tile>(heads_layout<T>(pr.v));
  p.grad_out = make_tma_map<typename K::value_tile>(heads_layout<T>(pr.grad_out));
  p.shape = causal_backward::shape_of<FEATURES>(pr, w, K::VALUE_BLOCK);
  p.shape.gradient_stride = gradient_stride;
  p.grad_q = static_cast<T*>(pr.grad_q);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

template <typename T, int FEATURES>
cudaError_t run_dkdv(const backward_problem& pr, const workspace_view& w, int gradient_stride, cudaStream_t stream) {
  using K = typename gradient_common<T, FEATURES>::dkdv_kernel;
  typename K::params p;
  p.q = make_tma_map<typename K::qk_tile>(heads_layout<T>(pr.q));
  p.k = make_tma_map<typename K::qk_tile>(heads_layout<T>(pr.k));
  p.v = make_tma_map<typename K::value_tile>(heads_layout<T>(pr.v));
  p.grad_out = make_tma_map<typename K::value_tile>(heads_layout<T>(pr.grad_out));
  p.grad_v = make_tma_map<typename K::value_tile>(heads_layout<T>(causal_backward::grad_v_view(pr)));
  p.shape = causal_backward::shape_of<FEATURES>(pr, w, K::VALUE_BLOCK);
  p.shape.gradient_stride = gradient_stride;
  p.grad_k = static_cast<T*>(pr.grad_k);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

// F = 256 with Dv within one 128-feature value block runs as two F = 128 problems, one per half of
// the features: a half's grad_q and grad_k need only its own columns of q and k (dA and the row
// statistics do not depend on F), so they are stored straight into their columns, where a 32-column
// value-block split would write fp32 partials of all 256 features per block and reduce them (ncu:
// 6.4 GB of partial traffic at B = 8, H = 16, N = 4096; benchmarks/results/linear_attention.md). grad_v sums over
// the features (A = Q K^T and K R), so the second half's is staged in the workspace and added.
constexpr int SPLIT_FEATURES = 256;
constexpr int HALF_FEATURES = SPLIT_FEATURES / 2;

bool splits_features(int64_t features, int64_t value_dim) {
  return features == SPLIT_FEATURES && value_dim <= value_block_for(HALF_FEATURES);
}

// Elements of the staged grad_v, (B, H, N, Dv) in a 16-bit type, counted in floats.
int64_t staged_grad_v_floats(int64_t batch, int64_t heads, int64_t rows, int64_t value_dim) {
  return ceil_div<int64_t>(batch * heads * rows * value_dim, 2);
}

constexpr int ADD_THREADS = 256;
constexpr int VECTOR_BYTES = 16;  // grad_v moves in 16-byte vectors

// out += addend, one 16-byte vector of 16-bit elements a thread, the sum rounded once.
template <typename T>
__global__ void __launch_bounds__(ADD_THREADS) add_into_kernel(T* out, const T* addend, int64_t vectors) {
  constexpr int per_vector = VECTOR_BYTES / int(sizeof(T));
  const int64_t i = blockIdx.x * int64_t(ADD_THREADS) + threadIdx.x;
  if (i >= vectors) return;
  uint4 sum = reinterpret_cast<const uint4*>(out)[i];
  const uint4 other = reinterpret_cast<const uint4*>(addend)[i];
  T* x = reinterpret_cast<T*>(&sum);
  const T* y = reinterpret_cast<const T*>(&other);
#pragma unroll
  for (int e = 0; e < per_vector; ++e) x[e] = convert<T>(convert<float>(x[e]) + convert<float>(y[e]));
  reinterpret_cast<uint4*>(out)[i] = sum;
}

template <typename T>
backward_problem feature_half(const backward_problem& pr, int half, void* grad_v) {
  const int64_t first = int64_t(half) * HALF_FEATURES;
  backward_problem h = pr;
  h.q.data = static_cast<const T*>(pr.q.data) + first;
  h.k.data = static_cast<const T*>(pr.k.data) + first;
  h.q.dim = h.k.dim = HALF_FEATURES;
  h.grad_q = static_cast<T*>(pr.grad_q) + first;
  h.grad_k = static_cast<T*>(pr.grad_k) + first;
  h.grad_v = grad_v;
  return h;
}

template <typename T>
cudaError_t run_feature_halves(const backward_problem& pr, cudaStream_t stream) {
  const int value_block = value_block_for(HALF_FEATURES);
  const workspace_view w = causal_backward::split_workspace(pr, value_block);
  if (pr.normalize) {
    if (const cudaError_t err = causal_backward::run_statistics<T>(pr, w, stream); err != cudaSuccess) return err;
  }
  T* staged_grad_v = reinterpret_cast<T*>(
      pr.workspace + causal_backward::workspace_floats(pr.q.batch, pr.q.heads, pr.q.rows, pr.v.dim, HALF_FEATURES,
                                                       pr.normalize, value_block));
  for (int half = 0; half < 2; ++half) {
    const backward_problem h = feature_half<T>(pr, half, half == 0 ? pr.grad_v : staged_grad_v);
    if (const cudaError_t err = run_dq<T, HALF_FEATURES>(h, w, SPLIT_FEATURES, stream); err != cudaSuccess) return err;
    if (const cudaError_t err = run_dkdv<T, HALF_FEATURES>(h, w, SPLIT_FEATURES, stream); err != cudaSuccess) {
      return err;
    }
  }
  const int64_t vectors = pr.v.batch * pr.v.heads * pr.v.rows * pr.v.dim / (VECTOR_BYTES / int64_t(sizeof(T)));
  const unsigned blocks = unsigned(ceil_div<int64_t>(vectors, ADD_THREADS));
  return pipeline::launch(add_into_kernel<T>, blocks, ADD_THREADS, 0, stream, static_cast<T*>(pr.grad_v),
                          static_cast<const T*>(staged_grad_v), vectors);
}

template <typename T, int FEATURES>
cudaError_t run(const backward_problem& pr, cudaStream_t stream) {
  if constexpr (FEATURES == SPLIT_FEATURES) {
    if (splits_features(FEATURES, pr.v.dim)) return run_feature_halves<T>(pr, stream);
  }
  return causal_backward::run<T, FEATURES>(pr, value_block_for(FEATURES), stream, [&](const workspace_view& w) {
    if (const cudaError_t err = run_dq<T, FEATURES>(pr, w, FEATURES, stream); err != cudaSuccess) return err;
    return run_dkdv<T, FEATURES>(pr, w, FEATURES, stream);
  });
}

template <typename F>
auto dispatch(const backward_problem& p, F&& f) {
  return tk::dispatch<kernel_dtypes, feature_dims>(
      [&]<element_type E, int FEATURES>() { return f.template operator()<element_t<E>, FEATURES>(); }, p.dtype,
      int(p.q.dim));
}

}  // namespace

int64_t backward_workspace_floats(int64_t batch, int64_t heads, int64_t rows, int64_t features, int64_t value_dim,
                                  bool normalize) {
  if (splits_features(features, value_dim)) {
    return causal_backward::workspace_floats(batch, heads, rows, value_dim, HALF_FEATURES, normalize,
                                             value_block_for(HALF_FEATURES)) +
           staged_grad_v_floats(batch, heads, rows, value_dim);
  }
  return causal_backward::workspace_floats(batch, heads, rows, value_dim, int(features), normalize,
                                           value_block_for(int(features)));
}

std::string unsupported_reason(const backward_problem& p) {
  if (!kernel_dtypes::contains(p.dtype)) return "the kernels take bf16 and fp16";
  if (!feature_dims::contains(p.q.dim)) return "the feature dim must be one of " + feature_dims::names();
  if (std::string r = chunked_causal::sequence_shape_reason(p.q, p.k, p.v, causal_backward::VALUE_BLOCK); !r.empty()) return r;
  if (std::string r = causal_backward::inputs_reason(p); !r.empty()) return r;
  return dispatch(p, [&]<typename T, int FEATURES>() {
    using tiles = gradient_common<T, FEATURES>;
    return causal_backward::layout_reasons<typename tiles::qk_tile, typename tiles::value_tile, T>(p);
  });
}

cudaError_t launch(const backward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T, int FEATURES>() { return run<T, FEATURES>(p, stream); });
}

}  // namespace tk::linear
