// Mamba-2 SSD forward (tk::mamba2_ssd): per (batch, head), with the state S (P x N) carried across
// the sequence,
//   y_i = (exp(cum_i) C_i S + sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j + D x_i) * silu(z_i)
//   S  <- exp(cum_last) S + sum_j exp(cum_last - cum_j) dt_j x_j B_j^T
// with cum the within-block cumulative sum of dt A (tk_ops/ops/mamba2_ssd.py: the chunked algorithm).
//
// One task is one (batch, head) sequence; one consumer warpgroup walks it in blocks of 64 positions
// (the rows of one wgmma), keeping S in fp32 wgmma accumulators for the whole sequence (one pass, no
// inter-chunk launch). The op's chunk_size (64, 128 or 256) is a whole number of blocks: it only
// decides which states are written to chunk_states (the state entering each chunk), since the
// chunked algorithm's result does not depend on where the chunks start. Each stage holds a block's
// x (64 x P), B and C (64 x N, the head's group) and, gated, z (64 x P); dt is read by every warp
// directly from global memory (a strided column of 64 floats, no TMA box fits it).
//
//   per block:  dt_j = max(softplus(dt_j + dt_bias), 0)    (each lane two positions; 0 past L)
//               cum  = warp::inclusive_scan(dt A)          (written to the warp's shared slots, read
//                                                           back as row and column vectors)
//               G = C B^T ; Y = C S16^T                    (SS wgmma; S16: S's 16-bit copy)
//               M = tril(G * exp(cum_i - cum_j) * dt_j)    (register maps, then the mask)
//               Y = exp(cum_i) Y + M X                     (RS wgmma: M from registers, X the stage)
//               S = exp(cum_last) S + (X^T diag(exp(cum_last - cum_j) dt_j)) B     (RS wgmma)
//               Y += D x ; Y *= silu(z) ; S16 = S ; TMA store of Y (tail rows clipped)
//   chunk_states[c] = S (fp32) before the first block of chunk c; final_states = S after the last.
//
// Positions past L arrive as zeros from TMA and have dt = 0: they leave S unchanged and their rows
// of Y are never stored. The state's copy is 16-bit (as the linear-attention kernels' moment
// copies): in fp16 its entries must stay below 65504.
//
// Plan: at N = 64 a stage is 32 KiB (gated), two stages and two blocks an SM; at N = 128 a stage is
// 48 KiB, one stage and two blocks an SM (the other block's work hides the loads). The consumer
// keeps S (N / 2 registers), Y and G (32 each) and three position vectors (16 each) live.
#include <climits>

#include "kernels/common/heads_layout.cuh"
#include "mamba2_ssd.cuh"
#include "mamba2_ssd.h"
#include "tk/tk.cuh"

namespace tk::mamba2 {
namespace {

using warpgroup::operand_major;

template <int N>
struct ssd_plan {
  static constexpr int consumer_warpgroups = 1;
  static constexpr int stages = N <= 64 ? 2 : 1;
  static constexpr int blocks_per_sm = 2;
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 232;
};

template <typename T, int N, bool GATED>
struct forward_kernel : ssd_plan<N> {
  using xz_tile = shared_tile<T, BLOCK, HEAD_DIM>;   // x, z, and the output's staging
  using bc_tile = shared_tile<T, BLOCK, N>;          // B, C
  using state_copy_tile = shared_tile<T, HEAD_DIM, N>;  // S16: B of Y = C S^T (K-major)
  using output = warpgroup::accumulator<HEAD_DIM>;   // Y: the warp's 16 positions x P
  using scores = warpgroup::accumulator<BLOCK>;      // G, M: the warp's 16 positions x 64
  using state = warpgroup::accumulator<N>;           // S: the warp's 16 channels x N
  using weights = register_tile<T, BASE_TILE, BLOCK>;  // M as a wgmma A operand
  using x_cols = register_tile<T, BLOCK, BASE_TILE, register_layout::col>;  // the warp's 16 channels of X
  using x_channels = register_tile<T, BASE_TILE, BLOCK>;  // their transpose: A of the state update
  using xz_rows = register_tile<T, BASE_TILE, HEAD_DIM>;  // the warp's 16 positions of x or z
  using position_vector = per_col_vector<scores, float>;  // one entry per position of the block
  using row_vector = per_row_vector<scores, float>;       // the warp's 16 positions
  using channel_vector = per_col_vector<output, float>;   // one entry per channel p

  struct gated_stage {
    xz_tile x;
    bc_tile b, c;
    xz_tile z;
  };
  struct plain_stage {
    xz_tile x;
    bc_tile b, c;
  };
  using stage = std::conditional_t<GATED, gated_stage, plain_stage>;
  static constexpr uint32_t stage_bytes[] = {(GATED ? 2 : 1) * xz_tile::bytes + 2 * bc_tile::bytes};

