// Based attention backward: grad_q, grad_k, grad_v of the causal Taylor linear attention.
//
// With s_ij = q_i . k_j / 4, A_ij = 1 + s + s^2 / 2 (j <= i), g = grad_out and, normalised,
// d_i = denominator_i + eps:
//   g~_i = g_i / d_i,  c_i = -(g_i . out_i) / d_i       (unnormalised: g~ = g, c = 0)
//   dA_ij = g~_i . v_j + c_i,   dS_ij = dA_ij (1 + s_ij) / 4
//   grad_q = dS K,  grad_k = dS^T Q,  grad_v = A^T G~
// (c is the gradient of the denominator, i.e. of a value column of ones.)
//
// Four launches on one stream, no atomics (bitwise reproducible):
//   statistics_kernel   (normalised only) per row: 1 / d_i and c_i, over all Dv columns
//   dq_kernel           one task = one (batch, head) and a 32-column value block; walks the chunks
//                       first to last like the forward, keeping the forward's moments of phi(k) v^T
//                       (five slabs of wgmma accumulators) and, for c, sum k k^T and sum k:
//                         S = Q K^T, dP = G V^T;  dS = tril(dP / d + c) (1 + S/4) / 4
//                         grad_q = dS K  +  VJP_phi(q)[(moments^T g~)  +  c (moments of phi(k))]
//                       where moments^T g~ is G times each slab's copy (one 64 x 64 wgmma per slab)
//                       contracted with q per row
//   dkdv_kernel         its mirror: walks the chunks last to first keeping R = sum_{i later}
//                       phi(q_i) g~_i^T (five slabs) and, for c, sum c q q^T and sum c q:
//                         S^T = K Q^T, dP^T = V G^T;  keys j are rows, queries i >= j columns
//                         grad_v = triu(A^T) G~  +  phi(K) R
//                         grad_k = triu(dS^T) Q  +  VJP_phi(k)[R v + (moments of c phi(q))]
//   reduce_kernel       grad_q and grad_k: the sum over value blocks of the fp32 partials that
//                       dq_kernel and dkdv_kernel write (grad_q and grad_k contract over all of Dv),
//                       converted to the input dtype
// The c terms belong to value block 0 alone. grad_v needs no reduction: its columns are the block's.
// The statistics and reduce kernels, the workspace and the host checks are chunked_causal_bwd.cuh's,
// shared with the generic linear attention backward.
//
// VJP of phi at x applied to u (the slab copies fold phi's constants in, see based_attention.cuh):
// d/dx_a [sum_bc x_b x_c U_(b,c) + sum_b x_b U_b] = 2 sum_b x_b U_(a,b) + U_a, U being symmetric in
// (a, b) (a moment of y y^T). Positions past N arrive as zeros from TMA with zero statistics, so they
// add nothing to the states, and reach only rows that are never stored.
#include "based_attention.h"
#include "based_attention.cuh"
#include "kernels/common/chunked_causal_bwd.cuh"
#include "kernels/common/heads_layout.cuh"
#include "kernels/common/row_dot.cuh"
#include "tk/tk.cuh"

namespace tk::based {
namespace {

using warpgroup::operand_major;

using kernel_dtypes = one_of<element_type::bf16, element_type::fp16>;

namespace causal_backward = tk::causal_backward;
static_assert(causal_backward::CHUNK == CHUNK && causal_backward::VALUE_BLOCK == VALUE_BLOCK,
              "the shared backward pieces use the Based chunk and value block");
using gradient_shape = causal_backward::gradient_shape<FEATURES>;

// ds / d(q.k) per unit dA: f'(s) / sqrt(F) with f(s) = 1 + s + s^2 / 2.
struct taylor_slope_times {
  __device__ static float apply(float grad, float qk) { return grad * (1.0f + qk * SCORE_SCALE) * SCORE_SCALE; }
};

// The parts the two gradient kernels share. The kernels are its members (defined below, deriving
// from it), so that their hooks name all of this directly and the pipeline template still finds
// the plan as K::stages etc.
template <typename T>
struct gradient_common : based_plan {
  struct dq_kernel;
  struct dkdv_kernel;

