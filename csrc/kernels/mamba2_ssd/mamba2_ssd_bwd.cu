// Mamba-2 SSD backward (tk::mamba2_ssd_bwd): every gradient of tk_ops/ops/mamba2_ssd.py, with the
// chunked algorithm run on 64-position blocks (the function does not depend on where chunks start,
// so each block is a chunk of its own). Per (batch, head) and block, with S the state entering the
// block, dS the gradient of the state leaving it, cum the block's inclusive prefix sums of dt A,
// e_ij = exp(cum_i - cum_j) (j <= i), w_j = exp(cum_last - cum_j), u_j = dt_j x_j, gy = grad_y silu(z):
//
//   G = C B^T, GX = GY X^T, Mref = tril(G e), dMd = tril(GX e dt_j)   (dMd = the score gradient dM e)
//   W = Mref GX dt_j  (= dM_ij M_ij, elementwise)
//   du      = Mref^T GY + diag(w) B dS^T              grad_x = dt du + D gy
//   grad_C  = diag(exp cum) GY S + dMd B              grad_B = diag(w dt) X dS + dMd^T C   (per head)
//   grad_z  = grad_y (exp(cum) C S^T + tril(G e dt_j) X + D x) silu'(z)
//   da_k    = sum_{j<k} (colsum_j W - rowsum_j W + q_j) + sum_{i>=k} r_i + exp(cum_last) <dS, S>
//             r_i = gy_i . exp(cum_i) S C_i,   q_j = u_j . w_j dS B_j
//   grad_dt = (x . du + da A) d step / d dt ;  grad_A += da dt ;  dS <- exp(cum_last) dS + GY^T diag(exp cum) C
// (the docstring's da: its intra-chunk sum over i >= k, j < k is the exclusive prefix of the column
// minus the row sums of W, both from the one fp32 W, so the rows i < k cancel to fp32 rounding.)
//
// Three launches on one stream, no atomics (bitwise reproducible):
//   states_kernel    one task = one (batch, head, chunk): from chunk_states[c], the forward's state
//                    recurrence over the chunk's blocks, writing the state entering every block in
//                    16-bit (the operand the products read) to the workspace. At chunk_size 64 it
//                    only converts chunk_states.
//   backward_kernel  one task = one (batch, head): one consumer warpgroup walks the blocks last to
//                    first with dS in fp32 wgmma accumulators (from grad_final_states or 0), each
//                    stage holding a block's x, B, C, grad_y, z and entering state. It writes grad_x
//                    and grad_z (TMA, tails clipped), grad_dt, per-head fp32 partials of grad_B and
//                    grad_C (rows padded to whole blocks), per-(batch, head) sums for grad_A,
//                    grad_dt_bias and grad_D, and grad_initial_states = dS after the first block.
//                    Warp 0 assembles the block's da from per-position terms the warps leave in
//                    shared memory: an exclusive prefix scan and a suffix scan (the inclusive scan of
//                    the block reversed), both warp::inclusive_scan.
//   reduce_kernel    grad_B and grad_C: the sum over the heads of a group of the partials, in a fixed
//                    order, converted to the input dtype.
// Positions past L arrive as zeros from TMA with dt = 0: they add nothing and are never stored.
//
// Plan: the products run on 64 x 64 tiles (G, GX, C S^T, du) and 64 x N ones (grad_B, grad_C, dS).
// Mref and dMd go through shared memory once, where wgmma reads them transposed (MN-major A) for
// du and grad_B, instead of two more products (G^T, GX^T) and their maps. A stage is 72 KiB at
// N = 128 (gated): one stage and one task per SM (two stages at N = 64). Rounded to 16 bits: the
// block states, dS's copy, the gated gy, Mref, dMd and the register operands; a float64 emulation
// of exactly these roundings puts every gradient within 1e-2 of float64 in bf16 (grad_A and
// grad_dt_bias closest, from the gated gy) and 1e-3 in fp16.
#include <string>
#include <utility>

#include "kernels/common/heads_layout.cuh"
#include "mamba2_ssd.cuh"
#include "mamba2_ssd.h"
#include "tk/tk.cuh"

namespace tk::mamba2 {
namespace {

using warpgroup::operand_major;

// Rows of the per-head partials: whole blocks, so the kernel writes them unbounded.
__host__ __device__ inline int64_t padded_rows(int64_t rows) { return round_up<int64_t>(rows, BLOCK); }

// The backward's maps (fp32, MUFU exp).
struct decayed {  // G_ij exp(cum_i - cum_j) (masked to j <= i afterwards)
  __device__ static float apply(float g, float cum_i, float cum_j) { return g * __expf(cum_i - cum_j); }
};
struct block_end_decay {  // exp(cum_last - cum_j)
  __device__ static float apply(float cum_j, float cum_last) { return __expf(cum_last - cum_j); }
};
struct score_product {  // W_ij = dM_ij Mref_ij = GX_ij dt_j Mref_ij
  __device__ static float apply(float gx, float mref, float dt_j) { return gx * mref * dt_j; }
};
struct gate_gradient {  // grad_y y_pre silu'(z), silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))
  __device__ static float apply(float grad_y, float y_pre, float z) {
    const float s = __fdividef(1.0f, 1.0f + __expf(-z));
    return grad_y * y_pre * s * fmaf(z, 1.0f - s, 1.0f);
  }
};
struct input_gradient {  // dt du + D gy
  __device__ static float apply(float du, float dt, float gy, float d) { return fmaf(d, gy, du * dt); }
};

// ------------------------------------------------------------------------------ states

// The forward's plan without its output: two stages and two tasks an SM.
struct states_plan {
  static constexpr int consumer_warpgroups = 1;
  static constexpr int stages = 2;
  static constexpr int blocks_per_sm = 2;
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 232;
};

// The state entering every block: chunk_states[c] carried through the chunk's blocks as the forward
// carries it (S = exp(cum_last) S + (X^T diag(w dt)) B), each block's entering state stored in T.
template <typename T, int N>
struct states_kernel : states_plan {
  using xz_tile = shared_tile<T, BLOCK, HEAD_DIM>;
  using bc_tile = shared_tile<T, BLOCK, N>;
  using state = warpgroup::accumulator<N>;  // S: the warp's 16 channels x N
  using x_cols = register_tile<T, BLOCK, BASE_TILE, register_layout::col>;  // the warp's 16 channels of X
  using x_channels = register_tile<T, BASE_TILE, BLOCK>;                     // their transpose
  using position_vector = per_col_vector<warpgroup::accumulator<BLOCK>, float>;

