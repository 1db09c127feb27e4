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
// Sequence-parallel tasks (kernels/common/sequence_split.cuh) when the tasks above leave SMs idle
// (long N, few B H: the split rule, plan_segments, predicts the cut from the measured per-chunk
// times): each sequence is cut into `segments` runs of whole chunks and three launches replace one:
//
//   segment_ends_kernel         one task per (batch, head, value block, segment but the last): from
//                               zero, the segment's moments and key_gram / key_sum (chunk_moments::add,
//                               the code the forward runs) into its state record in the workspace
//   segment_prefix_sum_kernel   per (batch, head), elementwise in fp32: record s becomes the sum of
//                               records 0..s, the state entering segment s + 1
//   forward_kernel<T, true>     one task per (batch, head, value block, segment): the state entering
//                               the segment from its record (zero for the first), then the chunks as
//                               above, numbered as in the whole sequence
//
// One segment: forward_kernel<T, false> alone, the one-pass kernel (its SASS is that of the kernel
// before the split existed).
//
// The products use raw q and k and fold the feature map's constants into the moments' copies:
// phi's second-order entries multiply to q_a q_b k_a k_b / (2 F) and its first-order ones to
// q_b k_b / sqrt(F). Positions past N arrive as zeros from TMA and only reach rows that are never
// stored, or the moments after the last chunk, which nothing reads.
#include "based_attention.h"
#include "based_attention.cuh"
#include "kernels/common/chunked_causal.cuh"
#include "kernels/common/sequence_split.cuh"
#include "tk/tk.cuh"

namespace tk::based {
namespace {

using warpgroup::operand_major;

using kernel_dtypes = one_of<element_type::bf16, element_type::fp16>;

// ------------------------------------------------------------------------------ segments

// With a split, a task is one (batch, head, value block, segment); `block` is the value block, so the
// chunked_causal epilogue (denominator rows, output tiles) reads it as without a split.
struct segment_task {
  int batch, head, block, segment;
};

// Tasks value block fastest, then segment: the two value blocks of a segment read the same q and k.
struct segment_order {
  int value_blocks, segments, heads, batches;

  __host__ __device__ int count() const { return value_blocks * segments * heads * batches; }

  __host__ __device__ segment_task at(int index) const {
    const int block = index % value_blocks;
    index /= value_blocks;
    const int segment = index % segments;
    const int sequence = index / segments;
    return {sequence / heads, sequence % heads, block, segment};
  }
};

// Where each sequence is cut and where the segments' states live: `states` holds, per (batch, head)
// and per segment but the last, one state record per value block (moment_record), fp32,
// [batch][head][segment][value block][record]. The states pass writes each segment's own
// contribution there; the scan turns record s into the state entering segment s + 1.
struct segment_geometry {
  int chunks, chunks_per_segment, segments;
  float* states;

  __host__ __device__ int first_chunk(int segment) const { return segment * chunks_per_segment; }
  __host__ __device__ int chunks_of(int segment) const {
    const int left = chunks - first_chunk(segment);
    return left < chunks_per_segment ? left : chunks_per_segment;
  }
};

// A state record: the five slabs of moments (64 features x VALUE_BLOCK each), then key_gram and
// key_sum (F x F each, as the register tiles hold them: every row of key_sum the same sum).
constexpr int RECORD_SLAB_FLOATS = SLAB_FEATURES * VALUE_BLOCK;
constexpr int RECORD_GRAM = SLABS * RECORD_SLAB_FLOATS;
constexpr int RECORD_SUM = RECORD_GRAM + FEATURES * FEATURES;
constexpr int RECORD_FLOATS = RECORD_SUM + FEATURES * FEATURES;

template <typename Params, typename Task>
__device__ __forceinline__ float* moment_record(const Params& p, const Task& task, int slot) {
  const int64_t sequence = int64_t(task.batch) * p.heads + task.head;
  const int64_t record = (sequence * (p.at.segments - 1) + slot) * p.value_blocks + task.block;
  return p.at.states + record * RECORD_FLOATS;
}

// What the forward and the states pass share: the moments a chunk adds, and their records.
template <typename T>
struct chunk_moments {
  using moments = warpgroup::accumulator<VALUE_BLOCK>;
  using slabs = taylor_slabs<T>;
  using key_cols = typename slabs::position_cols;
  using feature_rows = typename slabs::slab_rows;
  using small_tile = typename slabs::small_tile;
  using value_tile = shared_tile<T, CHUNK, VALUE_BLOCK>;

