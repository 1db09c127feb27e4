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
#include "based_attention.cuh"
#include "kernels/common/chunked_causal.cuh"
#include "tk/tk.cuh"

namespace tk::based {
namespace {

using warpgroup::operand_major;

using kernel_dtypes = one_of<element_type::bf16, element_type::fp16>;

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
  using slabs = taylor_slabs<T>;
  using query_rows = typename slabs::position_rows;  // the warp's 16 queries
  using key_cols = typename slabs::position_cols;    // the chunk's keys, K x F
  using feature_rows = typename slabs::slab_rows;    // a warp's rows of a phi(.) operand
  using small_tile = typename slabs::small_tile;

  struct scratch {
    moment_tile moments[SLABS];
    value_tile staging[chunked_causal::STAGING_TILES];  // the output of alternate chunks, while TMA stores the other
  };

  using context = pipeline::task_context<forward_kernel>;
  using inputs = pipeline::stage_inputs<forward_kernel>;

  struct consumer_state {
    moments m[SLABS];
    small_tile key_gram;  // sum_j k_j k_j^T
    small_tile key_sum;   // every row: sum_j k_j
    int stores = 0;       // output chunks stored so far (picks the staging tile)
  };

  // ------------------------------------------------------------------------------ consumers

  // den_i += (earlier positions) + q_i . (key_sum / sqrt(F) + key_gram q_i / (2 F)).
  __device__ static void add_earlier_denominator(row_vector& den, const consumer_state& st, const query_rows& q,
                                                 int earlier) {
    small_tile t;
    slabs::moment_rows(t, st.key_gram, st.key_sum, q, SECOND_ORDER_SCALE, SCORE_SCALE);
    warp::mul(t, t, q);
    row_vector quadratic;
    warp::row_sum(quadratic, t);
    warp::add(den, quadratic, float(earlier));
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const params& p = ctx.params;
    const int warp_row0 = warpgroup::warp_row();
    const bool leader = is_warpgroup_leader();
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
      feature_rows operand[OPERAND_BUFFERS];
      const auto issue = [&](auto& acc, feature_rows& a_op, const auto& b_tile) {
        warpgroup::fence();
        warpgroup::mma<operand_major::mn>(acc, a_op, b_tile, 0, true);
        warpgroup::commit();
      };
      if (has_earlier) {
#pragma unroll
        for (int t = 0; t < SLABS; ++t) {
          slabs::rows(operand[t % OPERAND_BUFFERS], q, t);
          issue(o, operand[t % OPERAND_BUFFERS], ctx.scratch.moments[t]);
          warpgroup::wait<OPERAND_BUFFERS - 1>(operand[(t + 1) % OPERAND_BUFFERS], a);
        }
      }
#pragma unroll
      for (int t = 0; t < SLABS; ++t) {
        const int product = SLABS + t;  // continues the earlier chunks' sequence of products
        slabs::transposed(operand[product % OPERAND_BUFFERS], k, t);
        issue(st.m[t], operand[product % OPERAND_BUFFERS], s.v);
        warpgroup::wait<OPERAND_BUFFERS - 1>(operand[(product + 1) % OPERAND_BUFFERS], a);
      }
      warp::mma_AtB(st.key_gram, k, k, st.key_gram);
      warp::mma_AtB(st.key_sum, ones, k, st.key_sum);
      warpgroup::wait<0>(o, operand, st.m);
      in.release(at);

      base::normalize(ctx, o, den, chunk);
      store_chunk(ctx, st, o, chunk, leader);
    }
  }

  // Hands the moments to the next chunk (scaled copies) and the output tile to TMA.
  __device__ static void store_chunk(const context& ctx, consumer_state& st, const output& o, int chunk, bool leader) {
    base::store_chunk(ctx, ctx.scratch.staging, st.stores, o, chunk, leader, [&] {
#pragma unroll
      for (int t = 0; t < SLABS; ++t) {
        moments scaled;
        warp::mul(scaled, st.m[t], slabs::copy_scale(t));
        warpgroup::store<0>(ctx.scratch.moments[t], scaled);
      }
    });
  }

  __device__ static void store(const context&, consumer_state&) {}
};

// ----------------------------------------------------------------------------------- host

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
  if (std::string r = shape_reason(p.q, p.k, p.v); !r.empty()) return r;
  return dispatch(p, [&]<typename T>() { return forward_kernel<T>::layout_reasons(p); });
}

cudaError_t launch(const forward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T>() { return run<T>(p, stream); });
}

}  // namespace tk::based