  struct stage {
    xz_tile x;
    bc_tile b;
  };
  static constexpr uint32_t stage_bytes[] = {xz_tile::bytes + bc_tile::bytes};

  struct scratch {
    float steps[WARPGROUP_WARPS][BLOCK];
    float cum[WARPGROUP_WARPS][BLOCK];
  };

  struct params {
    CUtensorMap x, b;
    dt_view dt;
    const float* A;
    const float* dt_bias;
    const float* chunk_states;  // (Bt, chunks, H, P, N)
    T* block_states;            // (Bt, H, blocks, P, N)
    int rows, heads, batch, heads_per_group, blocks_per_chunk, chunks, blocks;
    bool dt_softplus;
  };

  using context = pipeline::task_context<states_kernel>;
  using inputs = pipeline::stage_inputs<states_kernel>;

  struct consumer_state {
    state s;
  };

  // task.block is the chunk.
  __host__ __device__ static pipeline::head_block_order tasks(const params& p) { return {p.chunks, p.heads, p.batch, false}; }

  __device__ static int first_block(const params& p, pipeline::head_block task) { return task.block * p.blocks_per_chunk; }

  // The updates: one per block of the chunk but the last.
  __device__ static int iterations(const params& p, pipeline::head_block task) {
    return min(p.blocks_per_chunk, p.blocks - first_block(p, task)) - 1;
  }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.x);
    tma::prefetch_descriptor(p.b);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int iteration, int, stage& s, mbarrier& full) {
    const int row = (first_block(p, task) + iteration) * BLOCK;
    const int x_index[4] = {task.batch, task.head, row, 0};
    const int b_index[4] = {task.batch, task.head / p.heads_per_group, row, 0};
    tma::load(s.x, p.x, full, x_index);
    tma::load(s.b, p.b, full, b_index);
  }

  __device__ static void store_state(const context& ctx, const state& s, int block) {
    const params& p = ctx.params;
    const int64_t batch_head = int64_t(ctx.task.batch) * p.heads + ctx.task.head;
    const int64_t offset = ((batch_head * p.blocks + block) * HEAD_DIM + warpgroup::warp_row()) * N;
    warp::store(p.block_states + offset, N, s);
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const params& p = ctx.params;
    const int warp = warp_in_warpgroup();
    const int row0 = warpgroup::warp_row();
    const int first = first_block(p, ctx.task);
    const float A = p.A[ctx.task.head];
    const step_column column{p.dt.column(ctx.task.batch, ctx.task.head), p.dt.row_stride, p.rows, A,
                             p.dt_bias != nullptr ? p.dt_bias[ctx.task.head] : 0.0f, p.dt_softplus};
    const int64_t chunk_state = (int64_t(ctx.task.batch) * p.chunks + ctx.task.block) * p.heads + ctx.task.head;
    warp::load(st.s, p.chunk_states + (chunk_state * HEAD_DIM + row0) * N, N);

    auto at = in.first();
    for (int i = 0; i < ctx.iterations; ++i, at.advance()) {
      store_state(ctx, st.s, first + i);
      const float cum_last = write_block_steps(steps_of(column, first + i), A, ctx.scratch.steps[warp],
                                               ctx.scratch.cum[warp]);
      position_vector cum_col, dt_col, to_end;
      warp::load(cum_col, ctx.scratch.cum[warp]);
      warp::load(dt_col, ctx.scratch.steps[warp]);
      warp::map<to_block_end>(to_end, cum_col, dt_col, cum_last);

      const stage& s = in.wait(at);
      x_cols xc;
      warp::load(xc, s.x, 0, row0);
      x_channels xt;
      warp::transpose(xt, xc);
      warp::mul_col(xt, xt, to_end);
      warp::mul(st.s, st.s, __expf(cum_last));
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(st.s, xt, s.b, 0, true);
      warpgroup::commit();
      warpgroup::wait<0>(st.s, xt);
      in.release(at);
    }
    store_state(ctx, st.s, first + ctx.iterations);
  }

  static params make_params(const ssd_backward_problem& pr) {
    const ssd_forward_problem& f = pr.forward;
    params p{};
    p.x = make_tma_map<xz_tile>(heads_layout<T>(f.x));
    p.b = make_tma_map<bc_tile>(heads_layout<T>(f.B));
    p.dt = f.dt;
    p.A = f.A;
    p.dt_bias = f.dt_bias;
    p.chunk_states = pr.chunk_states;
    p.block_states = reinterpret_cast<T*>(pr.workspace);
    p.rows = int(f.x.rows);
    p.heads = int(f.x.heads);
    p.batch = int(f.x.batch);
    p.heads_per_group = int(f.x.heads / f.B.heads);
    p.blocks_per_chunk = f.chunk_size / BLOCK;
    p.chunks = int(ceil_div(f.x.rows, int64_t(f.chunk_size)));
    p.blocks = int(ceil_div(f.x.rows, int64_t(BLOCK)));
    p.dt_softplus = f.dt_softplus;
    return p;
  }
};

// ------------------------------------------------------------------------------ backward

template <int N, bool GATED>
struct backward_plan {
  static constexpr int consumer_warpgroups = 1;
  // Two stages let the next block load during this one's products. At N = 128 two fit shared
  // memory (with one output tile per output) but cost ptxas 4 to 10 spilled registers (CUDA 13.0):
  // one stage there, until a profile says the exposed load is worth more.
  static constexpr int stages = N <= 64 ? 2 : 1;
  // dS, the products of a block and their operands outgrow a 128-register share: one task per SM.
  static constexpr int blocks_per_sm = 1;
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 256;
  // Output tiles per output (grad_x, grad_z): one block's store runs while the next block writes.
  static constexpr int staging_tiles = 2;
};