  struct scratch {
    state_copy_tile state_copy;
    xz_tile staging[2];  // the output of alternate blocks, while TMA stores the other
    float steps[WARPGROUP_WARPS][BLOCK];  // each warp's copy of the block's dt
    float cum[WARPGROUP_WARPS][BLOCK];    // and of its cumulative log decays
  };

  struct params {
    CUtensorMap x, b, c, z, y;
    const float* dt;
    int64_t dt_batch_stride, dt_row_stride, dt_head_stride;
    const float* A;
    const float* D;
    const float* dt_bias;
    const float* initial_states;
    float* final_states;
    float* chunk_states;
    int rows, heads, batch, heads_per_group, blocks_per_chunk, chunks;
    bool D_per_channel, dt_softplus;
  };

  enum class barrier_id : int {
    block_done = FIRST_NAMED_BARRIER,  // the warpgroup's products of a block are done
    copies_written,                    // the state's copy and the output tile are written
    count,
  };
  static_assert(fits_named_barriers<barrier_id>());

  using context = pipeline::task_context<forward_kernel>;
  using inputs = pipeline::stage_inputs<forward_kernel>;

  struct consumer_state {
    state s;
    int stores = 0;  // output blocks stored so far (picks the staging tile)
  };

  // ------------------------------------------------------------------------------ producer

  __host__ __device__ static pipeline::head_block_order tasks(const params& p) { return {1, p.heads, p.batch, false}; }

  __device__ static int iterations(const params& p, pipeline::head_block) { return ceil_div(p.rows, BLOCK); }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.x);
    tma::prefetch_descriptor(p.b);
    tma::prefetch_descriptor(p.c);
    if constexpr (GATED) tma::prefetch_descriptor(p.z);
    tma::prefetch_descriptor(p.y);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int block, int, stage& s, mbarrier& full) {
    const int x_index[4] = {task.batch, task.head, block * BLOCK, 0};
    const int bc_index[4] = {task.batch, task.head / p.heads_per_group, block * BLOCK, 0};
    tma::load(s.x, p.x, full, x_index);
    tma::load(s.b, p.b, full, bc_index);
    tma::load(s.c, p.c, full, bc_index);
    if constexpr (GATED) tma::load(s.z, p.z, full, x_index);
  }

  // ------------------------------------------------------------------------------ consumers

  __device__ static int64_t state_offset(const params& p, int64_t batch_head) { return batch_head * HEAD_DIM * N; }

