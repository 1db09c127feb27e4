// Mamba-2 SSD forward (tk::mamba2_ssd): per (batch, head), with the state S (P x N) carried across
// the sequence,
//   y_i = (exp(cum_i) C_i S + sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j + D x_i) * silu(z_i)
//   S  <- exp(cum_last) S + sum_j exp(cum_last - cum_j) dt_j x_j B_j^T
// with cum the within-block cumulative sum of dt A (tk_ops/ops/mamba2_ssd.py: the chunked algorithm).
//
// Each sequence is cut into `segments` runs of whole chunks (one run, the whole sequence, when the
// (batch, head) tasks alone fill the SMs; the rule is below). Up to three launches on one stream:
//
//   segment_ends_kernel    (only with segments > 1) one task per (batch, head, segment but the last):
//                          from S = 0, the state update over the segment's blocks; its end state goes
//                          to chunk_states at the first chunk of the next segment, its total log decay
//                          (the sum of its blocks' cum_last) to final_states[b, h, segment], both
//                          scratch that the next launches overwrite.
//   segment_scan_kernel    (only with segments > 1) per (batch, head), elementwise over P x N in fp32:
//                          S_0 = initial_states (or 0); S_{s+1} = exp(decay_s) S_s + end_s, written in
//                          place: chunk_states at each segment's first chunk is the state entering it.
//   forward_kernel         one task per (batch, head, segment), from the state entering the segment:
//                          the output, the rest of chunk_states and (last segment) final_states.
//                          At N = 128 with an even number of heads per group, one thread block runs
//                          two heads of a group (HEADS = 2), sharing each stage's B and C.
//
// In forward_kernel one consumer warpgroup per head walks its segment in blocks of 64 positions (the
// rows of one wgmma), keeping S in fp32 wgmma accumulators. The op's chunk_size (64, 128 or 256) is a whole
// number of blocks: it only decides which states are written to chunk_states (the state entering
// each chunk), since the chunked algorithm's result does not depend on where the chunks start. Each
// stage holds a block's x (64 x P), B and C (64 x N, the head's group) and, gated, z (64 x P); dt is
// read by every warp directly from global memory (a strided column of 64 floats, no TMA box fits it).
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
// The state update (its steps, cum and A operand: block_positions, state_update_operand) is the one
// code both forward_kernel and segment_ends_kernel run. (No kernel name here contains
// "states_kernel": the backward's ncu profile selects its kernels by that pattern.)
//
// Positions past L arrive as zeros from TMA and have dt = 0: they leave S unchanged and their rows
// of Y are never stored. The state's copy is 16-bit (as the linear-attention kernels' moment
// copies): in fp16 its entries must stay below 65504.
//
// The split rule (plan_split, on kernels/common/sequence_split.cuh's cost model): in units of one
// 64-position block of forward_kernel on an SM running two heads (3.8 us on the H100 at N = 128, one
// head a block, measured). A pass of
// `grid` equal thread blocks of `blocks` blocks takes ceil(grid / thread blocks an SM / SMs) waves of
// blocks + 1 (the entering state and the first loads), or 0.75 of that when a two-block plan's
// blocks each have an SM to themselves (measured: 2.9 vs 3.8 us a block). The split adds the states
// pass at 1/4 of a block a block (one product of four, four stages ahead), 1/4 a segment for the
// scan and 2 for the extra launches. Every segment count up to 4 waves' worth is tried; the fastest
// predicted one wins (1: one pass). The extra traffic of the split is one more read of x (and B) by
// the states pass; the scan moves Bt H segments states, a few percent of chunk_states here.
//
// Predicted at chunk 256 (mamba_ssm measured 0.774 / 1.691 / 0.879 / 1.671 / 3.731 ms; ours measured
// with one head a block 0.371 / 0.722 / 0.223 / 0.942 / 2.982 ms):
//                       segments   one head a block    two heads a block (block 3.8 -> 2.8 us)
//   (8, 2048, 80, 128)     1        0.376 ms (2.1x)     0.28 ms (2.8x)
//   (8, 4096, 80, 128)     1        0.741 ms (2.3x)     0.55 ms (3.1x)
//   (8, 4096, 32, 64)      1        0.247 ms (3.6x)     (N = 64: one head a block)
//   (2, 16384, 80, 128)    3        0.854 ms (2.0x)     0.63 ms (2.7x)
//   (1, 65536, 80, 128)   13        1.555 ms (2.4x)     1.15 ms (3.3x)
// Why two heads a block rather than reading the epilogue's x and z before the stage's release: the
// stage must stay until the last product (S += ... B reads B, Y += M X reads X) completes, and the
// epilogue after it is two register maps, so an earlier release would win a few percent at most;
// at N = 128 a block of one head holds one stage, the next block's loads (one DRAM round trip,
// about a quarter of the block) wait for its release, while two heads sharing B and C (64 KiB a
// stage gated) fit two stages: the loads run a block ahead, and B and C cross L2 once for two heads.
//
// Plan: at N = 64 a stage is 32 KiB (gated), two stages and two blocks an SM; at N = 128 with one
// head a block a stage is 48 KiB, one stage and two blocks an SM (the other block's work hides the
// loads); with two heads a block 64 KiB, two stages, one block an SM (two consumer warpgroups, so
// the same two heads an SM). The consumer keeps S (N / 2 registers), Y and G (32 each) and three
// position vectors (16 each) live. The states pass's stage is x and B only (24 KiB at N = 128): four
// stages, two blocks an SM.
#include <algorithm>
#include <climits>