  using qk_tile = shared_tile<T, CHUNK, FEATURES>;
  using value_tile = shared_tile<T, CHUNK, VALUE_BLOCK>;           // v, grad_out (and grad_v's staging)
  using state_tile = shared_tile<T, SLAB_FEATURES, VALUE_BLOCK>;   // a slab's scaled copy
  using scores = warpgroup::accumulator<CHUNK>;                    // a warp's 16 rows x 64 columns
  using slab_products = warpgroup::accumulator<SLAB_FEATURES>;     // 16 positions x a slab's features
  using weights = register_tile<T, BASE_TILE, CHUNK>;              // a scores tile as a wgmma operand
  using value_accumulator = warpgroup::accumulator<VALUE_BLOCK>;
  using slabs = taylor_slabs<T>;
  using position_rows = typename slabs::position_rows;
  using position_cols = typename slabs::position_cols;
  using slab_rows = typename slabs::slab_rows;
  using small_tile = typename slabs::small_tile;                   // also a warp's 16 x F gradient
  using row_vector = per_row_vector<scores, float>;                // the warp's 16 rows
  using chunk_vector = per_col_vector<scores, float>;              // the chunk's 64 positions
  static_assert(std::is_same_v<chunk_vector, typename slabs::template position_vector<true>> &&
                    std::is_same_v<chunk_vector, per_row_vector<position_cols, float>>,
                "one vector type serves every per-position use");
  using gradient = warpgroup::accumulator<FEATURES>;
  static_assert(std::is_same_v<gradient, small_tile>, "the F-wide gradient accumulator is the small tile");

  struct stage {
    qk_tile q, k;
    value_tile v, g;
  };
  static constexpr uint32_t stage_bytes[] = {2 * qk_tile::bytes + 2 * value_tile::bytes};

  enum class barrier_id : int {
    chunk_done = FIRST_NAMED_BARRIER,  // the warpgroup's products of a chunk are done
    copies_written,                    // the states' copies (and grad_v's tile) are written
    count,
  };
  static_assert(fits_named_barriers<barrier_id>());

  __device__ static void load_chunk(const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& v,
                                    const CUtensorMap& g, pipeline::head_block task, int chunk, stage& s,
                                    mbarrier& full) {
    const int qk_index[4] = {task.batch, task.head, chunk * CHUNK, 0};
    const int v_index[4] = {task.batch, task.head, chunk * CHUNK, task.block * VALUE_BLOCK};
    tma::load(s.q, q, full, qk_index);
    tma::load(s.k, k, full, qk_index);
    tma::load(s.v, v, full, v_index);
    tma::load(s.g, g, full, v_index);
  }

  // dst[:, col] += scale * column, for a column index the same on every lane.
  __device__ static void add_column(small_tile& dst, const per_row_vector<small_tile, float>& column, int col,
                                    float scale) {
    for_each_pair<small_tile>([&](int br, int bc, int q) {
      const float value = scale * column.values[br][fragment::row_half(q)];
      auto& pair = dst.pairs[br][bc][q];
      if (fragment::pair_element_coord<register_layout::row>(q, 0).col + BASE_TILE * bc == col) pair.x += value;
      if (fragment::pair_element_coord<register_layout::row>(q, 1).col + BASE_TILE * bc == col) pair.y += value;
    });
  }

  // dst += the VJP of phi at the warp's positions x applied to slab t's part of u (products: x's
  // positions times the slab's features, the copies' scales included): 2 sum_b x_b u_(a,b) into
  // column a = 4 t + kb for each k16 block kb; the first-order block as it stands.
  //
  // Callers run the second-order slabs in a loop that is NOT unrolled. Unrolled, the per-lane
  // select chains of column a and column a + 8 (even a < 8: same lane predicates, same u registers,
  // as every slab's u reuses them) were PTX expressions that differ only by the wgmma redefining u
  // between them, and ptxas (CUDA 13.0) merged them: columns 0, 2, 4, 6 received the sums of
  // columns 8, 10, 12, 14 and lost their own (the SASS never read u's even k16 blocks of slabs 0
  // and 1), so grad_q and grad_k were wrong past the first chunk. One loop body has one chain.
  __device__ static void add_feature_gradient(small_tile& dst, const slab_products& u, const position_rows& x,
                                              int slab) {
    if (slab < SECOND_ORDER_SLABS) {
      const auto block_gradient = [&](const small_tile& block, int kb) {
        small_tile weighted;
        warp::mul(weighted, block, x);
        per_row_vector<small_tile, float> sum;
        warp::row_sum(sum, weighted);
        add_column(dst, sum, slab * WARPGROUP_WARPS + kb, 2.0f);  // x_a x_b and x_b x_a: one term twice
      };
      block_gradient(warp::columns<0 * BASE_TILE, BASE_TILE>(u), 0);
      block_gradient(warp::columns<1 * BASE_TILE, BASE_TILE>(u), 1);
      block_gradient(warp::columns<2 * BASE_TILE, BASE_TILE>(u), 2);
      block_gradient(warp::columns<3 * BASE_TILE, BASE_TILE>(u), 3);
    } else {
      static_assert(FIRST_ORDER_WARP == 0, "the first-order features are the lower-order slab's first block");
      warp::add(dst, dst, warp::columns<0, FEATURES>(u));  // the constant feature has no gradient
    }
  }

