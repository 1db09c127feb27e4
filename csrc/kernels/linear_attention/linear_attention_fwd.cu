// Generic causal linear attention forward: out_i = sum_{j<=i} (q_i . k_j) v_j (/ denominator_i + eps),
// the feature map already applied by the caller (phi = identity here), F in {16, 32, 64, 128, 256}.
//
// One task is one (batch, head) sequence and VALUE_BLOCK of its value columns; a consumer warpgroup
// walks the sequence in chunks of 64 positions (chunked_causal.cuh: loads, epilogue), keeping what
// the earlier chunks contribute in registers:
//
//   state     sum_j k_j v_j^T over the earlier chunks (F x VALUE_BLOCK) as ceil(F / 64) slabs of fp32
//             wgmma accumulators, slab t = feature rows [64 t, 64 t + 64), each warp 16 of them. At
//             F = 16, 32 the one slab's warps w >= F / 16 own no feature and keep zero rows.
//   key_sum   sum_j k_j over the earlier chunks (the denominator's state), fp32, 2 registers a slab:
//             per feature row, the row sums of the update's K^T operand
//
// per chunk:  S = Q K^T                      (SS wgmma)
//             O = Q state                    (SS wgmma; B = the state's 16-bit copy in shared memory)
//             den = q . key_sum              (fp32 on the CUDA cores, key_sum copied to shared memory)
//             A = tril(S); den += row sums of A; O += A V        (RS wgmma)
//             state_t += K_t^T V             (RS wgmma; K_t^T: a col-layout load of the warp's 16
//                                             features from the K stage tile, transposed in registers)
//             O /= den + eps; TMA store (tail rows clipped)
//
// The denominator stays in fp32 throughout (its state is the plain key sum, no 16-bit copy), so the
// denominator output is as exact as the scores' fp32 accumulation. The state's copy is 16-bit: in
// fp16 its entries must stay below 65504. Positions past N arrive as zeros from TMA and add nothing
// to the state or the key sum.
//
// Register budget (232 or 240 per consumer thread): the state is 16 registers a slab, 64 at F = 256;
// it all stays in registers at every F. Shared memory decides the plan: a stage is 2 * 64 * F * 2 +
// 64 * 32 * 2 bytes (68 KiB at F = 256), so F <= 64 keeps three stages and two blocks an SM, F = 128
// two stages and two blocks, F = 256 two stages and one block.
#include "kernels/common/chunked_causal.cuh"
#include "linear_attention.h"
#include "tk/tk.cuh"

namespace tk::linear {
namespace {

using warpgroup::operand_major;

using kernel_dtypes = one_of<element_type::bf16, element_type::fp16>;
using feature_dims = one_of<16, 32, 64, 128, 256>;

constexpr int CHUNK = warpgroup::WGMMA_M;          // positions per chunk: the rows of one wgmma
constexpr int VALUE_BLOCK = 32;                    // value columns per task (two tasks per head at Dv = 64)
constexpr int SLAB_FEATURES = warpgroup::WGMMA_M;  // feature rows per state slab: the rows of one wgmma

template <int FEATURES>
struct linear_plan {
  // Shared memory per block: stages * (2 * CHUNK * FEATURES + CHUNK * VALUE_BLOCK) * 2 bytes, plus
  // the state's copy and the output staging (see the top comment).
  static constexpr bool wide = FEATURES > 2 * SLAB_FEATURES;
  static constexpr int consumer_warpgroups = 1;
  static constexpr int stages = FEATURES <= SLAB_FEATURES ? 3 : 2;
  static constexpr int blocks_per_sm = wide ? 1 : 2;  // one warpgroup per task: two tasks share an SM
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = wide ? 240 : 232;
};

template <typename T, int FEATURES>
struct forward_kernel : linear_plan<FEATURES>, chunked_causal::kernel_base<T, FEATURES, CHUNK, VALUE_BLOCK> {
  using base = chunked_causal::kernel_base<T, FEATURES, CHUNK, VALUE_BLOCK>;
  using typename base::output;
  using typename base::params;
  using typename base::qk_tile;
  using typename base::row_vector;
  using typename base::stage;
  using typename base::value_tile;