#include "kernels/common/heads_layout.cuh"
#include "kernels/common/sequence_split.cuh"
#include "mamba2_ssd.cuh"
#include "mamba2_ssd.h"
#include "tk/tk.cuh"

namespace tk::mamba2 {
namespace {

using warpgroup::operand_major;
using position_vector = per_col_vector<warpgroup::accumulator<BLOCK>, float>;  // one entry per position of a block

// ------------------------------------------------------------------------------ the state update

// A block's steps and cum (inclusive prefix sums of dt A) as the state update reads them: written to
// this warp's shared slots, read back as position vectors.
struct block_positions {
  position_vector cum, dt;
  float cum_last;
};

__device__ __forceinline__ block_positions load_block_positions(const step_column& column, int block,
                                                                const lane_dt& raw, float (&steps)[BLOCK],
                                                                float (&cum)[BLOCK]) {
  block_positions at;
  at.cum_last = write_block_steps(steps_of(column, block, raw), column.A, steps, cum);
  warp::load(at.cum, cum);
  warp::load(at.dt, steps);
  return at;
}

// The A operand of S += (X^T diag(w)) B: the warp's 16 channels of X^T, position j scaled by
// w_j = exp(cum_last - cum_j) dt_j.
template <typename T, typename XTile>
__device__ __forceinline__ void state_update_operand(register_tile<T, BASE_TILE, BLOCK>& xt, const XTile& x,
                                                     const block_positions& at) {
  position_vector to_end;
  warp::map<to_block_end>(to_end, at.cum, at.dt, at.cum_last);
  register_tile<T, BLOCK, BASE_TILE, register_layout::col> xc;
  warp::load(xc, x, 0, warpgroup::warp_row());
  warp::transpose(xt, xc);
  warp::mul_col(xt, xt, to_end);
}

// ------------------------------------------------------------------------------ segments

// Tasks (batch, head, segment), segment-major: the blocks running together read one segment's B and C
// (shared by a group's heads) from L2. With one segment, the (batch, head) order.
struct segment_order {
  int segments;
  int heads;
  int batches;

  __host__ __device__ int count() const { return segments * heads * batches; }

  __host__ __device__ pipeline::head_block at(int index) const {
    const int sequences = heads * batches;
    const int sequence = index % sequences;
    return {sequence / heads, sequence % heads, index / sequences};  // .block is the segment
  }
};

// What the kernels of a split need to find a segment's blocks and its slots in chunk_states.
struct segment_geometry {
  int rows, heads, batch, blocks, blocks_per_chunk, chunks, chunks_per_segment, segments;