template <typename T, int N, bool GATED>
struct backward_kernel : backward_plan<N, GATED> {
  using xz_tile = shared_tile<T, BLOCK, HEAD_DIM>;      // x, grad_y, z, gy, Mref, dMd, output staging
  using bc_tile = shared_tile<T, BLOCK, N>;             // B, C
  using state_tile = shared_tile<T, HEAD_DIM, N>;       // S, dS (rows p)
  using square = warpgroup::accumulator<BLOCK>;         // G, GX, C S^T, du: the warp's 16 rows x 64
  static_assert(BLOCK == HEAD_DIM, "the 64 x 64 products serve positions and channels alike");
  using wide = warpgroup::accumulator<N>;               // dS, grad_B, grad_C: the warp's 16 rows x N
  using rows16 = register_tile<T, BASE_TILE, BLOCK>;    // the warp's 16 rows of a 64-column tile, or an A operand
  using state_rows = register_tile<T, BASE_TILE, N>;    // the warp's 16 channels of S
  using position_cols = register_tile<T, BLOCK, BASE_TILE, register_layout::col>;  // 16 channels of GY
  using position_vector = per_col_vector<square, float>;  // one entry per position (or channel p)
  using row_vector = per_row_vector<square, float>;       // the warp's 16 rows

  struct gated_stage {
    xz_tile x, grad_y;
    bc_tile b, c;
    state_tile s;
    xz_tile z;
  };
  struct plain_stage {
    xz_tile x, grad_y;
    bc_tile b, c;
    state_tile s;
  };
  using stage = std::conditional_t<GATED, gated_stage, plain_stage>;
  static constexpr uint32_t stage_bytes[] = {(GATED ? 3 : 2) * xz_tile::bytes + 2 * bc_tile::bytes + state_tile::bytes};

  static constexpr int STAGING_TILES = backward_plan<N, GATED>::staging_tiles;
  using staging_ring = pipeline::tma_store_ring<STAGING_TILES>;

  // Per position of the block, each written by the warp that holds its row.
  struct block_terms {
    float row_w[BLOCK];                    // sum_j W_ij
    float col_w[WARPGROUP_WARPS][BLOCK];   // each warp's sum over its rows i of W_ij
    float entering[BLOCK];                 // r_i
    float leaving[BLOCK];                  // q_j
    float input_dot[BLOCK];                // x_j . du_j
    float state_dot[WARPGROUP_WARPS];      // each warp's share of <dS, S>
  };

  // This warp's copy of the block's steps and cum (write_block_steps), read back as vectors by
  // each phase (kept in registers across the block, they would crowd out the products).
  struct block_slots {
    const float (&steps)[BLOCK];
    const float (&cum)[BLOCK];
    float cum_last;
  };

  struct common_scratch {
    xz_tile mref, dmd;
    state_tile ds;  // dS in T: B of B dS^T and X dS
    xz_tile x_staging[STAGING_TILES];
    float steps[WARPGROUP_WARPS][BLOCK];
    float cum[WARPGROUP_WARPS][BLOCK];
    block_terms terms;
    float gy_x[WARPGROUP_WARPS][HEAD_DIM];  // per channel p: each warp's sum of gy x so far (grad_D)
  };
  struct gated_scratch : common_scratch {
    xz_tile gy;  // grad_y silu(z) in T
    xz_tile z_staging[STAGING_TILES];
  };
  using scratch = std::conditional_t<GATED, gated_scratch, common_scratch>;

  struct params {
    CUtensorMap x, b, c, z, grad_y, s, grad_x, grad_z;
    dt_view dt;
    const float* A;
    const float* D;
    const float* dt_bias;
    const float* grad_final_states;
    float* grad_dt;
    float* grad_initial_states;
    float* grad_A_partial;
    float* grad_dt_bias_partial;
    float* grad_D_partial;
    float* partial_B;  // (Bt, H, padded, N)
    float* partial_C;
    int rows, padded, heads, batch, heads_per_group;
    bool D_per_channel, dt_softplus;
  };

  enum class barrier_id : int {
    operands_written = FIRST_NAMED_BARRIER,  // gy (gated) and the staging tiles may be written
    scores_written,                          // Mref, dMd and the row terms are in shared memory
    block_done,                              // every product and term of the block is done
    copies_written,                          // dS's copy is written and da assembled
    count,
  };
  static_assert(fits_named_barriers<barrier_id>());

  using context = pipeline::task_context<backward_kernel>;
  using inputs = pipeline::stage_inputs<backward_kernel>;

  struct consumer_state {
    wide ds;                  // gradient of the state leaving the current block
    float da_dt = 0.0f;       // warp 0's lanes: sum of da dt (grad_A)
    float grad_dt = 0.0f;     // warp 0's lanes: sum of grad_dt (grad_dt_bias)
    staging_ring gradient_stores;  // picks the staging tiles of each block
  };

  // ------------------------------------------------------------------------------ producer

  __host__ __device__ static pipeline::head_block_order tasks(const params& p) { return {1, p.heads, p.batch, false}; }

  __device__ static int iterations(const params& p, pipeline::head_block) { return ceil_div(p.rows, BLOCK); }