  // The task's column of dt.
  __device__ static step_column steps_column(const context& ctx, float A, float bias) {
    const params& p = ctx.params;
    return {p.dt + int64_t(ctx.task.batch) * p.dt_batch_stride + int64_t(ctx.task.head) * p.dt_head_stride,
            p.dt_row_stride, p.rows, A, bias, p.dt_softplus};
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const params& p = ctx.params;
    const int warp = warp_in_warpgroup();
    const int row0 = warpgroup::warp_row();
    const bool leader = threadIdx.x % WARPGROUP_THREADS == 0;
    const int64_t batch_head = int64_t(ctx.task.batch) * p.heads + ctx.task.head;
    const float A = p.A[ctx.task.head];
    const float bias = p.dt_bias != nullptr ? p.dt_bias[ctx.task.head] : 0.0f;

    if (p.initial_states != nullptr) {
      warp::load(st.s, p.initial_states + state_offset(p, batch_head) + int64_t(row0) * N, N);
    } else {
      warp::zero(st.s);
    }
    // S16 of the entering state, so that the first block's Y = C S^T needs no branch.
    warp::store(ctx.scratch.state_copy, st.s, row0, 0);
    fence_async_shared();
    barrier_sync(barrier_id::copies_written, WARPGROUP_THREADS);

    // Each block's dt is loaded a block ahead: its global latency was on every block's critical path.
    const step_column column = steps_column(ctx, A, bias);
    lane_dt next_dt = load_dt(column, 0);
    auto at = in.first();
    for (int block = 0; block < ctx.iterations; ++block, at.advance()) {
      const lane_dt block_dt = next_dt;
      next_dt = load_dt(column, block + 1);
      if (block % p.blocks_per_chunk == 0) {
        const int64_t chunk_state = (int64_t(ctx.task.batch) * p.chunks + block / p.blocks_per_chunk) * p.heads +
                                    ctx.task.head;
        warp::store(p.chunk_states + state_offset(p, chunk_state) + int64_t(row0) * N, N, st.s);
      }
      // The block's steps and cum (inclusive prefix sums of dt A) into this warp's shared slots.
      const float cum_last =
          write_block_steps(steps_of(column, block, block_dt), A, ctx.scratch.steps[warp], ctx.scratch.cum[warp]);
      position_vector cum_col, dt_col;
      row_vector cum_row;
      warp::load(cum_col, ctx.scratch.cum[warp]);
      warp::load(dt_col, ctx.scratch.steps[warp]);
      warp::load(cum_row, ctx.scratch.cum[warp] + row0);

      const stage& s = in.wait(at);
      // G = C B^T and the entering state's Y = C S^T: both operands in shared memory.
      scores g;
      output o;
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(g, s.c, 0, s.b, 0, false);
      warpgroup::mma<operand_major::k, operand_major::k>(o, s.c, 0, ctx.scratch.state_copy, 0, false);
      warpgroup::commit();

      // The update's A operand meanwhile: the warp's channels of X^T, position j scaled by
      // exp(cum_last - cum_j) dt_j.
      position_vector to_end;
      warp::map<to_block_end>(to_end, cum_col, dt_col, cum_last);
      x_cols xc;
      warp::load(xc, s.x, 0, row0);
      x_channels xt;
      warp::transpose(xt, xc);
      warp::mul_col(xt, xt, to_end);
      warpgroup::wait<0>(g, o);

      // M = tril(G exp(cum_i - cum_j) dt_j); Y = exp(cum_i) Y.
      warp::map<decayed_score>(g, g, broadcast<tile_axis::rows, row_vector>{cum_row},
                               broadcast<tile_axis::cols, position_vector>{cum_col},
                               broadcast<tile_axis::cols, position_vector>{dt_col});
      warp::tril(g, {row0, 0}, 0, 0.0f);
      weights m;
      warp::copy(m, g);
      row_vector out_decay;
      warp::exp(out_decay, cum_row);
      warp::mul_row(o, o, out_decay);
      warp::mul(st.s, st.s, __expf(cum_last));

      // Y += M X ; S += (X^T diag(w)) B: register A operands, B from the stage.
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(o, m, s.x, 0, true);
      warpgroup::mma<operand_major::mn>(st.s, xt, s.b, 0, true);
      warpgroup::commit();
      warpgroup::wait<0>(o, st.s, m, xt);

      // Epilogue on the stage's x and z: Y += D x ; Y *= silu(z).
      if (p.D != nullptr) {
        channel_vector d;
        if (p.D_per_channel) {
          warp::load(d, p.D + int64_t(ctx.task.head) * HEAD_DIM);
        } else {
          warp::zero(d);
          warp::add(d, d, p.D[ctx.task.head]);
        }
        xz_rows xr;
        warp::load(xr, s.x, row0, 0);
        warp::map<skip_add>(o, o, xr, broadcast<tile_axis::cols, channel_vector>{d});
      }
      if constexpr (GATED) {
        xz_rows zr;
        warp::load(zr, s.z, row0, 0);
        warp::map<silu_gate>(o, o, zr);
      }
      in.release(at);

      store_block(ctx, st, o, block, leader);
    }
    warp::store(p.final_states + state_offset(p, batch_head) + int64_t(row0) * N, N, st.s);
  }

  // Hands S16 to the next block (only when there is one) and Y to TMA, alternating staging tiles so
  // that one store is in flight while the next is written.
  __device__ static void store_block(const context& ctx, consumer_state& st, const output& o, int block, bool leader) {
    xz_tile& tile = ctx.scratch.staging[st.stores % 2];
    if (leader) tma::wait_stores_read<1>();  // the store that last used this staging tile has read it
    barrier_sync(barrier_id::block_done, WARPGROUP_THREADS);
    if (block + 1 < ctx.iterations) warp::store(ctx.scratch.state_copy, st.s, warpgroup::warp_row(), 0);
    warpgroup::store<0>(tile, o);
    fence_async_shared();  // the stmatrix writes must be visible to wgmma and to the copy engine
    barrier_sync(barrier_id::copies_written, WARPGROUP_THREADS);
    if (leader) {
      const int index[4] = {ctx.task.batch, ctx.task.head, block * BLOCK, 0};
      tma::store(ctx.params.y, tile, index);
      tma::commit_stores();
    }
    ++st.stores;
  }

  __device__ static void store(const context&, consumer_state&) {}

  template <typename Scratch>
  __device__ static void finish(const params&, Scratch&, int) {
    if (threadIdx.x % WARPGROUP_THREADS == 0) tma::wait_stores_read<0>();
  }

  // ------------------------------------------------------------------------------ host

  static heads_view y_view(const ssd_forward_problem& pr) { return sequence_major_view(pr.y, pr.x); }