  __host__ __device__ int blocks_per_segment() const { return chunks_per_segment * blocks_per_chunk; }
  __device__ int first_block(pipeline::head_block task) const { return task.block * blocks_per_segment(); }
  __device__ int blocks_of(pipeline::head_block task) const {
    return min(blocks_per_segment(), blocks - first_block(task));
  }
  // chunk_states[batch, chunk, head] and final_states[batch, head]: P x N floats each.
  __host__ __device__ int64_t chunk_state(int b, int chunk, int head) const {
    return (int64_t(b) * chunks + chunk) * heads + head;
  }
  __host__ __device__ int64_t sequence(int b, int head) const { return int64_t(b) * heads + head; }
};

template <int N>
constexpr int64_t state_elements = HEAD_DIM * N;

// ------------------------------------------------------------------------------ states pass

struct segment_ends_plan {
  static constexpr int consumer_warpgroups = 1;
  static constexpr int stages = 4;
  static constexpr int blocks_per_sm = 2;
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 232;
};

// Each segment but the last from a zero state: its end state into chunk_states at the next segment's
// first chunk, its total log decay into final_states[b, h, segment].
template <typename T, int N>
struct segment_ends_kernel : segment_ends_plan {
  using xz_tile = shared_tile<T, BLOCK, HEAD_DIM>;
  using bc_tile = shared_tile<T, BLOCK, N>;
  using state = warpgroup::accumulator<N>;
  using x_channels = register_tile<T, BASE_TILE, BLOCK>;

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
    float* end_states;  // chunk_states
    float* decays;      // final_states
    segment_geometry at;
    int heads_per_group;
    bool dt_softplus;
  };

  using context = pipeline::task_context<segment_ends_kernel>;
  using inputs = pipeline::stage_inputs<segment_ends_kernel>;

  struct consumer_state {
    state s;
  };

  __host__ __device__ static segment_order tasks(const params& p) {
    return {p.at.segments - 1, p.at.heads, p.at.batch};
  }

  __device__ static int iterations(const params& p, pipeline::head_block task) { return p.at.blocks_of(task); }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.x);
    tma::prefetch_descriptor(p.b);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int iteration, int, stage& s, mbarrier& full) {
    const int row = (p.at.first_block(task) + iteration) * BLOCK;
    const int x_index[4] = {task.batch, task.head, row, 0};
    const int b_index[4] = {task.batch, task.head / p.heads_per_group, row, 0};
    tma::load(s.x, p.x, full, x_index);
    tma::load(s.b, p.b, full, b_index);
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const params& p = ctx.params;
    const int warp = warp_in_warpgroup();
    const int first = p.at.first_block(ctx.task);
    const float A = p.A[ctx.task.head];
    const step_column column{p.dt.column(ctx.task.batch, ctx.task.head), p.dt.row_stride, p.at.rows, A,
                             p.dt_bias != nullptr ? p.dt_bias[ctx.task.head] : 0.0f, p.dt_softplus};
    warp::zero(st.s);
    float decay = 0.0f;

    lane_dt next_dt = load_dt(column, first);
    auto at = in.first();
    for (int i = 0; i < ctx.iterations; ++i, at.advance()) {
      const lane_dt block_dt = next_dt;
      next_dt = load_dt(column, first + i + 1);
      const block_positions pos =
          load_block_positions(column, first + i, block_dt, ctx.scratch.steps[warp], ctx.scratch.cum[warp]);
      decay += pos.cum_last;

      const stage& s = in.wait(at);
      x_channels xt;
      state_update_operand(xt, s.x, pos);
      warp::mul(st.s, st.s, __expf(pos.cum_last));
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(st.s, xt, s.b, 0, true);
      warpgroup::commit();
      warpgroup::wait<0>(st.s, xt);
      in.release(at);
    }
    const int next_chunk = (ctx.task.block + 1) * p.at.chunks_per_segment;
    const int64_t slot = p.at.chunk_state(ctx.task.batch, next_chunk, ctx.task.head);
    warp::store(p.end_states + slot * state_elements<N> + int64_t(warpgroup::warp_row()) * N, N, st.s);
    if (is_warpgroup_leader()) {
      p.decays[p.at.sequence(ctx.task.batch, ctx.task.head) * state_elements<N> + ctx.task.block] = decay;
    }
  }
};

// ------------------------------------------------------------------------------ scan

constexpr int SCAN_THREADS = 256;
constexpr int SCAN_ELEMENTS_PER_THREAD = 4;
constexpr int SCAN_ELEMENTS_PER_BLOCK = SCAN_THREADS * SCAN_ELEMENTS_PER_THREAD;

struct scan_params {
  const float* initial_states;  // null: the sequences start from 0
  float* chunk_states;          // the segments' end states in, the states entering them out
  const float* decays;          // final_states: each sequence's segment decays first
  segment_geometry at;
  int64_t state_elements;
};