  // Iteration i works on block last - i.
  __device__ static int block_of(const params& p, int iteration) { return iterations(p, {}) - 1 - iteration; }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.x);
    tma::prefetch_descriptor(p.b);
    tma::prefetch_descriptor(p.c);
    tma::prefetch_descriptor(p.grad_y);
    tma::prefetch_descriptor(p.s);
    if constexpr (GATED) tma::prefetch_descriptor(p.z);
    tma::prefetch_descriptor(p.grad_x);
    if constexpr (GATED) tma::prefetch_descriptor(p.grad_z);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int iteration, int, stage& s, mbarrier& full) {
    const int row = block_of(p, iteration) * BLOCK;
    const int x_index[4] = {task.batch, task.head, row, 0};
    const int bc_index[4] = {task.batch, task.head / p.heads_per_group, row, 0};
    tma::load(s.x, p.x, full, x_index);
    tma::load(s.grad_y, p.grad_y, full, x_index);
    tma::load(s.b, p.b, full, bc_index);
    tma::load(s.c, p.c, full, bc_index);
    const int state_index[4] = {task.batch, task.head, block_of(p, iteration) * HEAD_DIM, 0};
    tma::load(s.s, p.s, full, state_index);  // the state entering the block
    if constexpr (GATED) tma::load(s.z, p.z, full, x_index);
  }

  // ------------------------------------------------------------------------------ consumers

  __device__ static const xz_tile& gy_tile(const context& ctx, const stage& s) {
    if constexpr (GATED) {
      return ctx.scratch.gy;
    } else {
      return s.grad_y;
    }
  }

  // D per channel (0 without D).
  __device__ static void skip_weights(position_vector& d, const params& p, int head) {
    if (p.D == nullptr) {
      warp::zero(d);
    } else if (p.D_per_channel) {
      warp::load(d, p.D + int64_t(head) * HEAD_DIM);
    } else {
      warp::fill(d, p.D[head]);
    }
  }

  __device__ static void start(const context& ctx, consumer_state& st) {
    const params& p = ctx.params;
    const int64_t batch_head = int64_t(ctx.task.batch) * p.heads + ctx.task.head;
    const int row0 = warpgroup::warp_row();
    if (p.grad_final_states != nullptr) {
      warp::load(st.ds, p.grad_final_states + (batch_head * HEAD_DIM + row0) * N, N);
    } else {
      warp::zero(st.ds);
    }
    st.da_dt = 0.0f;
    st.grad_dt = 0.0f;
    warp::store(ctx.scratch.ds, st.ds, row0, 0);
    publish(barrier_id::copies_written, WARPGROUP_THREADS);
    // After the barrier: warp 0 may still be reading the previous task's sums before it.
    position_vector zero;
    warp::zero(zero);
    warp::store(ctx.scratch.gy_x[warp_in_warpgroup()], zero);
  }

  // This warp's share of <dS, S>: dS (fp32) with the entering state's rows of the same channels.
  __device__ static void state_dot(const context& ctx, const consumer_state& st, const stage& s) {
    state_rows sr;
    warp::load(sr, s.s, warpgroup::warp_row(), 0);
    float dot = 0.0f;
    for_each_pair<state_rows>([&](int br, int bc, int q) {
      const float2 state = to_float2(sr.pairs[br][bc][q]);
      const float2 grad = st.ds.pairs[br][bc][q];
      dot = fmaf(grad.x, state.x, fmaf(grad.y, state.y, dot));
    });
    dot = warp::across_warp<op::add>(dot);
    if (lane_id() == 0) ctx.scratch.terms.state_dot[warp_in_warpgroup()] = dot;
  }

  // gy = grad_y silu(z) of the warp's rows, into the shared gy tile (gated only).
  __device__ static void gate(const context& ctx, const stage& s) {
    if constexpr (GATED) {
      const int row0 = warpgroup::warp_row();
      rows16 grad_y, z;
      warp::load(grad_y, s.grad_y, row0, 0);
      warp::load(z, s.z, row0, 0);
      warp::map<silu_gate>(grad_y, grad_y, z);
      warp::store(ctx.scratch.gy, grad_y, row0, 0);
    }
  }

  // Row-i products: G = C B^T, GX = GY X^T, then C S^T. Leaves Mref and dMd in shared memory, the
  // row sums of W, the warp's column sums of W and r in the block's terms, grad_z in its staging
  // tile (gated), and adds gy x to the grad_D sums.
  __device__ static void scores(const context& ctx, consumer_state& st, const stage& s, const block_slots& b) {
    const params& p = ctx.params;
    const int warp = warp_in_warpgroup();
    const int row0 = warpgroup::warp_row();
    const xz_tile& gy = gy_tile(ctx, s);
    const auto rows_of = [](const row_vector& r) { return broadcast<tile_axis::rows, row_vector>{r}; };
    const auto cols_of = [](const position_vector& c) { return broadcast<tile_axis::cols, position_vector>{c}; };
    square g, products;
    warpgroup::fence();
    warpgroup::mma<operand_major::k, operand_major::k>(g, s.c, 0, s.b, 0, false);
    warpgroup::mma<operand_major::k, operand_major::k>(products, gy, 0, s.x, 0, false);
    warpgroup::commit();
    row_vector cum_row;
    warp::load(cum_row, b.cum + row0);
    warpgroup::wait<0>(g, products);
    {
      position_vector cum_col, dt_col;
      warp::load(cum_col, b.cum);
      warp::load(dt_col, b.steps);
      // Mref = tril(G e) (kept in g), dMd = tril(GX e dt_j).
      warp::map<decayed>(g, g, rows_of(cum_row), cols_of(cum_col));
      warp::tril(g, {row0, 0}, 0, 0.0f);
      rows16 operand;
      warp::map<decayed_score>(operand, products, rows_of(cum_row), cols_of(cum_col), cols_of(dt_col));
      warp::tril(operand, {row0, 0}, 0, 0.0f);
      warp::store(ctx.scratch.dmd, operand, row0, 0);
      warp::copy(operand, g);
      warp::store(ctx.scratch.mref, operand, row0, 0);
      // W = GX Mref dt_j: its row sums and this warp's column sums.
      warp::map<score_product>(products, products, g, cols_of(dt_col));
      row_vector row_terms;
      warp::row_sum(row_terms, products);
      warp::store(ctx.scratch.terms.row_w + row0, row_terms);
      position_vector col_terms;
      warp::col_sum(col_terms, products);
      warp::store(ctx.scratch.terms.col_w[warp], col_terms);
    }

    // The entering state's part of y: exp(cum_i) C S^T; r_i = gy_i . it. The grad_D sums meanwhile.
    square ys;
    warpgroup::fence();
    warpgroup::mma<operand_major::k, operand_major::k>(ys, s.c, 0, s.s, 0, false);
    warpgroup::commit();
    rows16 gy_rows;
    warp::load(gy_rows, gy, row0, 0);
    if (p.D != nullptr) {
      rows16 x_rows;
      warp::load(x_rows, s.x, row0, 0);
      position_vector sums;
      warp::load(sums, ctx.scratch.gy_x[warp]);
      warp::map<op::mul>(products, gy_rows, x_rows);
      warp::col_sum(sums, products, sums);
      __syncwarp();  // every lane has read the slots before the first copies overwrite them
      warp::store(ctx.scratch.gy_x[warp], sums);
    }
    row_vector out_decay;
    warp::exp(out_decay, cum_row);
    warpgroup::wait<0>(ys);
    warp::mul_row(ys, ys, out_decay);
    warp::map<op::mul>(products, gy_rows, ys);
    row_vector entering;
    warp::row_sum(entering, products);
    warp::store(ctx.scratch.terms.entering + row0, entering);

    if constexpr (GATED) {
      // y_pre = exp(cum) C S^T + tril(G e dt_j) X + D x; grad_z = grad_y y_pre silu'(z).
      rows16 operand;
      {
        position_vector dt_col;
        warp::load(dt_col, b.steps);
        warp::mul_col(operand, g, dt_col);
      }
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(ys, operand, s.x, 0, true);
      warpgroup::commit();
      warpgroup::wait<0>(ys, operand);
      {
        rows16 x_rows;
        warp::load(x_rows, s.x, row0, 0);
        position_vector d;
        skip_weights(d, p, ctx.task.head);
        warp::map<skip_add>(ys, ys, x_rows, cols_of(d));
      }
      rows16 grad_y, z;
      warp::load(grad_y, s.grad_y, row0, 0);
      warp::load(z, s.z, row0, 0);
      warp::map<gate_gradient>(ys, grad_y, ys, z);
      warpgroup::store<0>(ctx.scratch.z_staging[st.gradient_stores.slot()], ys);
    }
  }

  // Row-j products: du = Mref^T GY + diag(w) B dS^T. Leaves q and x . du in the block's terms and
  // grad_x in its staging tile.
  __device__ static void input_gradients(const context& ctx, consumer_state& st, const stage& s, const block_slots& b) {
    const params& p = ctx.params;
    const int row0 = warpgroup::warp_row();
    const xz_tile& gy = gy_tile(ctx, s);
    square du, leaving;
    warpgroup::fence();
    warpgroup::mma<operand_major::mn, operand_major::mn>(du, ctx.scratch.mref, 0, gy, 0, false);
    warpgroup::mma<operand_major::k, operand_major::k>(leaving, s.b, 0, ctx.scratch.ds, 0, false);
    warpgroup::commit();
    rows16 x_rows;
    warp::load(x_rows, s.x, row0, 0);
    row_vector cum_row, dt_row, to_end;
    warp::load(cum_row, b.cum + row0);
    warp::load(dt_row, b.steps + row0);
    warp::map<block_end_decay>(to_end, cum_row, b.cum_last);
    warpgroup::wait<0>(du, leaving);

    // leaving = diag(w) B dS^T; q_j = dt_j x_j . leaving_j; then x_j . du_j (products in `leaving`).
    warp::mul_row(leaving, leaving, to_end);
    warp::add(du, du, leaving);
    row_vector terms;
    warp::map<op::mul>(leaving, x_rows, leaving);
    warp::row_sum(terms, leaving);
    warp::mul(terms, terms, dt_row);
    warp::store(ctx.scratch.terms.leaving + row0, terms);
    warp::map<op::mul>(leaving, x_rows, du);
    warp::row_sum(terms, leaving);
    warp::store(ctx.scratch.terms.input_dot + row0, terms);

    position_vector d;
    skip_weights(d, p, ctx.task.head);
    rows16 gy_rows;
    warp::load(gy_rows, gy, row0, 0);
    warp::map<input_gradient>(du, du, broadcast<tile_axis::rows, row_vector>{dt_row}, gy_rows,
                              broadcast<tile_axis::cols, position_vector>{d});
    warpgroup::store<0>(ctx.scratch.x_staging[st.gradient_stores.slot()], du);
  }

  // grad_C = diag(exp cum) GY S + dMd B and grad_B = diag(w dt) X dS + dMd^T C, this head's
  // partials, one after the other (each is N / 2 registers).
  __device__ static void state_gradients(const context& ctx, const stage& s, const block_slots& b, int block) {
    const params& p = ctx.params;
    const int row0 = warpgroup::warp_row();
    const int64_t partial_row =
        (int64_t(ctx.task.batch) * p.heads + ctx.task.head) * p.padded + int64_t(block) * BLOCK + row0;
    row_vector cum_row;
    warp::load(cum_row, b.cum + row0);
    wide grad;
    {
      rows16 operand;
      warp::load(operand, gy_tile(ctx, s), row0, 0);
      row_vector out_decay;
      warp::exp(out_decay, cum_row);
      warp::mul_row(operand, operand, out_decay);
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(grad, operand, s.s, 0, false);
      warpgroup::mma<operand_major::k, operand_major::mn>(grad, ctx.scratch.dmd, 0, s.b, 0, true);
      warpgroup::commit();
      warpgroup::wait<0>(grad, operand);
      warp::store(p.partial_C + partial_row * N, N, grad);
    }
    {
      rows16 operand;
      warp::load(operand, s.x, row0, 0);
      row_vector dt_row, scale;
      warp::load(dt_row, b.steps + row0);
      warp::map<to_block_end>(scale, cum_row, dt_row, b.cum_last);
      warp::mul_row(operand, operand, scale);
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(grad, operand, ctx.scratch.ds, 0, false);
      warpgroup::mma<operand_major::mn, operand_major::mn>(grad, ctx.scratch.dmd, 0, s.c, 0, true);
      warpgroup::commit();
      warpgroup::wait<0>(grad, operand);
      warp::store(p.partial_B + partial_row * N, N, grad);
    }
  }

  // dS <- exp(cum_last) dS + (GY^T diag(exp cum)) C: the gradient of the state entering the block.
  __device__ static void update_state_gradient(const context& ctx, consumer_state& st, const stage& s,
                                               const block_slots& b) {
    position_cols gc;
    warp::load(gc, gy_tile(ctx, s), 0, warpgroup::warp_row());
    rows16 gt;
    warp::transpose(gt, gc);
    position_vector out_decay;
    warp::load(out_decay, b.cum);
    warp::exp(out_decay, out_decay);
    warp::mul_col(gt, gt, out_decay);
    warp::mul(st.ds, st.ds, __expf(b.cum_last));
    warpgroup::fence();
    warpgroup::mma<operand_major::mn>(st.ds, gt, s.c, 0, true);
    warpgroup::commit();
    warpgroup::wait<0>(st.ds, gt);
  }

  // Warp 0: da of the block's positions from the terms, then grad_dt and the grad_A and
  // grad_dt_bias sums. Lane l holds positions STEPS_PER_LANE l + k, as steps_of (read again here
  // rather than kept in registers through the block).
  __device__ static void steps_gradient(const context& ctx, consumer_state& st, const step_column& column,
                                        float cum_last, int block) {
    const params& p = ctx.params;
    const lane_steps steps = steps_of(column, block);
    const block_terms& t = ctx.scratch.terms;
    const int lane = lane_id();
    float before[STEPS_PER_LANE], from[STEPS_PER_LANE];
#pragma unroll
    for (int k = 0; k < STEPS_PER_LANE; ++k) {
      const int j = STEPS_PER_LANE * lane + k;
      float col_w = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPGROUP_WARPS; ++w) col_w += t.col_w[w][j];
      before[k] = col_w - t.row_w[j] + t.leaving[j];
      // The block reversed: lane l holds positions BLOCK - 1 - (STEPS_PER_LANE l + k).
      from[k] = t.entering[BLOCK - 1 - j];
    }
    float through[STEPS_PER_LANE];  // inclusive prefix sums of `before`