  // Why TMA cannot move these tensors' tiles.
  static std::string layout_reasons(const ssd_forward_problem& pr) {
    if (std::string r = layout_reason<xz_tile, T>("x", pr.x); !r.empty()) return r;
    if (std::string r = layout_reason<bc_tile, T>("B", pr.B); !r.empty()) return r;
    if (std::string r = layout_reason<bc_tile, T>("C", pr.C); !r.empty()) return r;
    if constexpr (GATED) {
      if (std::string r = layout_reason<xz_tile, T>("z", pr.z); !r.empty()) return r;
    }
    return layout_reason<xz_tile, T>("y", y_view(pr));
  }

  static params make_params(const ssd_forward_problem& pr) {
    params p{};
    p.x = make_tma_map<xz_tile>(heads_layout<T>(pr.x));
    p.b = make_tma_map<bc_tile>(heads_layout<T>(pr.B));
    p.c = make_tma_map<bc_tile>(heads_layout<T>(pr.C));
    if constexpr (GATED) p.z = make_tma_map<xz_tile>(heads_layout<T>(pr.z));
    p.y = make_tma_map<xz_tile>(heads_layout<T>(y_view(pr)));
    p.dt = pr.dt;
    p.dt_batch_stride = pr.dt_batch_stride;
    p.dt_row_stride = pr.dt_row_stride;
    p.dt_head_stride = pr.dt_head_stride;
    p.A = pr.A;
    p.D = pr.D;
    p.dt_bias = pr.dt_bias;
    p.initial_states = pr.initial_states;
    p.final_states = pr.final_states;
    p.chunk_states = pr.chunk_states;
    p.rows = int(pr.x.rows);
    p.heads = int(pr.x.heads);
    p.batch = int(pr.x.batch);
    p.heads_per_group = int(pr.x.heads / pr.B.heads);
    p.blocks_per_chunk = pr.chunk_size / BLOCK;
    p.chunks = int(ceil_div(pr.x.rows, int64_t(pr.chunk_size)));
    p.D_per_channel = pr.D_per_channel;
    p.dt_softplus = pr.dt_softplus;
    return p;
  }
};

template <typename F>
auto dispatch(const ssd_forward_problem& p, F&& f) {
  return tk::dispatch<kernel_dtypes, state_sizes, flags>(
      [&]<element_type E, int N, bool GATED>() { return f.template operator()<element_t<E>, N, GATED>(); }, p.dtype,
      int(p.B.dim), p.z.data != nullptr);
}

template <typename T, int N, bool GATED>
cudaError_t run(const ssd_forward_problem& pr, cudaStream_t stream) {
  using K = forward_kernel<T, N, GATED>;
  static_assert(pipeline::kernel_shared_bytes<K> * K::blocks_per_sm <= 228 * 1024, "the plan's blocks fit an SM");
  const typename K::params p = K::make_params(pr);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

}  // namespace

std::string unsupported_reason(const ssd_forward_problem& p) {
  if (!kernel_dtypes::contains(p.dtype)) return "the kernel takes bf16 and fp16";
  if (p.x.dim != HEAD_DIM) return "the head dim P must be 64";
  if (!state_sizes::contains(p.B.dim)) return "the state size N must be one of " + state_sizes::names();
  if (!chunk_sizes::contains(p.chunk_size)) return "chunk_size must be one of " + chunk_sizes::names();
  if (p.x.batch < 1 || p.x.heads < 1 || p.x.rows < 1 || p.B.heads < 1) return "every size must be at least 1";
  if (p.x.heads % p.B.heads != 0) return "the heads must be a multiple of the groups";
  if (p.C.batch != p.B.batch || p.C.heads != p.B.heads || p.C.rows != p.B.rows || p.C.dim != p.B.dim ||
      p.B.batch != p.x.batch || p.B.rows != p.x.rows) {
    return "x, B and C must agree";
  }
  if (p.z.data != nullptr && (p.z.batch != p.x.batch || p.z.heads != p.x.heads || p.z.rows != p.x.rows ||
                              p.z.dim != p.x.dim)) {
    return "z must have x's shape";
  }
  if (p.x.rows > MAX_SEQUENCE) return "the sequence must fit TMA coordinates";
  if (p.x.batch * p.x.heads > INT_MAX) return "Bt * H must fit one grid";
  return dispatch(p, [&]<typename T, int N, bool GATED>() { return forward_kernel<T, N, GATED>::layout_reasons(p); });
}

cudaError_t launch(const ssd_forward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T, int N, bool GATED>() { return run<T, N, GATED>(p, stream); });
}

}  // namespace tk::mamba2