  __device__ __forceinline__ static void issue(moments& acc, feature_rows& a_op, const value_tile& v) {
    warpgroup::fence();
    warpgroup::mma<operand_major::mn>(acc, a_op, v, 0, true);
    warpgroup::commit();
  }

  // moments_t += phi_t(K)^T V, phi_t(K)^T built in registers; product FIRST_PRODUCT + t uses operand
  // buffer (FIRST_PRODUCT + t) % OPERAND_BUFFERS, pinned (with `pinned`) until the product after the
  // next is issued. Then the denominator's moments.
  template <int FIRST_PRODUCT, typename... Pinned>
  __device__ __forceinline__ static void add(moments (&m)[SLABS], small_tile& key_gram, small_tile& key_sum,
                                             feature_rows (&operand)[OPERAND_BUFFERS], const key_cols& k,
                                             const key_cols& ones, const value_tile& v, Pinned&... pinned) {
#pragma unroll
    for (int t = 0; t < SLABS; ++t) {
      const int product = FIRST_PRODUCT + t;
      slabs::transposed(operand[product % OPERAND_BUFFERS], k, t);
      issue(m[t], operand[product % OPERAND_BUFFERS], v);
      warpgroup::wait<OPERAND_BUFFERS - 1>(operand[(product + 1) % OPERAND_BUFFERS], pinned...);
    }
    warp::mma_AtB(key_gram, k, k, key_gram);
    warp::mma_AtB(key_sum, ones, k, key_sum);
  }

  // The state of a sequence's (or segment's) start: no keys yet.
  __device__ __forceinline__ static void zero(moments (&m)[SLABS], small_tile& key_gram, small_tile& key_sum) {
#pragma unroll
    for (int t = 0; t < SLABS; ++t) warp::zero(m[t]);
    warp::zero(key_gram);
    warp::zero(key_sum);
  }

  // The warpgroup's state into a record (the denominator's moments from warp 0: every warp holds them).
  __device__ static void store(float* record, const moments (&m)[SLABS], const small_tile& key_gram,
                               const small_tile& key_sum) {
    const int row0 = warpgroup::warp_row();
#pragma unroll
    for (int t = 0; t < SLABS; ++t) warp::store(record + t * RECORD_SLAB_FLOATS + row0 * VALUE_BLOCK, VALUE_BLOCK, m[t]);
    if (warp_in_warpgroup() == 0) {
      warp::store(record + RECORD_GRAM, FEATURES, key_gram);
      warp::store(record + RECORD_SUM, FEATURES, key_sum);
    }
  }

  __device__ static void load(moments (&m)[SLABS], small_tile& key_gram, small_tile& key_sum, const float* record) {
    const int row0 = warpgroup::warp_row();
#pragma unroll
    for (int t = 0; t < SLABS; ++t) warp::load(m[t], record + t * RECORD_SLAB_FLOATS + row0 * VALUE_BLOCK, VALUE_BLOCK);
    warp::load(key_gram, record + RECORD_GRAM, FEATURES);
    warp::load(key_sum, record + RECORD_SUM, FEATURES);
  }
};

// ------------------------------------------------------------------------------ states pass

// Each segment but the last from zero: its moments and the denominator's into its record. The stage is
// the chunk's k and block of v only.
template <typename T>
struct segment_ends_kernel : based_plan {
  using qk_tile = shared_tile<T, CHUNK, FEATURES>;
  using value_tile = shared_tile<T, CHUNK, VALUE_BLOCK>;
  using helper = chunk_moments<T>;
  using moments = typename helper::moments;
  using key_cols = typename helper::key_cols;
  using feature_rows = typename helper::feature_rows;
  using small_tile = typename helper::small_tile;

  struct stage {
    qk_tile k;
    value_tile v;
  };
  static constexpr uint32_t stage_bytes[] = {qk_tile::bytes + value_tile::bytes};