// One block per (sequence, SCAN_ELEMENTS_PER_BLOCK elements of the state): the segments in order,
// each element's fp32 recurrence in one thread. The next segment's end state is loaded before this
// one's entering state is stored, so one global round trip a segment is hidden.
__global__ void __launch_bounds__(SCAN_THREADS) segment_scan_kernel(const scan_params p) {
  const int pieces = int(p.state_elements / SCAN_ELEMENTS_PER_BLOCK);
  const int sequence = int(blockIdx.x) / pieces;
  const int b = sequence / p.at.heads, head = sequence % p.at.heads;
  const int64_t first = int64_t(blockIdx.x % pieces) * SCAN_ELEMENTS_PER_BLOCK + threadIdx.x;
  const auto slot = [&](int segment) {
    return p.chunk_states + p.at.chunk_state(b, segment * p.at.chunks_per_segment, head) * p.state_elements + first;
  };
  const float* decays = p.decays + p.at.sequence(b, head) * p.state_elements;

  float s[SCAN_ELEMENTS_PER_THREAD], end[SCAN_ELEMENTS_PER_THREAD];
  const float* initial =
      p.initial_states == nullptr ? nullptr : p.initial_states + p.at.sequence(b, head) * p.state_elements + first;
#pragma unroll
  for (int k = 0; k < SCAN_ELEMENTS_PER_THREAD; ++k) {
    s[k] = initial != nullptr ? initial[k * SCAN_THREADS] : 0.0f;
    end[k] = slot(1)[k * SCAN_THREADS];
  }
  for (int segment = 1; segment < p.at.segments; ++segment) {
    const float decay = __expf(decays[segment - 1]);
    float next[SCAN_ELEMENTS_PER_THREAD] = {};
#pragma unroll
    for (int k = 0; k < SCAN_ELEMENTS_PER_THREAD; ++k) {
      if (segment + 1 < p.at.segments) next[k] = slot(segment + 1)[k * SCAN_THREADS];
      s[k] = fmaf(decay, s[k], end[k]);
      slot(segment)[k * SCAN_THREADS] = s[k];
      end[k] = next[k];
    }
  }
}

// ------------------------------------------------------------------------------ output pass

// HEADS heads of one group per block, one consumer warpgroup each, sharing the stage's B and C: at
// N = 128 one head's stage fits only once beside another block's, two heads' stage fits twice.
template <int N, int HEADS>
struct ssd_plan {
  static constexpr int consumer_warpgroups = HEADS;
  static constexpr int stages = N <= 64 || HEADS == 2 ? 2 : 1;
  static constexpr int blocks_per_sm = 2 / HEADS;
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 232;
};

template <typename T, int N, bool GATED, int HEADS>
struct forward_kernel : ssd_plan<N, HEADS> {
  using xz_tile = shared_tile<T, BLOCK, HEAD_DIM>;   // x, z, and the output's staging
  using bc_tile = shared_tile<T, BLOCK, N>;          // B, C
  using state_copy_tile = shared_tile<T, HEAD_DIM, N>;  // S16: B of Y = C S^T (K-major)
  using output = warpgroup::accumulator<HEAD_DIM>;   // Y: the warp's 16 positions x P
  using scores = warpgroup::accumulator<BLOCK>;      // G, M: the warp's 16 positions x 64
  using state = warpgroup::accumulator<N>;           // S: the warp's 16 channels x N
  using weights = register_tile<T, BASE_TILE, BLOCK>;  // M as a wgmma A operand
  using x_channels = register_tile<T, BASE_TILE, BLOCK>;  // A of the state update
  using xz_rows = register_tile<T, BASE_TILE, HEAD_DIM>;  // the warp's 16 positions of x or z
  using row_vector = per_row_vector<scores, float>;       // the warp's 16 positions
  using channel_vector = per_col_vector<output, float>;   // one entry per channel p
  // Output staging tiles per consumer: one block's store runs while the next block writes.
  static constexpr int STAGING_TILES = 2;
  using staging_ring = pipeline::tma_store_ring<STAGING_TILES>;

  struct gated_stage {
    xz_tile x[HEADS];
    bc_tile b, c;
    xz_tile z[HEADS];
  };
  struct plain_stage {
    xz_tile x[HEADS];
    bc_tile b, c;
  };
  using stage = std::conditional_t<GATED, gated_stage, plain_stage>;
  static constexpr uint32_t stage_bytes[] = {HEADS * (GATED ? 2 : 1) * xz_tile::bytes + 2 * bc_tile::bytes};