  static constexpr int SLABS = ceil_div(FEATURES, SLAB_FEATURES);
  // The denominator's q . key_sum runs over q in pieces of this many features (a slab, or all of F).
  static constexpr int QUERY_PIECE = FEATURES < SLAB_FEATURES ? FEATURES : SLAB_FEATURES;
  // Each slab's K^T operand pins a register buffer until the update after the next is issued.
  static constexpr int OPERAND_BUFFERS = SLABS > 1 ? 2 : 1;
  static_assert(FEATURES % BASE_TILE == 0 && (FEATURES < SLAB_FEATURES || FEATURES % SLAB_FEATURES == 0),
                "a warp owns whole base tiles of features; slabs are whole");

  using state_copy_tile = shared_tile<T, FEATURES, VALUE_BLOCK>;  // B of O += Q state
  using scores = warpgroup::accumulator<CHUNK>;                   // a warp's 16 queries x 64 keys
  using weights = register_tile<T, BASE_TILE, CHUNK>;             // A = tril(S) as a wgmma operand
  using state = warpgroup::accumulator<VALUE_BLOCK>;              // a slab: the warp's 16 feature rows
  using key_cols = register_tile<T, CHUNK, BASE_TILE, register_layout::col>;  // 16 features of the chunk's keys
  using feature_rows = register_tile<T, BASE_TILE, CHUNK>;        // their transpose: A of the update
  using feature_sums = per_row_vector<feature_rows, float>;       // key_sum over the warp's 16 features
  using query_piece = register_tile<T, BASE_TILE, QUERY_PIECE>;
  using query_piece_fp32 = register_tile<float, BASE_TILE, QUERY_PIECE>;
  using key_sum_piece = per_col_vector<query_piece_fp32, float>;

  struct scratch {
    state_copy_tile state_copy;
    value_tile staging[chunked_causal::STAGING_TILES];      // the output of alternate chunks, while TMA stores the other
    float key_sum[FEATURES];    // the key sum's fp32 copy, for every warp's queries
  };

  using context = pipeline::task_context<forward_kernel>;
  using inputs = pipeline::stage_inputs<forward_kernel>;

  struct consumer_state {
    state s[SLABS];
    feature_sums key_sum[SLABS];
    chunked_causal::staging_ring output_stores;  // picks the staging tile of each output chunk
  };

  // The warp's first feature row of slab t; the warp owns none when it is F or more.
  __device__ static int first_feature(int slab) { return slab * SLAB_FEATURES + warpgroup::warp_row(); }

  // The warp's rows of K_t^T over the chunk's positions (zero rows past F).
  __device__ static void key_features(feature_rows& dst, const qk_tile& k, int slab) {
    const int feature0 = first_feature(slab);
    if (feature0 < FEATURES) {
      key_cols cols;
      warp::load(cols, k, 0, feature0);
      warp::transpose(dst, cols);
    } else {
      warp::zero(dst);
    }
  }