  struct params {
    CUtensorMap k, v;
    int heads, batch, value_blocks;
    segment_geometry at;
  };

  using context = pipeline::task_context<segment_ends_kernel>;
  using inputs = pipeline::stage_inputs<segment_ends_kernel>;

  struct consumer_state {
    moments m[SLABS];
    small_tile key_gram, key_sum;
  };

  __host__ __device__ static segment_order tasks(const params& p) {
    return {p.value_blocks, p.at.segments - 1, p.heads, p.batch};
  }

  __device__ static int iterations(const params& p, segment_task task) { return p.at.chunks_of(task.segment); }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.k);
    tma::prefetch_descriptor(p.v);
  }

  __device__ static void load(const params& p, segment_task task, int chunk, int, stage& s, mbarrier& full) {
    const int row = (p.at.first_chunk(task.segment) + chunk) * CHUNK;
    const int k_index[4] = {task.batch, task.head, row, 0};
    const int v_index[4] = {task.batch, task.head, row, task.block * VALUE_BLOCK};
    tma::load(s.k, p.k, full, k_index);
    tma::load(s.v, p.v, full, v_index);
  }

  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    helper::zero(st.m, st.key_gram, st.key_sum);
    key_cols ones;
    warp::fill(ones, 1.0f);
    auto at = in.first();
    for (int chunk = 0; chunk < ctx.iterations; ++chunk, at.advance()) {
      const stage& s = in.wait(at);
      key_cols k;
      warp::load(k, s.k);
      feature_rows operand[OPERAND_BUFFERS];
      helper::template add<0>(st.m, st.key_gram, st.key_sum, operand, k, ones, s.v);
      warpgroup::wait<0>(operand, st.m);
      in.release(at);
    }
    helper::store(moment_record(ctx.params, ctx.task, ctx.task.segment), st.m, st.key_gram, st.key_sum);
  }

  static params make_params(const causal_forward_problem& pr, const segment_geometry& at) {
    params p{};
    p.k = make_tma_map<qk_tile>(heads_layout<T>(pr.k));
    p.v = make_tma_map<value_tile>(heads_layout<T>(pr.v));
    p.heads = int(pr.q.heads);
    p.batch = int(pr.q.batch);
    p.value_blocks = int(pr.v.dim / VALUE_BLOCK);
    p.at = at;
    return p;
  }
};

// ------------------------------------------------------------------------------ forward