  struct head_scratch {  // one consumer warpgroup's
    state_copy_tile state_copy;
    xz_tile staging[STAGING_TILES];  // the output of alternate blocks, while TMA stores the other
    float steps[WARPGROUP_WARPS][BLOCK];  // each warp's copy of the block's dt
    float cum[WARPGROUP_WARPS][BLOCK];    // and of its cumulative log decays
  };
  struct scratch {
    head_scratch heads[HEADS];
  };

  struct params {
    CUtensorMap x, b, c, z, y;
    dt_view dt;
    const float* A;
    const float* D;
    const float* dt_bias;
    const float* initial_states;
    float* final_states;
    float* chunk_states;  // with segments > 1, already holding the state entering each segment
    segment_geometry at;
    int heads_per_group;
    bool D_per_channel, dt_softplus;
  };

  enum class barrier_id : int {         // per consumer warpgroup:
    block_done = FIRST_NAMED_BARRIER,     // its products of a block are done
    copies_written = block_done + HEADS,  // the state's copy and the output tile are written
    count = copies_written + HEADS,
  };
  static_assert(fits_named_barriers<barrier_id>());

  using context = pipeline::task_context<forward_kernel>;
  using inputs = pipeline::stage_inputs<forward_kernel>;

  struct consumer_state {
    state s;
    staging_ring output_stores;  // picks the staging tile of each output block
  };

  // ------------------------------------------------------------------------------ producer

  // task.head counts runs of HEADS heads; the consumer warpgroup picks one.
  __host__ __device__ static segment_order tasks(const params& p) {
    return {p.at.segments, p.at.heads / HEADS, p.at.batch};
  }
  __device__ static int head_of(const context& ctx) { return ctx.task.head * HEADS + ctx.consumer; }