#pragma unroll
    for (int k = 0; k < STEPS_PER_LANE; ++k) through[k] = before[k];
    warp::inclusive_scan(through);
    warp::inclusive_scan(from);
    float state_dot = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPGROUP_WARPS; ++w) state_dot += t.state_dot[w];
    const float whole_block = __expf(cum_last) * state_dot;
#pragma unroll
    for (int k = 0; k < STEPS_PER_LANE; ++k) {
      const int j = STEPS_PER_LANE * lane + k;
      // Position j = BLOCK - 1 - (STEPS_PER_LANE (WARP_THREADS - 1 - lane) + (STEPS_PER_LANE - 1 - k)).
      const float suffix = __shfl_sync(ALL_LANES, from[STEPS_PER_LANE - 1 - k], WARP_THREADS - 1 - lane);
      const float da = (through[k] - before[k]) + suffix + whole_block;
      const float grad_step = fmaf(da, column.A, t.input_dot[j]) * steps.slope[k];
      const int row = block * BLOCK + j;
      if (row < p.rows) {
        p.grad_dt[(int64_t(ctx.task.batch) * p.rows + row) * p.heads + ctx.task.head] = grad_step;
      }
      st.da_dt = fmaf(da, steps.step[k], st.da_dt);
      st.grad_dt += grad_step;
    }
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const params& p = ctx.params;
    const int warp = warp_in_warpgroup();
    const bool leader = is_warpgroup_leader();
    const float A = p.A[ctx.task.head];
    const step_column column{p.dt.column(ctx.task.batch, ctx.task.head), p.dt.row_stride, p.rows, A,
                             p.dt_bias != nullptr ? p.dt_bias[ctx.task.head] : 0.0f, p.dt_softplus};
    start(ctx, st);

    auto at = in.first();
    for (int iteration = 0; iteration < ctx.iterations; ++iteration, at.advance()) {
      const int block = block_of(p, iteration);
      const block_slots b{ctx.scratch.steps[warp], ctx.scratch.cum[warp],
                          write_block_steps(steps_of(column, block), A, ctx.scratch.steps[warp], ctx.scratch.cum[warp])};

      const stage& s = in.wait(at);
      state_dot(ctx, st, s);
      gate(ctx, s);
      st.gradient_stores.wait_until_read(leader);
      publish(barrier_id::operands_written, WARPGROUP_THREADS);  // gy's stmatrix writes must be visible to wgmma

      scores(ctx, st, s, b);
      publish(barrier_id::scores_written, WARPGROUP_THREADS);

      input_gradients(ctx, st, s, b);
      state_gradients(ctx, s, b, block);
      update_state_gradient(ctx, st, s, b);
      in.release(at);

      finish_block(ctx, st, column, b.cum_last, block, leader);
    }
  }

  // Hands the staging tiles to TMA, assembles da (warp 0) and writes dS's copy for the next block.
  __device__ static void finish_block(const context& ctx, consumer_state& st, const step_column& column,
                                      float cum_last, int block, bool leader) {
    const params& p = ctx.params;
    // The staging tiles' stmatrix writes must be visible to the copy engine.
    publish(barrier_id::block_done, WARPGROUP_THREADS);
    if (leader) {
      const int index[4] = {ctx.task.batch, ctx.task.head, block * BLOCK, 0};
      tma::store(p.grad_x, ctx.scratch.x_staging[st.gradient_stores.slot()], index);
      if constexpr (GATED) tma::store(p.grad_z, ctx.scratch.z_staging[st.gradient_stores.slot()], index);
    }
    st.gradient_stores.commit(leader);
    if (warp_in_warpgroup() == 0) steps_gradient(ctx, st, column, cum_last, block);
    warp::store(ctx.scratch.ds, st.ds, warpgroup::warp_row(), 0);
    publish(barrier_id::copies_written, WARPGROUP_THREADS);  // the stmatrix writes must be visible to wgmma
  }

  // grad_initial_states and the task's sums: grad_D's over the warps, grad_A's and grad_dt_bias's
  // over warp 0's lanes.
  __device__ static void store(const context& ctx, consumer_state& st) {
    const params& p = ctx.params;
    const int64_t batch_head = int64_t(ctx.task.batch) * p.heads + ctx.task.head;
    const int warp = warp_in_warpgroup();
    if (p.grad_initial_states != nullptr) {
      warp::store(p.grad_initial_states + (batch_head * HEAD_DIM + warpgroup::warp_row()) * N, N, st.ds);
    }
    if (warp == 0) {
      st.da_dt = warp::across_warp<op::add>(st.da_dt);
      st.grad_dt = warp::across_warp<op::add>(st.grad_dt);
      if (lane_id() == 0) {
        p.grad_A_partial[batch_head] = st.da_dt;
        p.grad_dt_bias_partial[batch_head] = st.grad_dt;
      }
    }
    if (p.grad_D_partial != nullptr) {
      // Every warp wrote its last sums before the last block's barriers.
      const float(&sums)[WARPGROUP_WARPS][HEAD_DIM] = ctx.scratch.gy_x;
      if (warp == 0) {
        for (int channel = lane_id(); channel < HEAD_DIM; channel += WARP_THREADS) {
          float sum = 0.0f;
#pragma unroll
          for (int w = 0; w < WARPGROUP_WARPS; ++w) sum += sums[w][channel];
          p.grad_D_partial[batch_head * HEAD_DIM + channel] = sum;
        }
      }
    }
  }

  template <typename Scratch>
  __device__ static void finish(const params&, Scratch&, int) {
    staging_ring::drain();
  }

  // ------------------------------------------------------------------------------ host

  // The states entering the blocks, (Bt, H, blocks, P, N) in T, as (Bt, H, blocks * P, N).
  static heads_view block_states_view(const ssd_backward_problem& pr) {
    const heads_view& x = pr.forward.x;
    return contiguous_view(pr.workspace, x.batch, x.heads, ceil_div<int64_t>(x.rows, BLOCK) * HEAD_DIM, N);
  }

  // Why TMA cannot move these tensors' tiles (grad_x and grad_z are laid out as the forward's y,
  // which the forward's reasons cover).
  static std::string layout_reasons(const ssd_backward_problem& pr) {
    const ssd_forward_problem& f = pr.forward;
    for (const auto& [name, view] : {std::pair{"x", f.x}, std::pair{"grad_y", pr.grad_y}}) {
      if (std::string r = layout_reason<xz_tile, T>(name, view); !r.empty()) return r;
    }
    if (std::string r = layout_reason<bc_tile, T>("B", f.B); !r.empty()) return r;
    if (std::string r = layout_reason<bc_tile, T>("C", f.C); !r.empty()) return r;
    if constexpr (GATED) {
      if (std::string r = layout_reason<xz_tile, T>("z", f.z); !r.empty()) return r;
    }
    return {};
  }

  static params make_params(const ssd_backward_problem& pr, float* partials) {
    const ssd_forward_problem& f = pr.forward;
    params p{};
    p.x = make_tma_map<xz_tile>(heads_layout<T>(f.x));
    p.b = make_tma_map<bc_tile>(heads_layout<T>(f.B));
    p.c = make_tma_map<bc_tile>(heads_layout<T>(f.C));
    if constexpr (GATED) p.z = make_tma_map<xz_tile>(heads_layout<T>(f.z));
    p.grad_y = make_tma_map<xz_tile>(heads_layout<T>(pr.grad_y));
    p.s = make_tma_map<state_tile>(heads_layout<T>(block_states_view(pr)));
    p.grad_x = make_tma_map<xz_tile>(heads_layout<T>(sequence_major_view(pr.grad_x, f.x)));
    if constexpr (GATED) p.grad_z = make_tma_map<xz_tile>(heads_layout<T>(sequence_major_view(pr.grad_z, f.x)));
    p.dt = f.dt;
    p.A = f.A;
    p.D = f.D;
    p.dt_bias = f.dt_bias;
    p.grad_final_states = pr.grad_final_states;
    p.grad_dt = pr.grad_dt;
    p.grad_initial_states = pr.grad_initial_states;
    p.grad_A_partial = pr.grad_A_partial;
    p.grad_dt_bias_partial = pr.grad_dt_bias_partial;
    p.grad_D_partial = pr.grad_D_partial;
    const int64_t partial_floats = f.x.batch * f.x.heads * padded_rows(f.x.rows) * f.B.dim;
    p.partial_B = partials;
    p.partial_C = partials + partial_floats;
    p.rows = int(f.x.rows);
    p.padded = int(padded_rows(f.x.rows));
    p.heads = int(f.x.heads);
    p.batch = int(f.x.batch);
    p.heads_per_group = int(f.x.heads / f.B.heads);
    p.D_per_channel = f.D_per_channel;
    p.dt_softplus = f.dt_softplus;
    return p;
  }
};