// SPLIT: one task per (batch, head, value block, segment), from the state entering the segment (the
// scan's record; zero for the first). Without it, exactly the one-pass kernel: one task per (batch,
// head, value block), the whole sequence.
template <typename T, bool SPLIT>
struct forward_kernel : based_plan, chunked_causal::kernel_base<T, FEATURES, CHUNK, VALUE_BLOCK> {
  using base = chunked_causal::kernel_base<T, FEATURES, CHUNK, VALUE_BLOCK>;
  using typename base::barrier_id;
  using typename base::output;
  struct split_params : base::params {
    segment_geometry at;
  };
  using params = std::conditional_t<SPLIT, split_params, typename base::params>;
  using typename base::qk_tile;
  using typename base::row_vector;
  using typename base::stage;
  using typename base::value_tile;
  using moment_tile = shared_tile<T, SLAB_FEATURES, VALUE_BLOCK>;  // a slab's scaled copy
  using scores = warpgroup::accumulator<CHUNK>;                 // a warp's 16 queries x 64 keys
  using weights = register_tile<T, BASE_TILE, CHUNK>;           // A = taylor(S) as a wgmma operand
  using moments = warpgroup::accumulator<VALUE_BLOCK>;
  using slabs = taylor_slabs<T>;
  using helper = chunk_moments<T>;
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
    chunked_causal::staging_ring output_stores;  // picks the staging tile of each output chunk
  };

  // ------------------------------------------------------------------------------ producer

  __host__ __device__ static auto tasks(const params& p) {
    if constexpr (SPLIT) {
      return segment_order{p.value_blocks, p.at.segments, p.heads, p.batch};
    } else {
      return base::tasks(p);
    }
  }

  template <typename Task>
  __device__ static int iterations(const params& p, Task task) {
    if constexpr (SPLIT) {
      return p.at.chunks_of(task.segment);
    } else {
      return base::iterations(p, task);
    }
  }

  // Chunk `chunk` of the task's segment is chunk first_chunk + chunk of the sequence.
  template <typename Task>
  __device__ static void load(const params& p, Task task, int chunk, int part, stage& s, mbarrier& full) {
    if constexpr (SPLIT) {
      base::load(p, pipeline::head_block{task.batch, task.head, task.block}, p.at.first_chunk(task.segment) + chunk,
                 part, s, full);
    } else {
      base::load(p, task, chunk, part, s, full);
    }
  }

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

  // With a split, the segment's chunks keep their numbers in the sequence (the denominator's count
  // of earlier positions, the output rows): `ctx` then counts iterations up to the segment's end.
  __device__ static void compute(const context& ctx, consumer_state& st, inputs& in) {
    if constexpr (SPLIT) {
      const int first = ctx.params.at.first_chunk(ctx.task.segment);
      const context whole{ctx.params, ctx.task, first + ctx.iterations, ctx.consumer, ctx.resident, ctx.scratch};
      walk(whole, st, in, first);
    } else {
      walk(ctx, st, in, 0);
    }
  }

  // The state entering the task's segment: the scan's record, in registers and as the moments' copies.
  __device__ static void enter_segment(const context& ctx, consumer_state& st) {
    helper::load(st.m, st.key_gram, st.key_sum, moment_record(ctx.params, ctx.task, ctx.task.segment - 1));
    write_copies(ctx, st);
    publish(barrier_id::copies_written, WARPGROUP_THREADS);  // the copies must be visible to wgmma
  }

  __device__ __forceinline__ static void walk(const context& ctx, consumer_state& st, inputs& in, int first_chunk) {
    const params& p = ctx.params;
    const int warp_row0 = warpgroup::warp_row();
    const bool leader = is_warpgroup_leader();
    bool entered = false;
    if constexpr (SPLIT) {
      if (first_chunk > 0) {
        enter_segment(ctx, st);
        entered = true;
      }
    }
    if (!entered) {
      helper::zero(st.m, st.key_gram, st.key_sum);
    }
    key_cols ones;
    warp::fill(ones, 1.0f);

    auto at = in.first();
    for (int chunk = first_chunk; chunk < ctx.iterations; ++chunk, at.advance()) {
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
      // Its products continue the earlier chunks' sequence (product SLABS + t).
      helper::template add<SLABS>(st.m, st.key_gram, st.key_sum, operand, k, ones, s.v, a);
      warpgroup::wait<0>(o, operand, st.m);
      in.release(at);

      base::normalize(ctx, o, den, chunk);
      store_chunk(ctx, st, o, chunk, leader);
    }
  }

  // Hands the moments to the next chunk (scaled copies) and the output tile to TMA.
  __device__ static void store_chunk(const context& ctx, consumer_state& st, const output& o, int chunk, bool leader) {
    base::store_chunk(ctx, ctx.scratch.staging, st.output_stores, o, chunk, leader, [&] { write_copies(ctx, st); });
  }

  // The moments' scaled 16-bit copies, which the next chunk's O += phi_t(Q) moments_t reads.
  __device__ __forceinline__ static void write_copies(const context& ctx, const consumer_state& st) {
#pragma unroll
    for (int t = 0; t < SLABS; ++t) {
      moments scaled;
      warp::mul(scaled, st.m[t], slabs::copy_scale(t));
      warpgroup::store<0>(ctx.scratch.moments[t], scaled);
    }
  }
};

// ----------------------------------------------------------------------------------- host

// ------------------------------------------------------------------------------ the split rule