  __device__ static int iterations(const params& p, pipeline::head_block task) { return p.at.blocks_of(task); }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.x);
    tma::prefetch_descriptor(p.b);
    tma::prefetch_descriptor(p.c);
    if constexpr (GATED) tma::prefetch_descriptor(p.z);
    tma::prefetch_descriptor(p.y);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int iteration, int, stage& s, mbarrier& full) {
    const int row = (p.at.first_block(task) + iteration) * BLOCK;
    const int first_head = task.head * HEADS;
    const int bc_index[4] = {task.batch, first_head / p.heads_per_group, row, 0};
    tma::load(s.b, p.b, full, bc_index);
    tma::load(s.c, p.c, full, bc_index);
    for (int h = 0; h < HEADS; ++h) {
      const int x_index[4] = {task.batch, first_head + h, row, 0};
      tma::load(s.x[h], p.x, full, x_index);
      if constexpr (GATED) tma::load(s.z[h], p.z, full, x_index);
    }
  }

  // ------------------------------------------------------------------------------ consumers

  // The head's column of dt.
  __device__ static step_column steps_column(const context& ctx, int head, float A, float bias) {
    const params& p = ctx.params;
    return {p.dt.column(ctx.task.batch, head), p.dt.row_stride, p.at.rows, A, bias, p.dt_softplus};
  }

  // This warp's rows of chunk_states[batch, chunk, head].
  __device__ static float* chunk_state_rows(const context& ctx, int head, int chunk) {
    const int64_t slot = ctx.params.at.chunk_state(ctx.task.batch, chunk, head);
    return ctx.params.chunk_states + slot * state_elements<N> + int64_t(warpgroup::warp_row()) * N;
  }

  // S entering the task's segment: the initial state (or 0) for the first, the scan's for the others.
  __device__ static void load_entering_state(const context& ctx, int head, state& s) {
    const params& p = ctx.params;
    const int64_t rows = int64_t(warpgroup::warp_row()) * N;
    if (ctx.task.block > 0) {
      warp::load(s, chunk_state_rows(ctx, head, ctx.task.block * p.at.chunks_per_segment), N);
    } else if (p.initial_states != nullptr) {
      const int64_t sequence = p.at.sequence(ctx.task.batch, head);
      warp::load(s, p.initial_states + sequence * state_elements<N> + rows, N);
    } else {
      warp::zero(s);
    }
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    const params& p = ctx.params;
    const int warp = warp_in_warpgroup();
    const int row0 = warpgroup::warp_row();
    const bool leader = is_warpgroup_leader();
    const int first = p.at.first_block(ctx.task);
    const int head = head_of(ctx);
    head_scratch& mine = ctx.scratch.heads[ctx.consumer];
    const float A = p.A[head];
    const float bias = p.dt_bias != nullptr ? p.dt_bias[head] : 0.0f;

    load_entering_state(ctx, head, st.s);
    // S16 of the entering state, so that the first block's Y = C S^T needs no branch.
    warp::store(mine.state_copy, st.s, row0, 0);
    publish(barrier_after(barrier_id::copies_written, ctx.consumer), WARPGROUP_THREADS);

    // Each block's dt is loaded a block ahead: its global latency was on every block's critical path.
    const step_column column = steps_column(ctx, head, A, bias);
    lane_dt next_dt = load_dt(column, first);
    auto at = in.first();
    for (int i = 0; i < ctx.iterations; ++i, at.advance()) {
      const int block = first + i;
      const lane_dt block_dt = next_dt;
      next_dt = load_dt(column, block + 1);
      // A later segment's first chunk state is the scan's, already in place.
      if (block % p.at.blocks_per_chunk == 0 && (i > 0 || ctx.task.block == 0)) {
        warp::store(chunk_state_rows(ctx, head, block / p.at.blocks_per_chunk), N, st.s);
      }
      const block_positions pos =
          load_block_positions(column, block, block_dt, mine.steps[warp], mine.cum[warp]);
      row_vector cum_row;
      warp::load(cum_row, mine.cum[warp] + row0);

      const stage& s = in.wait(at);
      const xz_tile& x = s.x[ctx.consumer];
      // G = C B^T and the entering state's Y = C S^T: both operands in shared memory.
      scores g;
      output o;
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(g, s.c, 0, s.b, 0, false);
      warpgroup::mma<operand_major::k, operand_major::k>(o, s.c, 0, mine.state_copy, 0, false);
      warpgroup::commit();

      // The update's A operand meanwhile.
      x_channels xt;
      state_update_operand(xt, x, pos);
      warpgroup::wait<0>(g, o);

      // M = tril(G exp(cum_i - cum_j) dt_j); Y = exp(cum_i) Y.
      warp::map<decayed_score>(g, g, broadcast<tile_axis::rows, row_vector>{cum_row},
                               broadcast<tile_axis::cols, position_vector>{pos.cum},
                               broadcast<tile_axis::cols, position_vector>{pos.dt});
      warp::tril(g, {row0, 0}, 0, 0.0f);
      weights m;
      warp::copy(m, g);
      row_vector out_decay;
      warp::exp(out_decay, cum_row);
      warp::mul_row(o, o, out_decay);
      warp::mul(st.s, st.s, __expf(pos.cum_last));

      // Y += M X ; S += (X^T diag(w)) B: register A operands, B from the stage.
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(o, m, x, 0, true);
      warpgroup::mma<operand_major::mn>(st.s, xt, s.b, 0, true);
      warpgroup::commit();
      warpgroup::wait<0>(o, st.s, m, xt);

      // Epilogue on the stage's x and z: Y += D x ; Y *= silu(z).
      if (p.D != nullptr) {
        channel_vector d;
        if (p.D_per_channel) {
          warp::load(d, p.D + int64_t(head) * HEAD_DIM);
        } else {
          warp::zero(d);
          warp::add(d, d, p.D[head]);
        }
        xz_rows xr;
        warp::load(xr, x, row0, 0);
        warp::map<skip_add>(o, o, xr, broadcast<tile_axis::cols, channel_vector>{d});
      }
      if constexpr (GATED) {
        xz_rows zr;
        warp::load(zr, s.z[ctx.consumer], row0, 0);
        warp::map<silu_gate>(o, o, zr);
      }
      in.release(at);

      store_block(ctx, st, o, head, block, i + 1 < ctx.iterations, leader);
    }
    if (ctx.task.block + 1 == p.at.segments) {
      const int64_t sequence = p.at.sequence(ctx.task.batch, head);
      warp::store(p.final_states + sequence * state_elements<N> + int64_t(row0) * N, N, st.s);
    }
  }

  // Hands S16 to the next block (only when the task has one) and Y to TMA through the staging ring,
  // so that one store is in flight while the next is written.
  __device__ static void store_block(const context& ctx, consumer_state& st, const output& o, int head, int block,
                                     bool another_block, bool leader) {
    head_scratch& mine = ctx.scratch.heads[ctx.consumer];
    xz_tile& tile = mine.staging[st.output_stores.slot()];
    st.output_stores.acquire(leader, barrier_after(barrier_id::block_done, ctx.consumer));
    if (another_block) warp::store(mine.state_copy, st.s, warpgroup::warp_row(), 0);
    warpgroup::store<0>(tile, o);
    // The stmatrix writes must be visible to wgmma and to the copy engine.
    publish(barrier_after(barrier_id::copies_written, ctx.consumer), WARPGROUP_THREADS);
    if (leader) {
      const int index[4] = {ctx.task.batch, head, block * BLOCK, 0};
      tma::store(ctx.params.y, tile, index);
    }
    st.output_stores.commit(leader);
  }

  template <typename Scratch>
  __device__ static void finish(const params&, Scratch&, int) {
    staging_ring::drain();
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

  static params make_params(const ssd_forward_problem& pr, const segment_geometry& at) {
    params p{};
    p.x = make_tma_map<xz_tile>(heads_layout<T>(pr.x));
    p.b = make_tma_map<bc_tile>(heads_layout<T>(pr.B));
    p.c = make_tma_map<bc_tile>(heads_layout<T>(pr.C));
    if constexpr (GATED) p.z = make_tma_map<xz_tile>(heads_layout<T>(pr.z));
    p.y = make_tma_map<xz_tile>(heads_layout<T>(y_view(pr)));
    p.dt = pr.dt;
    p.A = pr.A;
    p.D = pr.D;
    p.dt_bias = pr.dt_bias;
    p.initial_states = pr.initial_states;
    p.final_states = pr.final_states;
    p.chunk_states = pr.chunk_states;
    p.at = at;
    p.heads_per_group = int(pr.x.heads / pr.B.heads);
    p.D_per_channel = pr.D_per_channel;
    p.dt_softplus = pr.dt_softplus;
    return p;
  }
};