// ------------------------------------------------------------------------------ reduce

constexpr int REDUCE_THREADS = 256;
constexpr int REDUCE_FLOATS_PER_THREAD = 4;  // one float4 of a partial row
constexpr int SUMMED_GRADIENTS = 2;          // grad_B and grad_C

template <typename T>
struct reduce_params {
  const float* partial_B;  // (Bt, H, padded, N)
  const float* partial_C;
  T* grad_B;  // (Bt, L, G, N)
  T* grad_C;
  int rows, padded, groups, heads_per_group, state_size;
  int64_t per_gradient;  // Bt * L * G * N / REDUCE_FLOATS_PER_THREAD
};

// grad_B and grad_C: the sum over the heads of each group of the per-head partials, in head order,
// in the input dtype.
template <typename T>
__global__ void __launch_bounds__(REDUCE_THREADS) reduce_kernel(const reduce_params<T> p) {
  const int64_t item = int64_t(blockIdx.x) * REDUCE_THREADS + threadIdx.x;
  if (item >= SUMMED_GRADIENTS * p.per_gradient) return;
  const bool is_c = item >= p.per_gradient;
  const int64_t out = (is_c ? item - p.per_gradient : item) * REDUCE_FLOATS_PER_THREAD;  // ((b L + l) G + g) N + n
  const int n = int(out % p.state_size);
  const int64_t row = out / p.state_size;  // (b L + l) G + g
  const int g = int(row % p.groups);
  const int64_t position = row / p.groups;  // b L + l
  const int64_t batch = position / p.rows;
  const int l = int(position % p.rows);
  const int heads = p.groups * p.heads_per_group;
  const int64_t head_stride = int64_t(p.padded) * p.state_size;
  const float* src = (is_c ? p.partial_C : p.partial_B) +
                     ((batch * heads + int64_t(g) * p.heads_per_group) * p.padded + l) * p.state_size + n;
  float4 sum = *reinterpret_cast<const float4*>(src);
  for (int k = 1; k < p.heads_per_group; ++k) {
    const float4 x = *reinterpret_cast<const float4*>(src + k * head_stride);
    sum.x += x.x;
    sum.y += x.y;
    sum.z += x.z;
    sum.w += x.w;
  }
  using pair = packed_pair_t<T>;
  pair* dst = reinterpret_cast<pair*>((is_c ? p.grad_C : p.grad_B) + out);
  dst[0] = numeric<T>::pair_from_float2({sum.x, sum.y});
  dst[1] = numeric<T>::pair_from_float2({sum.z, sum.w});
}