  // Writes the states' scaled copies for the next chunk (not after the last) once every warp's
  // products of this chunk are done reading the old ones.
  template <typename States>
  __device__ static void write_copies(state_tile (&copies)[SLABS], const States& states, bool more) {
    if (!more) return;
#pragma unroll
    for (int t = 0; t < SLABS; ++t) {
      value_accumulator scaled;
      warp::mul(scaled, states[t], slabs::copy_scale(t));
      warpgroup::store<0>(copies[t], scaled);
    }
  }
};

// ------------------------------------------------------------------------------------ grad_q

template <typename T>
struct gradient_common<T>::dq_kernel : gradient_common {
  struct scratch {
    state_tile moments[SLABS];
  };

  struct params {
    CUtensorMap q, k, v, grad_out;
    gradient_shape shape;
    T* grad_q;  // written here when one value block covers Dv
  };
  using context = pipeline::task_context<dq_kernel>;
  using inputs = pipeline::stage_inputs<dq_kernel>;

  struct consumer_state {
    value_accumulator m[SLABS];  // sum_j phi(k_j) v_j^T over the earlier chunks
    small_tile key_gram;         // sum_j k_j k_j^T (value block 0, normalised)
    small_tile key_sum;          // every row: sum_j k_j
  };

  __host__ __device__ static pipeline::head_block_order tasks(const params& p) {
    return {p.shape.value_blocks, p.shape.heads, p.shape.batch, false};
  }
  __device__ static int iterations(const params& p, pipeline::head_block) { return ceil_div(p.shape.rows, CHUNK); }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.q);
    tma::prefetch_descriptor(p.k);
    tma::prefetch_descriptor(p.v);
    tma::prefetch_descriptor(p.grad_out);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int chunk, int, stage& s, mbarrier& full) {
    load_chunk(p.q, p.k, p.v, p.grad_out, task, chunk, s, full);
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const gradient_shape& sh = ctx.params.shape;
    const int warp_row0 = warpgroup::warp_row();
    const bool carries_delta = sh.normalize && ctx.task.block == 0;
    for (int t = 0; t < SLABS; ++t) warp::zero(st.m[t]);
    warp::zero(st.key_gram);
    warp::zero(st.key_sum);

    auto at = in.first();
    for (int chunk = 0; chunk < ctx.iterations; ++chunk, at.advance()) {
      const stage& s = in.wait(at);
      const bool has_earlier = chunk > 0;

      scores sc, dp;
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(sc, s.q, 0, s.k, 0, false);
      warpgroup::mma<operand_major::k, operand_major::k>(dp, s.g, 0, s.v, 0, false);
      warpgroup::commit();
      row_vector inverse_denominator, denominator_grad;
      sh.load_statistics(inverse_denominator, denominator_grad, ctx.task, chunk * CHUNK + warp_row0, carries_delta);
      position_rows q;
      warp::load(q, s.q, warp_row0, 0);
      position_cols k;
      warp::load(k, s.k);
      warpgroup::wait<0>(sc, dp);

      // Inside the chunk: dS = tril(dP / d + c) (1 + S/4) / 4, grad_q = dS K.
      warp::mul_row(dp, dp, inverse_denominator);
      warp::add_row(dp, dp, denominator_grad);
      warp::map<taylor_slope_times>(dp, dp, sc);
      warp::tril(dp, {warp_row0, 0}, 0, 0.0f);
      weights ds;
      warp::copy(ds, dp);
      gradient grad;
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(grad, ds, s.k, 0, false);
      warpgroup::commit();

      // Earlier chunks: u = moments^T g per slab (G times the slab's copy), then its VJP.
      small_tile earlier;
      warp::zero(earlier);
      if (has_earlier) {
        const auto slab_gradient = [&](int t) {
          slab_products u;
          warpgroup::fence();
          warpgroup::mma<operand_major::k, operand_major::k>(u, s.g, 0, ctx.scratch.moments[t], 0, false);
          warpgroup::commit();
          warpgroup::wait<0>(u, ds, grad);
          add_feature_gradient(earlier, u, q, t);
        };
        // Not unrolled: see add_feature_gradient.
#pragma unroll 1
        for (int t = 0; t < SECOND_ORDER_SLABS; ++t) slab_gradient(t);
        slab_gradient(SECOND_ORDER_SLABS);
        warp::mul_row(earlier, earlier, inverse_denominator);
        if (carries_delta) {
          // c_i times the VJP of phi(q_i) . sum_j phi(k_j): key_sum / 4 + key_gram q_i / 16.
          small_tile moment;
          slabs::moment_rows(moment, st.key_gram, st.key_sum, q, SECOND_ORDER_GRADIENT_SCALE, SCORE_SCALE);
          warp::mul_row(moment, moment, denominator_grad);
          warp::add(earlier, earlier, moment);
        }
      }

      // This chunk into the moments. Each product's register operand stays pinned until the
      // product after the next is issued.
      slab_rows operand[OPERAND_BUFFERS];
#pragma unroll
      for (int t = 0; t < SLABS; ++t) {
        slabs::transposed(operand[t % OPERAND_BUFFERS], k, t);
        warpgroup::fence();
        warpgroup::mma<operand_major::mn>(st.m[t], operand[t % OPERAND_BUFFERS], s.v, 0, true);
        warpgroup::commit();
        warpgroup::wait<OPERAND_BUFFERS - 1>(operand[(t + 1) % OPERAND_BUFFERS], ds);
      }
      if (carries_delta) {
        position_cols ones;
        warp::fill(ones, 1.0f);
        warp::mma_AtB(st.key_gram, k, k, st.key_gram);
        warp::mma_AtB(st.key_sum, ones, k, st.key_sum);
      }
      warpgroup::wait<0>(grad, operand, st.m);
      in.release(at);

      warp::add(grad, grad, earlier);
      sh.store_gradient(sh.partial_q, ctx.params.grad_q, ctx.task, chunk * CHUNK + warp_row0, 0, grad);

      barrier_sync(barrier_id::chunk_done, WARPGROUP_THREADS);
      write_copies(ctx.scratch.moments, st.m, chunk + 1 < ctx.iterations);
      publish(barrier_id::copies_written, WARPGROUP_THREADS);  // the stmatrix writes must be visible to wgmma
    }
  }
};

