// Based attention forward: causal linear attention whose feature map is the 2nd-order Taylor
// expansion of exp, phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(F), F = 16.
//
// One task is one (batch, head) sequence and VALUE_BLOCK of its value columns; a consumer
// warpgroup walks the sequence in chunks of 64 positions, keeping everything the earlier chunks
// contribute in registers, so q, k and v are read once and phi never exists outside registers:
//
//   moments   sum_j phi(k_j) v_j^T over the earlier chunks, as five 64-feature slabs of fp32
//             wgmma accumulators: slab t < 4 holds the second-order features (a, b) with
//             a = 4 t + warp, b = 0..15 (k_a k_b); slab 4 holds the first-order features (warp 0,
//             k_b) and the zeroth (warp 1, row 0: a constant 1)
//   key_gram  sum_j k_j k_j^T and key_sum sum_j k_j (mma.sync tiles): the denominator's moments
//
// per chunk:   S = Q K^T (wgmma)        A = tril(1 + S/4 + S^2/32), row sums -> denominator
//              O = A V  +  sum_t phi_t(Q) moments_t     (the moments' bf16/fp16 copies in shared
//                                                        memory, written after the last chunk)
//              denominator += #earlier + q . (key_sum / 4 + key_gram q / 32)
//              moments_t += phi_t(K)^T V                (phi_t(K)^T built in registers: K^T with
//                                                        each position's column scaled by k_a)
//              O /= denominator + eps; TMA store (tail rows clipped)
//
// The products use raw q and k and fold the feature map's constants into the moments' copies:
// phi's second-order entries multiply to q_a q_b k_a k_b / (2 F) and its first-order ones to
// q_b k_b / sqrt(F). Positions past N arrive as zeros from TMA and only reach rows that are never
// stored, or the moments after the last chunk, which nothing reads.
#include "based_attention.h"
#include "kernels/common/chunked_causal.cuh"
#include "tk/tk.cuh"

namespace tk::based {
namespace {

using warpgroup::operand_major;

using kernel_dtypes = one_of<element_type::bf16, element_type::fp16>;

constexpr int FEATURES = 16;               // F: the kernel's q/k feature dim
constexpr int CHUNK = warpgroup::WGMMA_M;  // positions per chunk: the rows of one wgmma
constexpr int VALUE_BLOCK = 32;            // value columns per task (two tasks per head at Dv = 64)
constexpr int SLAB_FEATURES = warpgroup::WGMMA_M;  // features per slab: the rows of one wgmma
constexpr int SECOND_ORDER_SLABS = FEATURES * FEATURES / SLAB_FEATURES;
constexpr int SLABS = SECOND_ORDER_SLABS + 1;  // and the lower-order slab last
constexpr int FEATURES_PER_WARP = FEATURES * FEATURES / (SECOND_ORDER_SLABS * WARPGROUP_WARPS);
static_assert(FEATURES_PER_WARP == BASE_TILE && FEATURES == BASE_TILE,
              "a warp's slab rows are one first feature a times the 16 second features b");

// The lower-order slab's warps: first-order features k_b, then the constant feature in row 0.
constexpr int FIRST_ORDER_WARP = 0;
constexpr int ZEROTH_ORDER_WARP = 1;

// s = q.k / sqrt(F); phi(q).phi(k) = 1 + s + s^2 / 2.
constexpr float SCORE_SCALE = 0.25f;
static_assert(SCORE_SCALE * SCORE_SCALE * FEATURES == 1.0f, "SCORE_SCALE is 1 / sqrt(F)");
constexpr float SECOND_ORDER_SCALE = 0.5f * SCORE_SCALE * SCORE_SCALE;  // of q_a q_b k_a k_b

struct taylor_score {
  __device__ static float apply(float qk) {
    const float s = qk * SCORE_SCALE;
    return 1.0f + s + 0.5f * s * s;
  }
};

struct based_plan {
  static constexpr int consumer_warpgroups = 1;
  static constexpr int stages = 3;
  static constexpr int blocks_per_sm = 2;  // one warpgroup per task: two tasks share an SM
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 232;
};

template <typename T>
struct forward_kernel : based_plan, chunked_causal::kernel_base<T, FEATURES, CHUNK, VALUE_BLOCK> {
  using base = chunked_causal::kernel_base<T, FEATURES, CHUNK, VALUE_BLOCK>;
  using typename base::barrier_id;
  using typename base::output;
  using typename base::params;
  using typename base::qk_tile;
  using typename base::row_vector;
  using typename base::stage;
  using typename base::value_tile;
  using moment_tile = shared_tile<T, SLAB_FEATURES, VALUE_BLOCK>;  // a slab's scaled copy
  using scores = warpgroup::accumulator<CHUNK>;                 // a warp's 16 queries x 64 keys
  using weights = register_tile<T, BASE_TILE, CHUNK>;           // A = taylor(S) as a wgmma operand
  using moments = warpgroup::accumulator<VALUE_BLOCK>;
  using query_rows = register_tile<T, BASE_TILE, FEATURES>;     // the warp's 16 queries
  using key_cols = register_tile<T, CHUNK, FEATURES, register_layout::col>;  // the chunk's keys, K x F
  using feature_rows = register_tile<T, BASE_TILE, SLAB_FEATURES>;  // a warp's rows of a phi(.) operand
  using small_tile = register_tile<float, FEATURES, FEATURES>;
  using position_vector = per_col_vector<feature_rows, float>;