// sequence_split's cost model in units of one chunk of the forward on an SM running two tasks: 2.7 us
// on the H100 (N <= 4096 at the bench shapes, >= 256 tasks for 264 slots); alone on its SM a task's
// chunk takes 1.7 us (N = 8192, 16384: 128 and 64 tasks), 0.63 of that. The states pass's chunk is
// five slab products and phi(K)^T builds of the forward's twelve products and both builds: 0.4 is
// an estimate, not measured. A task's start (the entering record, 43 KB, and the first loads) one
// chunk; the scan's segment and the two extra launches as mamba2_ssd measured them.
constexpr sequence_split::split_costs SPLIT_COSTS{
    .solo_unit = 0.63,
    .task_start = 1.0,
    .states_unit = 0.4,
    .scan_segment = 0.25,
    .split_launches = 2.0,
    .max_waves = 4,
};
constexpr int MAX_SEGMENTS = 64;

segment_geometry plan_segments(const forward_problem& pr, int sms) {
  segment_geometry at{};
  at.chunks = int(ceil_div<int64_t>(pr.q.rows, CHUNK));
  const int64_t tasks = pr.q.batch * pr.q.heads * (pr.v.dim / VALUE_BLOCK);
  // (Segments of so many tasks that their grid would not fit are never predicted faster: capped anyway.)
  const int most = int(std::min<int64_t>(MAX_SEGMENTS, chunked_causal::MAX_GRID_TASKS / tasks));
  const sequence_split::split_work work{
      .tasks = tasks,
      .per_sm = based_plan::blocks_per_sm,
      .states_tasks = tasks,
      .states_per_sm = based_plan::blocks_per_sm,
      .chunks = at.chunks,
      .chunk_units = 1.0,
      .sequence_units = double(at.chunks),
      .max_segments = most,
  };
  const sequence_split::split cut = sequence_split::plan_split(work, sms, SPLIT_COSTS);
  at.chunks_per_segment = cut.chunks_per_segment;
  at.segments = cut.segments;
  return at;
}

cudaError_t plan_segments(const forward_problem& pr, segment_geometry& at) {
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  at = plan_segments(pr, pipeline::sm_count(device));
  return cudaSuccess;
}

int64_t workspace_floats(const forward_problem& pr, const segment_geometry& at) {
  if (at.segments <= 1) return 0;
  return pr.q.batch * pr.q.heads * (at.segments - 1) * (pr.v.dim / VALUE_BLOCK) * RECORD_FLOATS;
}

template <typename T>
cudaError_t run(const forward_problem& pr, cudaStream_t stream) {
  segment_geometry at{};
  if (const cudaError_t err = plan_segments(pr, at); err != cudaSuccess) return err;
  if (at.segments <= 1) {
    using K = forward_kernel<T, false>;
    const typename K::params p = K::make_params(pr);
    return pipeline::launch<K>(p, K::tasks(p).count(), stream);
  }
  if (pr.workspace == nullptr) return cudaErrorInvalidValue;  // forward_workspace_floats() said how much
  at.states = pr.workspace;
  using E = segment_ends_kernel<T>;
  using K = forward_kernel<T, true>;
  static_assert(pipeline::kernel_shared_bytes<E> * E::blocks_per_sm <= pipeline::MAX_SHARED_BYTES_PER_SM, "the plan's blocks fit an SM");
  const typename E::params ends = E::make_params(pr, at);
  if (const cudaError_t err = pipeline::launch<E>(ends, E::tasks(ends).count(), stream); err != cudaSuccess) return err;
  // Per (batch, head): segments - 1 slots of value_blocks records each.
  if (const cudaError_t err = sequence_split::segment_prefix_sum(at.states, pr.q.batch * pr.q.heads, at.segments - 1,
                                                                 (pr.v.dim / VALUE_BLOCK) * RECORD_FLOATS, stream);
      err != cudaSuccess) {
    return err;
  }
  typename K::params p{};
  static_cast<typename K::base::params&>(p) = K::make_params(pr);
  p.at = at;
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
  // The split's kernels move the same tiles (its states pass a subset).
  return dispatch(p, [&]<typename T>() { return forward_kernel<T, false>::layout_reasons(p); });
}

int64_t forward_workspace_floats(const forward_problem& p) {
  segment_geometry at{};
  if (plan_segments(p, at) != cudaSuccess) return 0;  // launch reports the error
  return workspace_floats(p, at);
}


cudaError_t launch(const forward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T>() { return run<T>(p, stream); });
}

}  // namespace tk::based