template <typename T, int N>
typename segment_ends_kernel<T, N>::params segment_ends_params(const ssd_forward_problem& pr,
                                                               const segment_geometry& at) {
  using K = segment_ends_kernel<T, N>;
  typename K::params p{};
  p.x = make_tma_map<typename K::xz_tile>(heads_layout<T>(pr.x));
  p.b = make_tma_map<typename K::bc_tile>(heads_layout<T>(pr.B));
  p.dt = pr.dt;
  p.A = pr.A;
  p.dt_bias = pr.dt_bias;
  p.end_states = pr.chunk_states;
  p.decays = pr.final_states;
  p.at = at;
  p.heads_per_group = int(pr.x.heads / pr.B.heads);
  p.dt_softplus = pr.dt_softplus;
  return p;
}

// ------------------------------------------------------------------------------ the split rule

// The cost model of the header comment (sequence_split.cuh's, in 64-position blocks of forward_kernel
// on an SM running two heads).
constexpr int HEADS_PER_SM = 2;  // every plan's consumer warpgroups on an SM
constexpr sequence_split::split_costs SPLIT_COSTS{
    .solo_unit = 0.75,       // a block alone on an SM of a 2-block plan (H100: 2.9 vs 3.8 us)
    .task_start = 1.0,       // a task's entering state and first loads
    .states_unit = 0.25,     // a block of the states pass: one product of the four
    .scan_segment = 0.25,    // a segment of the scan: a global round trip
    .split_launches = 2.0,   // the split's two extra launches
    .max_waves = 4,          // segment counts tried: up to this many waves of heads
};
// The states pass leaves each sequence's segment decays in its final_states (P x N, N >= 64 floats).
constexpr int MAX_SEGMENTS = HEAD_DIM * 64;

// `sequences` = Bt H, `heads_per_task` heads a forward_kernel block (HEADS_PER_SM / heads_per_task
// blocks an SM); the states pass runs one head a block, two an SM.
sequence_split::split plan_split(int64_t sequences, int heads_per_task, int chunks, int blocks_per_chunk,
                                 int blocks, int sms) {
  const sequence_split::split_work work{
      .tasks = sequences / heads_per_task,
      .per_sm = HEADS_PER_SM / heads_per_task,
      .states_tasks = sequences,
      .states_per_sm = HEADS_PER_SM,
      .chunks = chunks,
      .chunk_units = double(blocks_per_chunk),
      .sequence_units = double(blocks),
      .max_segments = MAX_SEGMENTS,
  };
  return sequence_split::plan_split(work, sms, SPLIT_COSTS);
}