// ------------------------------------------------------------------------------ host

// The workspace: the block states in T (as many elements as one partial has floats, since each
// block's P = 64 rows of states stand for its 64 positions), then the two partials.
static_assert(HEAD_DIM == BLOCK, "a block's state has as many rows as the block has positions");
constexpr int64_t STATES_PER_FLOAT = sizeof(float) / sizeof(bf16);  // 16-bit states, two to a float
static_assert(sizeof(bf16) == sizeof(half), "both kernel dtypes are 16-bit");

int64_t partial_floats(int64_t batch, int64_t heads, int64_t rows, int64_t state_size) {
  return batch * heads * padded_rows(rows) * state_size;
}

float* partials_of(const ssd_backward_problem& pr) {
  const ssd_forward_problem& f = pr.forward;
  return pr.workspace + partial_floats(f.x.batch, f.x.heads, f.x.rows, f.B.dim) / STATES_PER_FLOAT;
}

template <typename T, int N>
cudaError_t run_states(const ssd_backward_problem& pr, cudaStream_t stream) {
  using K = states_kernel<T, N>;
  static_assert(pipeline::kernel_shared_bytes<K> * K::blocks_per_sm <= pipeline::MAX_SHARED_BYTES_PER_SM, "the plan's blocks fit an SM");
  const typename K::params p = K::make_params(pr);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

template <typename T, int N, bool GATED>
cudaError_t run_backward(const ssd_backward_problem& pr, cudaStream_t stream) {
  using K = backward_kernel<T, N, GATED>;
  const typename K::params p = K::make_params(pr, partials_of(pr));
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

template <typename T>
cudaError_t run_reduce(const ssd_backward_problem& pr, cudaStream_t stream) {
  const ssd_forward_problem& f = pr.forward;
  reduce_params<T> p;
  p.partial_B = partials_of(pr);
  p.partial_C = p.partial_B + partial_floats(f.x.batch, f.x.heads, f.x.rows, f.B.dim);
  p.grad_B = static_cast<T*>(pr.grad_B);
  p.grad_C = static_cast<T*>(pr.grad_C);
  p.rows = int(f.x.rows);
  p.padded = int(padded_rows(f.x.rows));
  p.groups = int(f.B.heads);
  p.heads_per_group = int(f.x.heads / f.B.heads);
  p.state_size = int(f.B.dim);
  p.per_gradient = f.x.batch * f.x.rows * f.B.heads * f.B.dim / REDUCE_FLOATS_PER_THREAD;
  const unsigned blocks = unsigned(ceil_div<int64_t>(SUMMED_GRADIENTS * p.per_gradient, REDUCE_THREADS));
  return pipeline::launch(reduce_kernel<T>, blocks, REDUCE_THREADS, 0, stream, p);
}

template <typename F>
auto dispatch(const ssd_backward_problem& p, F&& f) {
  return tk::dispatch<kernel_dtypes, state_sizes, flags>(
      [&]<element_type E, int N, bool GATED>() { return f.template operator()<element_t<E>, N, GATED>(); },
      p.forward.dtype, int(p.forward.B.dim), p.forward.z.data != nullptr);
}

}  // namespace

int64_t backward_workspace_floats(int64_t batch, int64_t heads, int64_t rows, int64_t state_size) {
  const int64_t partial = partial_floats(batch, heads, rows, state_size);
  return partial / STATES_PER_FLOAT + SUMMED_GRADIENTS * partial;
}

std::string unsupported_reason(const ssd_backward_problem& p) {
  const heads_view& x = p.forward.x;
  if (std::string r = unsupported_reason(p.forward); !r.empty()) return r;
  if (p.grad_y.batch != x.batch || p.grad_y.heads != x.heads || p.grad_y.rows != x.rows || p.grad_y.dim != x.dim) {
    return "grad_y must have x's shape";
  }
  return dispatch(p, [&]<typename T, int N, bool GATED>() { return backward_kernel<T, N, GATED>::layout_reasons(p); });
}

cudaError_t launch(const ssd_backward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T, int N, bool GATED>() {
    if (const cudaError_t err = run_states<T, N>(p, stream); err != cudaSuccess) return err;
    if (const cudaError_t err = run_backward<T, N, GATED>(p, stream); err != cudaSuccess) return err;
    return run_reduce<T>(p, stream);
  });
}

}  // namespace tk::mamba2