// ------------------------------------------------------------------------------- grad_k, grad_v

template <typename T>
struct gradient_common<T>::dkdv_kernel : gradient_common {
  // R and the products of the later chunks outgrow a 128-register share: one task per SM.
  static constexpr int blocks_per_sm = 1;
  static constexpr int consumer_registers = 256;

  struct scratch {
    state_tile states[SLABS];
    value_tile staging[chunked_causal::STAGING_TILES];  // grad_v of alternate chunks, while TMA stores the other
  };

  struct params {
    CUtensorMap q, k, v, grad_out, grad_v;
    gradient_shape shape;
    T* grad_k;  // written here when one value block covers Dv
  };
  using context = pipeline::task_context<dkdv_kernel>;
  using inputs = pipeline::stage_inputs<dkdv_kernel>;

  struct consumer_state {
    value_accumulator r[SLABS];  // sum_i phi(q_i) g~_i^T over the later chunks
    small_tile query_gram;       // sum_i c_i q_i q_i^T (value block 0, normalised)
    small_tile query_sum;        // every row: sum_i c_i q_i
    chunked_causal::staging_ring grad_v_stores;  // picks the staging tile of each grad_v chunk
  };

  __host__ __device__ static pipeline::head_block_order tasks(const params& p) {
    return {p.shape.value_blocks, p.shape.heads, p.shape.batch, false};
  }
  __device__ static int iterations(const params& p, pipeline::head_block) { return ceil_div(p.shape.rows, CHUNK); }
  // Iteration i works on chunk last - i.
  __device__ static int chunk_of(const params& p, int iteration) {
    return iterations(p, {}) - 1 - iteration;
  }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.q);
    tma::prefetch_descriptor(p.k);
    tma::prefetch_descriptor(p.v);
    tma::prefetch_descriptor(p.grad_out);
    tma::prefetch_descriptor(p.grad_v);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int iteration, int, stage& s,
                              mbarrier& full) {
    load_chunk(p.q, p.k, p.v, p.grad_out, task, chunk_of(p, iteration), s, full);
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const gradient_shape& sh = ctx.params.shape;
    const int warp_row0 = warpgroup::warp_row();
    const bool leader = is_warpgroup_leader();
    const bool carries_delta = sh.normalize && ctx.task.block == 0;
    for (int t = 0; t < SLABS; ++t) warp::zero(st.r[t]);
    warp::zero(st.query_gram);
    warp::zero(st.query_sum);

    auto at = in.first();
    for (int iteration = 0; iteration < ctx.iterations; ++iteration, at.advance()) {
      const int chunk = chunk_of(ctx.params, iteration);
      const stage& s = in.wait(at);
      const bool has_later = iteration > 0;

      // Keys j are the warp's rows, the chunk's queries i the columns.
      scores sc, dp;
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(sc, s.k, 0, s.q, 0, false);
      warpgroup::mma<operand_major::k, operand_major::k>(dp, s.v, 0, s.g, 0, false);
      warpgroup::commit();
      position_rows k;
      warp::load(k, s.k, warp_row0, 0);
      value_accumulator grad_v;
      gradient grad_k;
      {
        // The statistics are read again (from L1) where R needs them: registers are short.
        chunk_vector inverse_denominator, denominator_grad;
        sh.load_statistics(inverse_denominator, denominator_grad, ctx.task, chunk * CHUNK, carries_delta);
        warpgroup::wait<0>(sc, dp);

        // Inside the chunk (queries i >= keys j): dS^T = (dP^T / d + c)(1 + S^T/4) / 4, A^T / d.
        const auto later_query = [](int key, int query) { return query >= key; };
        warp::mul_col(dp, dp, inverse_denominator);
        warp::add_col(dp, dp, denominator_grad);
        warp::map<taylor_slope_times>(dp, dp, sc);
        warp::mask(dp, {warp_row0, 0}, later_query, 0.0f);
        weights ds;
        warp::copy(ds, dp);
        warp::map<taylor_score>(sc, sc);
        warp::mul_col(sc, sc, inverse_denominator);
        warp::mask(sc, {warp_row0, 0}, later_query, 0.0f);
        weights a;
        warp::copy(a, sc);
        warpgroup::fence();
        warpgroup::mma<operand_major::mn>(grad_v, a, s.g, 0, false);
        warpgroup::mma<operand_major::mn>(grad_k, ds, s.q, 0, false);
        warpgroup::commit();
        warpgroup::wait<0>(grad_v, grad_k, a, ds);
      }

      // Later chunks: grad_v += phi_t(K) R_t; w = V R_t^T per slab, then its VJP.
      small_tile later;
      warp::zero(later);
      if (has_later) {
        const auto slab_gradient = [&](int t) {
          slab_rows features;
          slabs::rows(features, k, t);
          slab_products w;
          warpgroup::fence();
          warpgroup::mma<operand_major::mn>(grad_v, features, ctx.scratch.states[t], 0, true);
          warpgroup::mma<operand_major::k, operand_major::k>(w, s.v, 0, ctx.scratch.states[t], 0, false);
          warpgroup::commit();
          warpgroup::wait<0>(w, features, grad_v);
          add_feature_gradient(later, w, k, t);
        };
        // Not unrolled: see add_feature_gradient.
#pragma unroll 1
        for (int t = 0; t < SECOND_ORDER_SLABS; ++t) slab_gradient(t);
        slab_gradient(SECOND_ORDER_SLABS);
        if (carries_delta) {
          // The VJP of phi(k_j) . sum_i c_i phi(q_i): query_sum / 4 + query_gram k_j / 16.
          small_tile moment;
          slabs::moment_rows(moment, st.query_gram, st.query_sum, k, SECOND_ORDER_GRADIENT_SCALE, SCORE_SCALE);
          warp::add(later, later, moment);
        }
      }

      // This chunk into R: phi_t(Q)^T with each query's column scaled by 1 / d, times G.
      chunk_vector inverse_denominator, denominator_grad;
      sh.load_statistics(inverse_denominator, denominator_grad, ctx.task, chunk * CHUNK, carries_delta);
      position_cols q;
      warp::load(q, s.q);
      slab_rows operand[OPERAND_BUFFERS];
#pragma unroll
      for (int t = 0; t < SLABS; ++t) {
        slabs::transposed(operand[t % OPERAND_BUFFERS], q, t, inverse_denominator);
        warpgroup::fence();
        warpgroup::mma<operand_major::mn>(st.r[t], operand[t % OPERAND_BUFFERS], s.g, 0, true);
        warpgroup::commit();
        warpgroup::wait<OPERAND_BUFFERS - 1>(operand[(t + 1) % OPERAND_BUFFERS]);
      }
      if (carries_delta) {
        position_cols weighted;
        warp::mul_row(weighted, q, denominator_grad);
        warp::mma_AtB(st.query_gram, weighted, q, st.query_gram);
        warp::fill(weighted, 1.0f);
        warp::mul_row(weighted, weighted, denominator_grad);
        warp::mma_AtB(st.query_sum, weighted, q, st.query_sum);
      }
      warpgroup::wait<0>(operand, st.r);
      in.release(at);

      warp::add(grad_k, grad_k, later);
      sh.store_gradient(sh.partial_k, ctx.params.grad_k, ctx.task, chunk * CHUNK + warp_row0, 0, grad_k);
      store_chunk(ctx, st, grad_v, chunk, iteration + 1 < ctx.iterations, leader);
    }
  }

  // Hands R to the next chunk (scaled copies) and grad_v's tile to TMA through the staging ring.
  __device__ static void store_chunk(const context& ctx, consumer_state& st, const value_accumulator& grad_v,
                                     int chunk, bool more, bool leader) {
    value_tile& staging = ctx.scratch.staging[st.grad_v_stores.slot()];
    st.grad_v_stores.acquire(leader, barrier_id::chunk_done);
    write_copies(ctx.scratch.states, st.r, more);
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

using causal_backward::shape_of;
using causal_backward::workspace_view;

template <typename T>
cudaError_t run_dq(const backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  using K = typename gradient_common<T>::dq_kernel;
  typename K::params p;
  p.q = make_tma_map<typename K::qk_tile>(heads_layout<T>(pr.q));
  p.k = make_tma_map<typename K::qk_tile>(heads_layout<T>(pr.k));
  p.v = make_tma_map<typename K::value_tile>(heads_layout<T>(pr.v));
  p.grad_out = make_tma_map<typename K::value_tile>(heads_layout<T>(pr.grad_out));
  p.shape = shape_of<FEATURES>(pr, w, VALUE_BLOCK);
  p.grad_q = static_cast<T*>(pr.grad_q);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

template <typename T>
cudaError_t run_dkdv(const backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  using K = typename gradient_common<T>::dkdv_kernel;
  typename K::params p;
  p.q = make_tma_map<typename K::qk_tile>(heads_layout<T>(pr.q));
  p.k = make_tma_map<typename K::qk_tile>(heads_layout<T>(pr.k));
  p.v = make_tma_map<typename K::value_tile>(heads_layout<T>(pr.v));
  p.grad_out = make_tma_map<typename K::value_tile>(heads_layout<T>(pr.grad_out));
  p.grad_v = make_tma_map<typename K::value_tile>(heads_layout<T>(causal_backward::grad_v_view(pr)));
  p.shape = shape_of<FEATURES>(pr, w, VALUE_BLOCK);
  p.grad_k = static_cast<T*>(pr.grad_k);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

template <typename T>
cudaError_t run(const backward_problem& pr, cudaStream_t stream) {
  return causal_backward::run<T, FEATURES>(pr, VALUE_BLOCK, stream, [&](const workspace_view& w) {
    if (const cudaError_t err = run_dq<T>(pr, w, stream); err != cudaSuccess) return err;
    return run_dkdv<T>(pr, w, stream);
  });
}

template <typename F>
auto dispatch(const backward_problem& p, F&& f) {
  return tk::dispatch<kernel_dtypes>([&]<element_type E>() { return f.template operator()<element_t<E>>(); }, p.dtype);
}

}  // namespace

int64_t backward_workspace_floats(int64_t batch, int64_t heads, int64_t rows, int64_t value_dim, bool normalize) {
  return causal_backward::workspace_floats(batch, heads, rows, value_dim, FEATURES, normalize, VALUE_BLOCK);
}

std::string unsupported_reason(const backward_problem& p) {
  if (!kernel_dtypes::contains(p.dtype)) return "the kernels take bf16 and fp16";
  if (std::string r = shape_reason(p.q, p.k, p.v); !r.empty()) return r;
  if (std::string r = causal_backward::inputs_reason(p); !r.empty()) return r;
  return dispatch(p, [&]<typename T>() {
    using tiles = gradient_common<T>;
    return causal_backward::layout_reasons<typename tiles::qk_tile, typename tiles::value_tile, T>(p);
  });
}

cudaError_t launch(const backward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T>() { return run<T>(p, stream); });
}

}  // namespace tk::based