template <typename F>
auto dispatch(const ssd_forward_problem& p, F&& f) {
  return tk::dispatch<kernel_dtypes, state_sizes, flags>(
      [&]<element_type E, int N, bool GATED>() { return f.template operator()<element_t<E>, N, GATED>(); }, p.dtype,
      int(p.B.dim), p.z.data != nullptr);
}

template <typename T, int N>
cudaError_t run_segment_ends(const ssd_forward_problem& pr, const segment_geometry& at, cudaStream_t stream) {
  using K = segment_ends_kernel<T, N>;
  static_assert(pipeline::kernel_shared_bytes<K> * K::blocks_per_sm <= pipeline::MAX_SHARED_BYTES_PER_SM, "the plan's blocks fit an SM");
  static_assert(state_elements<N> % SCAN_ELEMENTS_PER_BLOCK == 0, "the scan's blocks tile a state");
  const typename K::params p = segment_ends_params<T, N>(pr, at);
  if (const cudaError_t err = pipeline::launch<K>(p, K::tasks(p).count(), stream); err != cudaSuccess) return err;
  const scan_params scan{pr.initial_states, pr.chunk_states, pr.final_states, at, state_elements<N>};
  const int64_t sequences = int64_t(at.batch) * at.heads;
  const int64_t blocks = sequences * (state_elements<N> / SCAN_ELEMENTS_PER_BLOCK);
  return pipeline::launch(segment_scan_kernel, dim3(unsigned(blocks)), SCAN_THREADS, 0, stream, scan);
}

template <typename T, int N, bool GATED, int HEADS>
cudaError_t run_heads(const ssd_forward_problem& pr, int sms, cudaStream_t stream) {
  using K = forward_kernel<T, N, GATED, HEADS>;
  static_assert(pipeline::kernel_shared_bytes<K> * K::blocks_per_sm <= pipeline::MAX_SHARED_BYTES_PER_SM, "the plan's blocks fit an SM");
  static_assert(K::consumer_warpgroups * K::blocks_per_sm == HEADS_PER_SM &&
                    segment_ends_kernel<T, N>::blocks_per_sm == HEADS_PER_SM,
                "the split's cost model counts two heads an SM");
  segment_geometry at{};
  at.rows = int(pr.x.rows);
  at.heads = int(pr.x.heads);
  at.batch = int(pr.x.batch);
  at.blocks = int(ceil_div(pr.x.rows, int64_t(BLOCK)));
  at.blocks_per_chunk = pr.chunk_size / BLOCK;
  at.chunks = int(ceil_div(pr.x.rows, int64_t(pr.chunk_size)));
  const sequence_split::split split =
      plan_split(int64_t(at.batch) * at.heads, HEADS, at.chunks, at.blocks_per_chunk, at.blocks, sms);
  at.chunks_per_segment = split.chunks_per_segment;
  at.segments = split.segments;
  if (at.segments > 1) {
    if (const cudaError_t err = run_segment_ends<T, N>(pr, at, stream); err != cudaSuccess) return err;
  }
  const typename K::params p = K::make_params(pr, at);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

template <typename T, int N, bool GATED>
cudaError_t run(const ssd_forward_problem& pr, cudaStream_t stream) {
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const int sms = pipeline::sm_count(device);
  // Two heads a block where a group's heads pair up and the shared B, C buy a second stage.
  if constexpr (N == 128) {
    if ((pr.x.heads / pr.B.heads) % 2 == 0) return run_heads<T, N, GATED, 2>(pr, sms, stream);
  }
  return run_heads<T, N, GATED, 1>(pr, sms, stream);
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
  // The tiles TMA moves are the same for one head a block or two.
  return dispatch(p, [&]<typename T, int N, bool GATED>() {
    return forward_kernel<T, N, GATED, 1>::layout_reasons(p);
  });
}

cudaError_t launch(const ssd_forward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T, int N, bool GATED>() { return run<T, N, GATED>(p, stream); });
}

}  // namespace tk::mamba2