  struct scratch {
    moment_tile moments[SLABS];
    value_tile staging[2];  // the output of alternate chunks, while TMA stores the other
  };

  using context = pipeline::task_context<forward_kernel>;
  using inputs = pipeline::stage_inputs<forward_kernel>;

  struct consumer_state {
    moments m[SLABS];
    small_tile key_gram;  // sum_j k_j k_j^T
    small_tile key_sum;   // every row: sum_j k_j
    int stores;           // output chunks stored so far (picks the staging tile)
  };

  // ------------------------------------------------------------------------------ consumers

  // Warp rows of slab t's phi(K)^T: features (a, b), b = 0..15, over the chunk's positions j:
  // K^T with column j scaled by k_ja (a = 4 t + warp); for the lower-order slab k_jb (first-order
  // warp), 1 in row 0 (zeroth-order warp) or nothing.
  __device__ static void key_features(feature_rows& dst, const key_cols& k, int slab) {
    const int warp = warp_in_warpgroup();
    if (slab < SECOND_ORDER_SLABS) {
      position_vector k_a;
      warp::column(k_a, k, slab * WARPGROUP_WARPS + warp);
      warp::transpose(dst, k);
      warp::mul_col(dst, dst, k_a);
    } else if (warp == FIRST_ORDER_WARP) {
      warp::transpose(dst, k);
    } else {
      warp::fill(dst, warp == ZEROTH_ORDER_WARP ? 1.0f : 0.0f);
      warp::mask(dst, {0, 0}, [](int row, int) { return row == 0; }, 0.0f);
    }
  }

  // The warp's queries' phi_t(q) over slab t's features: k16 block kb is q scaled by q_a
  // (a = 4 t + kb); for the lower-order slab q itself, then the constant 1 in the first column.
  __device__ static void query_features(feature_rows& dst, const query_rows& q, int slab) {
    if (slab < SECOND_ORDER_SLABS) {
#pragma unroll
      for (int kb = 0; kb < WARPGROUP_WARPS; ++kb) {
        per_row_vector<query_rows, float> q_a;
        warp::column(q_a, q, slab * WARPGROUP_WARPS + kb);
        query_rows block;
        warp::mul_row(block, q, q_a);
        set_block(dst, block, kb);
      }
    } else {
      query_rows constant;
      warp::fill(constant, 1.0f);
      warp::mask(constant, {0, 0}, [](int, int col) { return col == 0; }, 0.0f);
      warp::zero(dst);
      warp::set_columns<0>(dst, q);
      warp::set_columns<BASE_TILE>(dst, constant);
    }
  }

  __device__ static void set_block(feature_rows& dst, const query_rows& block, int kb) {
    switch (kb) {
      case 0: warp::set_columns<0 * BASE_TILE>(dst, block); break;
      case 1: warp::set_columns<1 * BASE_TILE>(dst, block); break;
      case 2: warp::set_columns<2 * BASE_TILE>(dst, block); break;
      default: warp::set_columns<3 * BASE_TILE>(dst, block); break;
    }
  }

  // What a slab's copy is scaled by so that raw q products give phi(q) . phi(k) terms.
  __device__ static float copy_scale(int slab) {
    if (slab < SECOND_ORDER_SLABS) return SECOND_ORDER_SCALE;
    return warp_in_warpgroup() == FIRST_ORDER_WARP ? SCORE_SCALE : 1.0f;
  }