  // den_i += q_i . key_sum, in fp32, the warp's 16 queries.
  __device__ static void add_earlier_denominator(row_vector& den, const qk_tile& q, const float* key_sum) {
#pragma unroll
    for (int f0 = 0; f0 < FEATURES; f0 += QUERY_PIECE) {
      query_piece piece;
      warp::load(piece, q, warpgroup::warp_row(), f0);
      query_piece_fp32 products;
      warp::copy(products, piece);
      key_sum_piece sums;
      warp::load(sums, key_sum + f0);
      warp::mul_col(products, products, sums);
      warp::row_sum(den, products, den);
    }
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const params& p = ctx.params;
    const int warp_row0 = warpgroup::warp_row();
    const bool leader = is_warpgroup_leader();
#pragma unroll
    for (int t = 0; t < SLABS; ++t) {
      warp::zero(st.s[t]);
      warp::zero(st.key_sum[t]);
    }
    // Zero copies, so that the first chunk's earlier terms need no branch: a wgmma issued on one
    // side of a branch makes ptxas serialise the accumulator (C7514).
    write_copies(ctx, st);
    publish(base::barrier_id::copies_written, WARPGROUP_THREADS);

    auto at = in.first();
    for (int chunk = 0; chunk < ctx.iterations; ++chunk, at.advance()) {
      const stage& s = in.wait(at);

      // S = Q K^T, and the earlier chunks' O = Q state: both operands in shared memory.
      scores sc;
      output o;
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(sc, s.q, 0, s.k, 0, false);
      warpgroup::commit();
      warpgroup::mma<operand_major::k, operand_major::mn>(o, s.q, 0, ctx.scratch.state_copy, 0, false);
      warpgroup::commit();
      row_vector den;
      warp::zero(den);
      if (p.normalize) add_earlier_denominator(den, s.q, ctx.scratch.key_sum);
      warpgroup::wait<1>(sc);  // S is done; Q state may still run

      // Inside the chunk: A = tril(S), its row sums, O += A V.
      warp::tril(sc, {warp_row0, 0}, 0, 0.0f);
      if (p.normalize) warp::row_sum(den, sc, den);
      weights a;
      warp::copy(a, sc);
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(o, a, s.v, 0, true);
      warpgroup::commit();

      // This chunk into the state (and the key sum). Each update's register operand stays pinned
      // until the update after the next is issued.
      feature_rows operand[OPERAND_BUFFERS];
#pragma unroll
      for (int t = 0; t < SLABS; ++t) {
        feature_rows& k_t = operand[t % OPERAND_BUFFERS];
        key_features(k_t, s.k, t);
        if (p.normalize) warp::row_sum(st.key_sum[t], k_t, st.key_sum[t]);
        warpgroup::fence();
        warpgroup::mma<operand_major::mn>(st.s[t], k_t, s.v, 0, true);
        warpgroup::commit();
        if constexpr (OPERAND_BUFFERS > 1) {
          warpgroup::wait<1>(operand[(t + 1) % OPERAND_BUFFERS], a);
        } else {
          warpgroup::wait<1>(a);
        }
      }
      warpgroup::wait<0>(o, operand, st.s);
      in.release(at);

      base::normalize(ctx, o, den, chunk);
      base::store_chunk(ctx, ctx.scratch.staging, st.output_stores, o, chunk, leader, [&] { write_copies(ctx, st); });
    }
  }

  // The state's 16-bit copy and the key sum's fp32 copy, each warp its own feature rows.
  __device__ static void write_copies(const context& ctx, const consumer_state& st) {
#pragma unroll
    for (int t = 0; t < SLABS; ++t) {
      const int feature0 = first_feature(t);
      if (feature0 >= FEATURES) continue;
      warp::store(ctx.scratch.state_copy, st.s[t], feature0, 0);
      if (ctx.params.normalize) warp::store(ctx.scratch.key_sum + feature0, st.key_sum[t]);
    }
  }
};

template <typename F>
auto dispatch(const forward_problem& p, F&& f) {
  return tk::dispatch<kernel_dtypes, feature_dims>(
      [&]<element_type E, int FEATURES>() { return f.template operator()<element_t<E>, FEATURES>(); }, p.dtype,
      int(p.q.dim));
}

template <typename T, int FEATURES>
cudaError_t run(const forward_problem& pr, cudaStream_t stream) {
  using K = forward_kernel<T, FEATURES>;
  const typename K::params p = K::make_params(pr);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

}  // namespace

std::string unsupported_reason(const forward_problem& p) {
  if (!kernel_dtypes::contains(p.dtype)) return "the kernels take bf16 and fp16";
  if (!feature_dims::contains(p.q.dim)) return "the feature dim must be one of " + feature_dims::names();
  // Every instantiation checks sizes alike: ask one.
  if (std::string r = forward_kernel<bf16, SLAB_FEATURES>::sequence_shape_reason(p); !r.empty()) return r;
  return dispatch(p, [&]<typename T, int FEATURES>() { return forward_kernel<T, FEATURES>::layout_reasons(p); });
}

cudaError_t launch(const forward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T, int FEATURES>() { return run<T, FEATURES>(p, stream); });
}

}  // namespace tk::linear