  // den_i += (earlier positions) + q_i . (key_sum / sqrt(F) + key_gram q_i / (2 F)).
  __device__ static void add_earlier_denominator(row_vector& den, const consumer_state& st, const query_rows& q,
                                                 int earlier) {
    small_tile scaled;
    warp::mul(scaled, st.key_gram, float(SECOND_ORDER_SCALE));
    register_tile<T, FEATURES, FEATURES, register_layout::col> gram;
    warp::transpose(gram, scaled);  // key_gram is symmetric: its transpose is itself, as a B operand
    small_tile t;
    warp::zero(t);
    warp::mma_AB(t, q, gram, t);
    per_col_vector<small_tile> first_order;
    warp::row(first_order, st.key_sum, 0);
    warp::mul(first_order, first_order, float(SCORE_SCALE));
    warp::add_col(t, t, first_order);
    warp::mul(t, t, q);
    row_vector quadratic;
    warp::row_sum(quadratic, t);
    warp::add(den, quadratic, float(earlier));
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const params& p = ctx.params;
    const int warp_row0 = warpgroup::warp_row();
    const bool leader = threadIdx.x % WARPGROUP_THREADS == 0;
    for (int t = 0; t < SLABS; ++t) warp::zero(st.m[t]);
    warp::zero(st.key_gram);
    warp::zero(st.key_sum);
    key_cols ones;
    warp::fill(ones, 1.0f);

    auto at = in.first();
    for (int chunk = 0; chunk < ctx.iterations; ++chunk, at.advance()) {
      const stage& s = in.wait(at);
      const bool has_earlier = chunk > 0;

      scores sc;
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(sc, s.q, 0, s.k, 0, false);
      warpgroup::commit();
      query_rows q;
      warp::load(q, s.q, warp_row0, 0);
      key_cols k;
      warp::load(k, s.k);
      row_vector den;
      if (has_earlier) {
        add_earlier_denominator(den, st, q, chunk * CHUNK);
      } else {
        warp::zero(den);
      }
      warpgroup::wait<0>(sc);

      // Inside the chunk: A = tril(taylor(S)), its row sums, O = A V.
      warp::map<taylor_score>(sc, sc);
      warp::tril(sc, {warp_row0, 0}, 0, 0.0f);
      row_vector within;
      warp::row_sum(within, sc);
      warp::add(den, den, within);
      weights a;
      warp::copy(a, sc);
      output o;
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(o, a, s.v, 0, false);
      warpgroup::commit();

      // Earlier chunks: O += phi_t(Q) moments_t, then this chunk into the moments. Each product's
      // register operand stays pinned until the product after the next is issued.
      feature_rows operand[2];
      const auto issue = [&](auto& acc, feature_rows& a_op, const auto& b_tile) {
        warpgroup::fence();
        warpgroup::mma<operand_major::mn>(acc, a_op, b_tile, 0, true);
        warpgroup::commit();
      };
      if (has_earlier) {
#pragma unroll
        for (int t = 0; t < SLABS; ++t) {
          query_features(operand[t % 2], q, t);
          issue(o, operand[t % 2], ctx.scratch.moments[t]);
          warpgroup::wait<1>(operand[(t + 1) % 2], a);
        }
      }
#pragma unroll
      for (int t = 0; t < SLABS; ++t) {
        key_features(operand[(t + 1) % 2], k, t);
        issue(st.m[t], operand[(t + 1) % 2], s.v);
        warpgroup::wait<1>(operand[t % 2], a);
      }
      warp::mma_AtB(st.key_gram, k, k, st.key_gram);
      warp::mma_AtB(st.key_sum, ones, k, st.key_sum);
      warpgroup::wait<0>(o, operand[0], operand[1]);
#pragma unroll
      for (int t = 0; t < SLABS; ++t) warpgroup::pin(st.m[t]);
      in.release(at);

      if (p.normalize) {
        base::store_denominator(ctx, den, chunk);
        warp::add(den, den, p.eps);
        warp::div_row(o, o, den);
      }
      store_chunk(ctx, st, o, chunk, leader);
    }
  }

  // Hands the moments to the next chunk (scaled copies) and the output tile to TMA.
  __device__ static void store_chunk(const context& ctx, consumer_state& st, const output& o, int chunk, bool leader) {
    base::store_chunk(ctx, ctx.scratch.staging, st.stores, o, chunk, leader, [&] {
#pragma unroll
      for (int t = 0; t < SLABS; ++t) {
        moments scaled;
        warp::mul(scaled, st.m[t], copy_scale(t));
        warpgroup::store<0>(ctx.scratch.moments[t], scaled);
      }
    });
  }

  __device__ static void store(const context&, consumer_state&) {}
};

// ----------------------------------------------------------------------------------- host

std::string shape_reason(const forward_problem& p) {
  if (p.q.dim != FEATURES) return "the feature dim must be " + std::to_string(FEATURES);
  // Every instantiation checks sizes alike: ask one.
  return forward_kernel<bf16>::sequence_shape_reason(p);
}

template <typename T>
cudaError_t run(const forward_problem& pr, cudaStream_t stream) {
  using K = forward_kernel<T>;
  const typename K::params p = K::make_params(pr);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

template <typename F>
auto dispatch(const forward_problem& p, F&& f) {
  return tk::dispatch<kernel_dtypes>([&]<element_type E>() { return f.template operator()<element_t<E>>(); }, p.dtype);
}

}  // namespace

std::string unsupported_reason(const forward_problem& p) {
  if (!kernel_dtypes::contains(p.dtype)) return "the kernels take bf16 and fp16";
  if (std::string r = shape_reason(p); !r.empty()) return r;
  return dispatch(p, [&]<typename T>() { return forward_kernel<T>::layout_reasons(p); });
}

cudaError_t launch(const forward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T>() { return run<T>(p, stream); });
}

}  // namespace tk::based
