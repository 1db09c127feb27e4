// Attention backward: dq, dk, dv from dO (and dlse), recomputing P from q, k and the forward's lse.
//
//   dS = P * (dP - delta),  dP = dO v^T,  delta = rowsum(dO * O) - dlse
//   dq = scale * dS k,  dk = scale * dS^T q,  dv = P^T dO
//
// Two methods share the statistics pre-pass and the dK/dV kernel:
//   statistics_kernel   per query row: lse2 = lse * log2(e) (+inf for rows that saw no key, so
//                       their P is exactly 0) and delta; rows padded to STATISTICS_ROW_MULTIPLE
//   dkdv_kernel         a block owns 128 keys of one K/V head (64 per consumer warpgroup) and
//                       streams Q / dO tiles of block_q rows (64 at D = 128, 128 at D = 64; with
//                       their rows' lse2 and delta) of every query head of the group:
//                         S^T = K Q^T, dP^T = V dO^T (SS);  P^T = exp2(S^T - lse2);  dV += P^T dO (RS)
//                         dS^T = P^T (dP^T - delta);  dK += dS^T Q (RS)
//                       Beyond D = 128 (column_split) a block owns 64 keys, both consumers': each
//                       forms S^T, dP^T, P^T and dS^T for half of a 64-row query tile, writes its
//                       halves of P^T and dS^T to shared memory, and after a barrier takes half of
//                       dV's and dK's columns: dV[:, half] += P^T dO[:, half], dK[:, half] +=
//                       dS^T Q[:, half] (SS). Recompute only; dq_kernel splits the same way.
// then, for dQ, either
//   accumulated (one pass, the default): the dkdv kernel also writes each step's dS^T to shared
//                       memory, forms the step's dQ partial dS K (SS; each consumer one part of
//                       the step's dQ over all 128 keys: dq_partial_plan) and adds it into an fp32
//                       accumulator in global memory with a bulk reduction (the copy engine adds,
//                       the consumers move on); dq_convert_kernel scales and converts it. The
//                       order of the adds varies from run to run, so dq is not bitwise
//                       reproducible (its rounding differs by a few fp32 ulps of the sum).
//   recomputed (deterministic): dq_kernel, a block owning 128 query rows that streams K/V blocks
//                       and recomputes S = Q K^T, dP = dO V^T;  dS = P (dP - delta);  dQ += dS K
//                       in registers: no atomics, bitwise reproducible, ~40% more tensor work.
//                       Beyond D = 128 a block owns 64 rows, both consumers': each forms S and dP
//                       of half of a 64-key stage, dS goes through shared memory, and each sums
//                       half of dQ's columns.
//
// The forward's options (attention.h) have their backward here. The window takes the gradient kernels'
// windowed variants, a softcap their softcapped ones (window and softcap; backward_features), and the
// plain variants compile to the code they had before the options existed:
//   window   a dK/dV block streams only the query tiles that see its keys (key_window's per-key
//            range), a dQ block only the key blocks its queries see; tiles a window edge or the key
//            tail cuts run masked
//   softcap  the score is recomputed as the forward has it, t = tanh(scale / softcap * q.k) times
//            softcap * log2(e), and dS takes the slope 1 - t^2 (softcap_slope, t recovered from P)
//   sinks    P is recomputed from the forward's lse, which includes the sink, so dq, dk and dv need
//            nothing more (either variant); the sink, one more key of value 0 in each row, gets
//            d loss / d sink = -sum over its head's rows of p_sink * delta (sink_gradient_kernel)
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <type_traits>
#include <utility>

#include "attention.cuh"
#include "kernels/common/row_dot.cuh"

namespace tk::attention {
namespace {

// What both gradient kernels know about the problem.
struct gradient_shape {
  int q_rows, k_rows, q_heads, batch, group;  // group = Hq / Hkv
  int statistics_rows;                 // padded row count of each head's statistics
  float scale;
  float scale_log2;
  bool causal;

  __host__ __device__ visibility vis() const { return {q_rows, k_rows, causal}; }
};

// Where a task's (sequence, query head) statistics start in lse2 and delta, a (rows, statistics_rows)
// matrix: a dense batch's at row batch * Hq + head; packed sequences that share the rows (their starts
// given) at row head, from the sequence's first statistics row (sequence_layout::statistics_start).
template <typename Params, typename Task>
__device__ __forceinline__ bool shares_statistics(const Params& p, const Task&) {
  if constexpr (std::is_same_v<Task, sequence_block>) {
    return p.sequences.statistics_start != nullptr;
  } else {
    return false;
  }
}

// ... as an offset into lse2 and delta
template <typename Params, typename Task>
__device__ __forceinline__ int64_t statistics_offset(const Params& p, const Task& t, int q_head) {
  const gradient_shape& g = p.shape;
  if (shares_statistics(p, t)) return int64_t(q_head) * g.statistics_rows + sequence_rows_of(t, 0, 0).statistics_row0;
  return (int64_t(t.batch) * g.q_heads + q_head) * g.statistics_rows;
}

// ... as the (row, column) of the statistics' tensor maps for rows q0.. of the sequence
template <typename Params, typename Task>
__device__ __forceinline__ void statistics_index(const Params& p, const Task& t, int q_head, int q0, int (&index)[2]) {
  const bool shared = shares_statistics(p, t);
  index[0] = shared ? q_head : t.batch * p.shape.q_heads + q_head;
  index[1] = shared ? sequence_rows_of(t, 0, 0).statistics_row0 + q0 : q0;
}

// ------------------------------------------------------------------------------ statistics

constexpr int STATISTICS_LANES_PER_ROW = 8;
constexpr int STATISTICS_THREADS = 256;

// Per batch and query head statistics_rows rows, those past the sequence's length padding; packed sequences
// share each head's rows, sequence b from sequences.statistics_start[b] on (the rows between them padding).
template <typename T>
struct statistics_params {
  const T* out;
  const T* grad_out;
  int64_t out_strides[3];  // batch, head, row (elements)
  int64_t grad_out_strides[3];
  const float* lse;       // (B, Hq, Nq), or (Hq, total) packed
  const float* grad_lse;  // or nullptr
  float* lse2;            // (B * Hq, statistics_rows), packed (Hq, statistics_rows)
  float* delta;
  sequence_layout sequences;
  int sequence_count, q_heads, dim, statistics_rows;
  int64_t total_rows;  // the statistics' rows over all heads
};

template <typename T>
__global__ void __launch_bounds__(STATISTICS_THREADS) statistics_kernel(const statistics_params<T> p) {
  const statistics_row r = statistics_row_dot<STATISTICS_LANES_PER_ROW, STATISTICS_THREADS>(
      p.out, p.out_strides, p.grad_out, p.grad_out_strides, p.q_heads, p.statistics_rows, p.total_rows, p.dim,
      [&](int64_t batch, int i) {
        if (p.sequences.statistics_start == nullptr) {
          const sequence_rows rows = p.sequences.of(int(batch));
          return row_span{rows.map_batch, rows.q_start, rows.q_rows};
        }
        // row i of a head holds row i - start of the sequence whose statistics start last at or before it
        const sequence_rows rows = p.sequences.of(p.sequences.sequence_of_statistics_row(i, p.sequence_count));
        return row_span{rows.map_batch, rows.q_start - rows.statistics_row0, rows.statistics_row0 + rows.q_rows};
      });
  if (r.lane_in_row != 0 || r.row >= p.total_rows) return;
  if (r.real) {
    // lse as the forward stores it: (map batch, head, row) of the maps' rows
    const int64_t source = (r.span.batch * p.q_heads + r.head) * p.sequences.q_rows + r.span.first + r.i;
    const float lse = p.lse[source];
    p.lse2[r.row] = lse == NEG_INF ? INFINITY : lse * LOG2_E;
    p.delta[r.row] = r.dot - (p.grad_lse != nullptr ? p.grad_lse[source] : 0.0f);
  } else {
    p.lse2[r.row] = INFINITY;  // padding rows: P = exp2(s - inf) = 0, so they add nothing
    p.delta[r.row] = 0.0f;
  }
}

// ------------------------------------------------------------------------------------ dK, dV

// Column statistics of a 128-column row-layout tile spread over the warp (FA3's shuffled
// statistics): a lane of group g holds, for each column half h, the pair of columns
// 16 g + 8 h + 2 t, 2 t + 1 (t = its thread in group), i.e. its own columns' pair of base tile g.
// Four registers per vector instead of 32; each base tile's pair is fetched from group bc's lane
// by a shuffle where it is used.
struct shuffled_column_pairs {
  float2 held[fragment::HALVES];

  // held[h] of lane THREADS_PER_GROUP * BC + (this lane's thread in group): group BC's lane in this
  // lane's position. shfl.sync.idx with segment mask 3 keeps the lane's own low two bits and takes
  // the rest from the immediate, so the source lane costs no register (with __shfl_sync's lane
  // argument each of the 8 base tiles kept its own lane index live through the step).
  template <int BC>
  __device__ __forceinline__ float2 from_group(int h) const {
    static_assert(fragment::THREADS_PER_GROUP == 4, "the segment mask keeps the lane's thread in group");
    constexpr int lane_bits = fragment::THREADS_PER_GROUP * BC;
    constexpr int clamp = ((fragment::THREADS_PER_GROUP - 1) << 8) | (WARP_THREADS - 1);
    float2 v;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, %3, %4;" : "=f"(v.x) : "f"(held[h].x), "n"(lane_bits), "n"(clamp), "n"(ALL_LANES));
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, %3, %4;" : "=f"(v.y) : "f"(held[h].y), "n"(lane_bits), "n"(clamp), "n"(ALL_LANES));
    return v;
  }

  __device__ __forceinline__ void load(const float* values) {
    for (int h = 0; h < fragment::HALVES; ++h) {
      held[h] = *reinterpret_cast<const float2*>(values + BASE_TILE * fragment::group_id() + fragment::CORE * h +
                                                 fragment::PAIR * fragment::thread_in_group());
    }
  }

  // f(br, bc, q, v, w...) for each packed pair [br][bc][q] of an fp32 row-layout Tile, v (each w) the
  // statistics of the pair's two columns in this vector (in each of `others`), each shuffled once and
  // used by every row block at once.
  template <typename Tile, typename F, typename... Others>
  __device__ __forceinline__ void for_each_pair(F&& f, const Others&... others) const {
    static_assert(Tile::layout == register_layout::row && std::is_same_v<typename Tile::element, float>);
    static_assert(Tile::col_blocks == fragment::GROUPS, "one base tile of columns per group of lanes");
    [&]<int... BC>(std::integer_sequence<int, BC...>) {
      (pairs_of_group<BC, Tile>(f, others...), ...);
    }(std::make_integer_sequence<int, Tile::col_blocks>{});
  }

  // for_each_pair's pairs of base tile column BC.
  template <int BC, typename Tile, typename F, typename... Others>
  __device__ __forceinline__ void pairs_of_group(F& f, const Others&... others) const {
#pragma unroll
    for (int h = 0; h < fragment::HALVES; ++h) {
      const float2 v = from_group<BC>(h);
      pair_rows<Tile>(f, BC, h, v, others.template from_group<BC>(h)...);
    }
  }

  template <typename Tile, typename F, typename... Others>
  __device__ __forceinline__ static void pair_rows(F& f, int bc, int h, float2 v, Others... w) {
#pragma unroll
    for (int br = 0; br < Tile::row_blocks; ++br) {
#pragma unroll
      for (int r = 0; r < fragment::HALVES; ++r) f(br, bc, fragment::quadrant(r, h), v, w...);
    }
  }

  // dst = f(pair, v) for each packed pair of dst, v the statistics of the pair's two columns.
  template <typename Tile, typename F>
  __device__ __forceinline__ void map(Tile& dst, F&& f) const {
    for_each_pair<Tile>([&](int br, int bc, int q, float2 v) {
      auto& pair = dst.pairs[br][bc][q];
      pair = f(pair, v);
    });
  }

  // dS^T = P^T (dP^T - delta[query]) in place of dP^T, with P^T and dS^T converted to the 16-bit
  // register operands of dV and dK pair by pair, each shuffled delta pair used at once: every fp32
  // pair of P^T and dP^T dies as its two packed pairs appear, so the step never holds both fp32
  // tiles beside a whole packed one.
  template <typename Scores, typename Operand>
  __device__ __forceinline__ void grad_scores(const Scores& p, Scores& dp, Operand& p16, Operand& ds16) const {
    using pair16 = typename Operand::pair_type;
    for_each_pair<Scores>([&](int br, int bc, int q, float2 d) {
      const float2 pp = p.pairs[br][bc][q];
      float2& g = dp.pairs[br][bc][q];
      g = float2{pp.x * (g.x - d.x), pp.y * (g.y - d.y)};
      p16.pairs[br][bc][q] = convert_pair<pair16>(pp);
      ds16.pairs[br][bc][q] = convert_pair<pair16>(g);
    });
  }

  // grad_scores under a softcap: dS^T also times each score's slope 1 - t^2 (softcap_slope, from P^T
  // and the query's lse2, whose pairs `lse2` holds spread as this vector holds delta's).
  template <typename Scores, typename Operand>
  __device__ __forceinline__ void capped_grad_scores(const Scores& p, Scores& dp, Operand& p16, Operand& ds16,
                                                     const shuffled_column_pairs& lse2, float inverse_c) const {
    using pair16 = typename Operand::pair_type;
    for_each_pair<Scores>(
        [&](int br, int bc, int q, float2 d, float2 l) {
          const float2 pp = p.pairs[br][bc][q];
          float2& g = dp.pairs[br][bc][q];
          g = float2{pp.x * (g.x - d.x) * softcap_slope::apply(pp.x, l.x, inverse_c),
                     pp.y * (g.y - d.y) * softcap_slope::apply(pp.y, l.y, inverse_c)};
          p16.pairs[br][bc][q] = convert_pair<pair16>(pp);
          ds16.pairs[br][bc][q] = convert_pair<pair16>(g);
        },
        lse2);
  }
};

// How the dK/dV kernel leaves dQ: to dq_kernel (recomputed) or summed itself (accumulated).
enum class dq_method { recomputed, accumulated };

// What a gradient kernel compiles in: the causal rule and the key tail (plain); the forward's window
// with causality folded in (unbounded edges reach every key); or that and its softcap. The softcap is
// a variant of its own rather than a switch: its code beside the window's pushed the D = 128 dK/dV step
// past its 240 registers, and the windowed models (Mistral, GPT-OSS) have no softcap.
enum class backward_features { plain, windowed, softcapped };

// The options' parameters, a base of the params of the windowed and softcapped variants, as the
// forward's options are (the plain params keep their layout).
struct options_params {
  sequence_layout sequences;                // dense, or packed (attention_varlen)
  int window_left = -1, window_right = -1;  // the edges as given: each task's key_window is made from
                                            // them and its sequence's lengths (as the forward's)
  float tanh_scale = 0.0f;  // scale / softcap (softcapped; shape.scale_log2 is then softcap * log2(e))
  float inverse_c = 0.0f;   // 1 / (softcap * log2(e)), for softcap_slope
  // Packed: the gradients (total, H, D), stored row by row (a TMA store would clip only at the packed
  // tensor's end, and a sequence's last block reaches into the next); dense: none.
  void* packed_grad_q = nullptr;
  void* packed_grad_k = nullptr;
  void* packed_grad_v = nullptr;
  bool causal = false;

  __device__ key_window window_of(const sequence_block& t) const {
    return key_window::of(t.rows.q_rows, t.rows.k_rows, causal, window_left, window_right);
  }
};

struct no_options {};

template <typename T, int D, dq_method DQ, backward_features FEATURES>
struct dkdv_kernel : dkdv_plan<D> {
  using plan = dkdv_plan<D>;
  using split = typename plan::split;
  static constexpr bool sums_dq = DQ == dq_method::accumulated;
  static_assert(!sums_dq || plan::has_one_pass, "the one-pass method runs up to MAX_UNSPLIT_HEAD_DIM");
  static constexpr bool with_options = FEATURES != backward_features::plain;
  static constexpr bool with_softcap = FEATURES == backward_features::softcapped;
  static constexpr int stages = sums_dq ? plan::one_pass_stages : plan::stages;
  using kv_tile = head_tile<T, plan::rows_per_consumer, D>;  // 64 keys, later (per column part) dK / dV
  using q_tile = head_tile<T, plan::block_q, D>;
  using gradient_tile = head_tile<T, plan::rows_per_consumer, split::cols>;  // a consumer's dK or dV
  using scores = warpgroup::accumulator<plan::consumer_queries>;  // S^T and dP^T: a warp's 16 keys x its queries
  using operand = register_tile<T, BASE_TILE, plan::block_q>;
  using gradient = warpgroup::accumulator<split::cols>;
  using query_vector = per_col_vector<scores>;
  using score_tile = shared_tile<T, plan::rows_per_consumer, plan::block_q>;  // 64 keys' P^T or dS^T

  // The accumulated method's dQ exchange: each consumer's dS^T (its keys x the step's queries)
  // double-buffered by step parity (one consumer may write the next step's while the other still
  // reads this one's), and each consumer's dQ partial staged in fragment order for the reduction.
  using partials = dq_partial_plan<D>;
  using dq_partial = warpgroup::accumulator<partials::part_cols>;
  struct dq_exchange {
    static_assert(plan::block_q == partials::row_parts * partials::rows, "a step's rows are its row parts");
    static constexpr int score_buffers = 2;
    static constexpr int partial_floats = partials::rows * partials::part_cols;
    score_tile grad_scores[score_buffers][plan::consumer_warpgroups];
    alignas(tma::BULK_ALIGNMENT_BYTES) float partial[plan::consumer_warpgroups][partial_floats];
  };
  // Split columns: each stage's P^T and dS^T, both consumers' halves, read whole by both consumers' dV
  // and dK products. Indexed by the step's stage: a consumer writes a stage's tiles again `stages` steps
  // later, after the barrier of the step between, which the other consumer reaches only once that
  // stage's products have finished (ring positions run on across tasks, so no task starts them over).
  struct shared_scores {
    score_tile prob[stages], grad[stages];
  };
  using scratch = std::conditional_t<sums_dq, dq_exchange, std::conditional_t<split::splits, shared_scores, pipeline::none>>;

  struct resident {
    kv_tile k[plan::key_tiles];
    kv_tile v[plan::key_tiles];
  };
  static constexpr uint32_t resident_bytes = 2 * plan::key_tiles * kv_tile::bytes;

  // A step's query tile, its dO, and the statistics of its rows, which land with them so that the
  // first use after the S^T product does not wait on a global load. Split columns: no room for them
  // (a stage's 512 bytes of statistics take 1 KB with the tiles' alignment: 228 KB > 227 KB at
  // D = 256); they are read from global memory, issued before the S^T product's wait.
  static constexpr bool statistics_in_stage = !split::splits;
  using statistics_vector = shared_vector<float, plan::block_q>;
  struct stage_tiles {
    q_tile q, grad_out;
  };
  struct stage_tiles_and_statistics : stage_tiles {
    statistics_vector lse2, delta;
  };
  using stage = std::conditional_t<statistics_in_stage, stage_tiles_and_statistics, stage_tiles>;
  static constexpr uint32_t stage_bytes[] = {2 * q_tile::bytes +
                                             (statistics_in_stage ? 2 * statistics_vector::bytes : 0)};

  struct params : std::conditional_t<with_options, options_params, no_options> {
    CUtensorMap q, k, v, grad_out, grad_k, grad_v;
    CUtensorMap lse2, delta;  // (B * Hq, statistics_rows)
    const float* lse2_rows;   // the same statistics, read from global memory (split columns)
    const float* delta_rows;
    float* dq_accumulator;  // accumulated: (B * Hq, statistics_rows, D) fp32 in partial order; else null
    gradient_shape shape;
  };
  using context = pipeline::task_context<dkdv_kernel>;
  // The windowed and softcapped variants' tasks carry their sequence's rows (dense or packed).
  using task_order = task_order_for<with_options>;
  using task = task_for<with_options>;

  __device__ static sequence_rows rows_of(const params& p, const task& t) {
    return sequence_rows_of(t, p.shape.q_rows, p.shape.k_rows);
  }

  struct consumer_state {
    gradient grad_k, grad_v;
  };

  enum class barrier_id : int {
    consumer_epilogue = FIRST_NAMED_BARRIER,
    scores_shared = consumer_epilogue + plan::consumer_warpgroups,
    partial_staged = scores_shared + plan::consumer_warpgroups,
    keys_read = partial_staged + plan::consumer_warpgroups,
    count,
  };
  static_assert(fits_named_barriers<barrier_id>());

  // This consumer's keys (its own 64, or the block's 64 shared by both), its first column of a step's
  // queries, and its first gradient column.
  __device__ static int key_tile(const context& ctx) { return split::splits ? 0 : ctx.consumer; }
  __device__ static int first_key(const context& ctx) {
    return ctx.task.block * plan::block_kv + key_tile(ctx) * plan::rows_per_consumer;
  }
  __device__ static int first_query_col(const context& ctx) { return split::splits ? ctx.consumer * plan::consumer_queries : 0; }
  __device__ static int first_gradient_col(const context& ctx) { return split::splits ? ctx.consumer * split::cols : 0; }

  // Query tiles: for each of the group's query heads, the tiles that see the block's keys (from the
  // first the keys can see on; under a window, up to the last).
  struct schedule {
    int first_tile, tiles_per_head;
    __device__ int steps(int group) const { return group * tiles_per_head; }
    __device__ int head_in_group(int step) const { return step / tiles_per_head; }
    __device__ int tile(int step) const { return first_tile + step % tiles_per_head; }
  };

  // A packed sequence's key blocks past its end have no query tiles.
  __device__ static schedule schedule_for(const params& p, const task& t) {
    const int k0 = t.block * plan::block_kv;
    if constexpr (with_options) {
      if (k0 >= t.rows.k_rows) return {0, 0};
      const key_window w = p.window_of(t);
      return {w.first_query_block(k0, plan::block_q), w.query_blocks(k0, plan::block_kv, plan::block_q)};
    } else {
      const int first = p.shape.vis().first_query_tile(k0, plan::block_q);
      return {first, max(0, ceil_div(p.shape.q_rows, plan::block_q) - first)};
    }
  }

  __host__ __device__ static task_order tasks(const params& p) {
    if constexpr (with_options) {
      return {{ceil_div(p.sequences.max_k_rows, plan::block_kv), p.shape.q_heads / p.shape.group, p.shape.batch, false},
              p.sequences};
    } else {
      return {ceil_div(p.shape.k_rows, plan::block_kv), p.shape.q_heads / p.shape.group, p.shape.batch, false};
    }
  }

  __device__ static int iterations(const params& p, const task& t) { return schedule_for(p, t).steps(p.shape.group); }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.q);
    tma::prefetch_descriptor(p.grad_out);
  }

  __device__ static void load_resident(const params& p, const task& t, resident& r, mbarrier& full) {
    const sequence_rows rows = rows_of(p, t);
    load_consumer_rows(r.k, p.k, full, rows.map_batch, t.head, rows.k_start + t.block * plan::block_kv);
    load_consumer_rows(r.v, p.v, full, rows.map_batch, t.head, rows.k_start + t.block * plan::block_kv);
  }

  __device__ static int q_head(const params& p, const task& t, const schedule& sched, int step) {
    return t.head * p.shape.group + sched.head_in_group(step);
  }

  // A packed sequence's query rows past its end (the next sequence's) read its padding statistics
  // (lse2 = +inf: P = 0), as a dense batch's rows past Nq do.
  __device__ static void load(const params& p, const task& t, int step, int, stage& s, mbarrier& full) {
    const schedule sched = schedule_for(p, t);
    const sequence_rows rows = rows_of(p, t);
    const int head = q_head(p, t, sched, step);
    const int q0 = sched.tile(step) * plan::block_q;
    const int index[4] = {rows.map_batch, head, rows.q_start + q0, 0};
    tma::load(s.q, p.q, full, index);
    tma::load(s.grad_out, p.grad_out, full, index);
    if constexpr (statistics_in_stage) {
      int statistics_at[2];
      statistics_index(p, t, head, q0, statistics_at);
      tma::load(s.lse2, p.lse2, full, statistics_at);
      tma::load(s.delta, p.delta, full, statistics_at);
    }
  }

  // Accumulated dQ, 1: this consumer's dS^T into shared memory, where every consumer that needs it
  // can read it as dS (its MN-major view). The barrier also certifies that the previous step's
  // partial staging has been read by its reduction.
  // dS^T comes as the fp32 accumulator (block_q = 64) or as the packed operand of dK (block_q = 128).
  template <typename Tile>
  __device__ static void share_grad_scores(const context& ctx, int step, const Tile& grad_scores) {
    if (is_warpgroup_leader()) tma::wait_stores_read<0>();
    score_tile& dst = ctx.scratch.grad_scores[step % dq_exchange::score_buffers][ctx.consumer];
    if constexpr (std::is_same_v<Tile, scores>) {
      warpgroup::store<0>(dst, grad_scores);
    } else {
      warp::store(dst, grad_scores, warpgroup::warp_row(), 0);
    }
    // The stmatrix writes must be visible to wgmma.
    publish(barrier_id::scores_shared, plan::consumer_warpgroups * WARPGROUP_THREADS);
  }

  // Accumulated dQ, 2: this consumer's part of the step's dQ = dS K over all the block's keys: its
  // rows (D = 64) or its columns (D = 128). Issued, not waited for; the caller has fenced the
  // register operands.
  __device__ static void issue_dq_partial(const context& ctx, int step, dq_partial& dq) {
    const auto& grad_scores = ctx.scratch.grad_scores[step % dq_exchange::score_buffers];
    const int row0 = partials::row_parts > 1 ? ctx.consumer * partials::rows : 0;
    const int col0 = partials::column_parts > 1 ? ctx.consumer * partials::part_cols : 0;
    for (int c = 0; c < plan::consumer_warpgroups; ++c) {
      warpgroup::mma<operand_major::mn, operand_major::mn>(dq, grad_scores[c], row0, ctx.resident.k[c], col0, c > 0);
    }
    warpgroup::commit();
  }

  // Accumulated dQ, 3: stage the finished partial and add it into the query tile's accumulator.
  __device__ static void add_dq_partial(const context& ctx, int q_head, int q0, const dq_partial& dq) {
    float* staging = ctx.scratch.partial[ctx.consumer];
    warp::store_fragments(staging, partials::part_cols / BASE_TILE, dq, warp_in_warpgroup());
    // The stores must be visible to the copy engine.
    publish(barrier_after(barrier_id::partial_staged, ctx.consumer), WARPGROUP_THREADS);
    if (is_warpgroup_leader()) {
      const gradient_shape& g = ctx.params.shape;
      // Part c of the step: rows q0 + 64 c (D = 64) or the second column half of rows q0 (D = 128),
      // both partial_floats * c past the step's first row.
      float* tile = ctx.params.dq_accumulator + (statistics_offset(ctx.params, ctx.task, q_head) + q0) * D;
      tma::reduce_add(tile + ctx.consumer * dq_exchange::partial_floats, staging,
                      dq_exchange::partial_floats * sizeof(float));
      tma::commit_stores();
    }
  }

  // P^T = exp2(s2 - lse2[query]) in place of S^T (this consumer's keys from key0, its queries from q0),
  // 0 where the key is hidden from the query; under a softcap s2 is the forward's, softcap * log2(e) *
  // tanh(scale / softcap * q.k).
  template <typename Statistics>
  __device__ static void form_probabilities(const params& p, const task& t, const visibility& vis, scores& s,
                                            const Statistics& lse2, int q0, int key0) {
    const gradient_shape& g = p.shape;
    if constexpr (with_softcap) warp::map<capped_score>(s, s, p.tanh_scale);
    if constexpr (plan::statistics_from_shared) {
      const float c = g.scale_log2;
      lse2.map(s, [c](float2 x, float2 l) {
        return float2{op::exp2::apply(x.x * c - l.x), op::exp2::apply(x.y * c - l.y)};
      });
    } else {
      warp::mul(s, s, g.scale_log2);
      warp::sub_col(s, s, lse2);
      warp::exp2(s, s);
    }
    if constexpr (with_options) {
      // Per key the queries [query_floor, query_end) see it (4 integers a thread, as the plain
      // D = 64 rule's 2); a key past Nk (zero-filled) is hidden from every query.
      const key_window w = p.window_of(t);
      if (!w.sees_whole(q0, plan::consumer_queries, key0, plan::rows_per_consumer)) {
        warp::mask(s, {key0 + warpgroup::warp_row(), q0},
                   [&](int key, int query) {
                     return key < w.k_rows && query >= w.query_floor(key) && query < w.query_end(key);
                   },
                   0.0f);
      }
    } else if (vis.needs_mask(q0, key0, plan::rows_per_consumer)) {
      if constexpr (plan::mask_by_query_floor) {
        warp::mask(s, {key0 + warpgroup::warp_row(), q0},
                   [&](int key, int query) { return query >= vis.query_floor(key); }, 0.0f);
      } else {
        warp::mask(s, {key0 + warpgroup::warp_row(), q0}, [&](int key, int query) { return vis.visible(query, key); },
                   0.0f);
      }
    }
  }

  // Split columns, the rest of a step once P^T is formed: this consumer's halves of P^T and dS^T into the
  // stage's shared tiles, then its gradient columns of dV += P^T dO and dK += dS^T Q over all the step's
  // queries (SS).
  __device__ static void split_gradient_products(const context& ctx, consumer_state& state, const stage& st,
                                                 score_tile& shared_prob, score_tile& shared_grad, scores& s,
                                                 scores& grad_p, const query_vector& lse2, const query_vector& delta) {
    const int query_col0 = first_query_col(ctx);
    warp::store(shared_prob, s, warpgroup::warp_row(), query_col0);
    if constexpr (with_softcap) {
      warp::map<probability_times_slope>(s, s, broadcast<tile_axis::cols, query_vector>{lse2}, ctx.params.inverse_c);
    }
    warpgroup::wait<0>(grad_p);
    // dS^T = P^T (dP^T - delta[query]) (under a softcap s holds P^T times the slope)
    warp::sub_col(grad_p, grad_p, delta);
    warp::mul(grad_p, grad_p, s);
    warp::store(shared_grad, grad_p, warpgroup::warp_row(), query_col0);
    // Both consumers' stmatrix writes must be visible to both consumers' wgmma.
    publish(barrier_id::scores_shared, plan::consumer_warpgroups * WARPGROUP_THREADS);
    const int col0 = first_gradient_col(ctx);
    warpgroup::fence();
    warpgroup::mma<operand_major::k, operand_major::mn>(state.grad_v, shared_prob, 0, st.grad_out, col0, true);
    warpgroup::mma<operand_major::k, operand_major::mn>(state.grad_k, shared_grad, 0, st.q, col0, true);
    warpgroup::commit();
    warpgroup::wait<0>(state.grad_k, state.grad_v);
  }

  __device__ static void compute(const context& ctx, consumer_state& state, pipeline::stage_inputs<dkdv_kernel>& in) {
    const params& p = ctx.params;
    const visibility vis = p.shape.vis();
    const kv_tile& k = ctx.resident.k[key_tile(ctx)];
    const kv_tile& v = ctx.resident.v[key_tile(ctx)];
    const int key0 = first_key(ctx);
    const int query_col0 = first_query_col(ctx);
    warp::zero(state.grad_k);
    warp::zero(state.grad_v);
    scores s, grad_p;  // S^T and dP^T: rows are keys, columns queries
    operand prob, grad_s;
    dq_partial dq;

    const schedule sched = schedule_for(p, ctx.task);
    auto at = in.first();
    for (int step = 0; step < ctx.iterations; ++step, at.advance()) {
      const int q0 = sched.tile(step) * plan::block_q;
      const int head = q_head(p, ctx.task, sched, step);
      const stage& st = in.wait(at);
      // S^T = K Q^T and dP^T = V dO^T, committed apart so that P^T is formed while dP^T runs.
      warpgroup::fence();
      if constexpr (plan::scores_overwritten) {
        warpgroup::mma_overwrite<operand_major::k, operand_major::k>(s, k, 0, st.q, query_col0);
        warpgroup::commit();
        warpgroup::mma_overwrite<operand_major::k, operand_major::k>(grad_p, v, 0, st.grad_out, query_col0);
        warpgroup::commit();
      } else {
        warpgroup::mma<operand_major::k, operand_major::k>(s, k, 0, st.q, query_col0, false);
        warpgroup::commit();
        warpgroup::mma<operand_major::k, operand_major::k>(grad_p, v, 0, st.grad_out, query_col0, false);
        warpgroup::commit();
      }
      query_vector lse2, delta;  // this lane's query columns (block_q = 64)
      shuffled_column_pairs lse2_spread, delta_spread;  // the same, spread over the warp (block_q = 128)
      if constexpr (!statistics_in_stage) {
        const int64_t row = statistics_offset(p, ctx.task, head) + q0 + query_col0;
        warp::load(lse2, p.lse2_rows + row);
        warp::load(delta, p.delta_rows + row);
      } else if constexpr (!plan::statistics_from_shared) {
        warp::load(lse2, st.lse2.data);
        // Under a softcap delta is read where it is used (below): 16 registers fewer through the
        // scores' softcap and exponentials, which kept the step within 240 registers.
        if constexpr (!with_softcap) warp::load(delta, st.delta.data);
      } else {
        lse2_spread.load(st.lse2.data);
        delta_spread.load(st.delta.data);
      }
      warpgroup::wait<1>(s);
      if constexpr (plan::statistics_from_shared) {
        form_probabilities(p, ctx.task, vis, s, lse2_spread, q0, key0);
      } else {
        form_probabilities(p, ctx.task, vis, s, lse2, q0 + query_col0, key0);
      }
      if constexpr (split::splits) {
        split_gradient_products(ctx, state, st, ctx.scratch.prob[at.stage], ctx.scratch.grad[at.stage], s, grad_p,
                                lse2, delta);
      } else {
        if constexpr (!plan::dv_after_scores) {
          warp::copy(prob, s);
          if constexpr (with_softcap) {
            // s becomes what dS^T takes of it, P^T times the slope, while lse2 is at hand (kept until
            // dS^T, lse2 pushed the step past 240 registers).
            warp::map<probability_times_slope>(s, s, broadcast<tile_axis::cols, query_vector>{lse2}, p.inverse_c);
          }
          // dV += P^T dO runs while dS^T is formed.
          warpgroup::fence();
          warpgroup::mma<operand_major::mn>(state.grad_v, prob, st.grad_out, 0, true);
          warpgroup::commit();
          warpgroup::wait<1>(grad_p);  // dP^T has landed; dV may still run
          // dS^T = P^T (dP^T - delta[query]) (under a softcap s holds P^T times the slope)
          if constexpr (with_softcap) warp::load(delta, st.delta.data);
          warp::sub_col(grad_p, grad_p, delta);
          warp::mul(grad_p, grad_p, s);
          warp::copy(grad_s, grad_p);
        } else {
          // dS^T with P^T and dS^T packed as it is formed (FA3's order: dV is issued first of the
          // step's products, once both operands exist).
          warpgroup::wait<0>(grad_p);
          if constexpr (with_softcap) {
            delta_spread.capped_grad_scores(s, grad_p, prob, grad_s, lse2_spread, p.inverse_c);
          } else {
            delta_spread.grad_scores(s, grad_p, prob, grad_s);
          }
          warpgroup::fence();
          warpgroup::mma<operand_major::mn>(state.grad_v, prob, st.grad_out, 0, true);
          warpgroup::commit();
        }
        // Accumulated dQ: dS^T goes to shared memory and the dQ partial is issued before dK += dS^T Q,
        // so that the partial is finished, staged and handed to the bulk reduction while dK runs
        // (FA3's order); issued after dK, its staging would follow the step's last product.
        if constexpr (sums_dq) {
          if constexpr (plan::dv_after_scores) {
            share_grad_scores(ctx, step, grad_s);
          } else {
            share_grad_scores(ctx, step, grad_p);
          }
        }
        warpgroup::fence();
        if constexpr (sums_dq) issue_dq_partial(ctx, step, dq);
        warpgroup::mma<operand_major::mn>(state.grad_k, grad_s, st.q, 0, true);
        warpgroup::commit();
        if constexpr (sums_dq) {
          warpgroup::wait<1>(state.grad_v, prob, dq);  // dV and the partial have landed; dK may still run
          add_dq_partial(ctx, head, q0, dq);
        }
        warpgroup::wait<0>(state.grad_k, state.grad_v, prob, grad_s);
      }
      in.release(at);
    }
  }

  // dK and dV, staged in this consumer's K and V tiles, or split, in its columns of the shared ones: after
  // the last step's barrier no product reads K or V any more (their stores also wait for the reads of
  // the last dQ partial: one bulk-group sequence per issuing thread). Where the consumers read each
  // other's keys for dQ, neither overwrites its K before both have finished reading.
  __device__ static void store(const context& ctx, consumer_state& state) {
    const params& p = ctx.params;
    if constexpr (sums_dq) {
      barrier_sync(barrier_id::keys_read, plan::consumer_warpgroups * WARPGROUP_THREADS);
    }
    warp::mul(state.grad_k, state.grad_k, p.shape.scale);
    const sequence_rows rows = rows_of(p, ctx.task);
    const int key0 = first_key(ctx);
    const int col0 = first_gradient_col(ctx);
    if constexpr (with_options) {
      if (p.packed_grad_k != nullptr) {
        const int kv_heads = p.shape.q_heads / p.shape.group;
        store_packed_rows<T>(p.packed_grad_k, kv_heads, ctx.task.head, rows.k_start, rows.k_rows, key0, state.grad_k, D,
                             col0);
        store_packed_rows<T>(p.packed_grad_v, kv_heads, ctx.task.head, rows.k_start, rows.k_rows, key0, state.grad_v, D,
                             col0);
        return;
      }
    }
    const int index[4] = {rows.map_batch, ctx.task.head, key0, col0};
    const int part = col0 / split::cols;
    store_outputs(barrier_after(barrier_id::consumer_epilogue, ctx.consumer), index,
                  staged(p.grad_k, column_part<gradient_tile>(ctx.resident.k[key_tile(ctx)], part), state.grad_k),
                  staged(p.grad_v, column_part<gradient_tile>(ctx.resident.v[key_tile(ctx)], part), state.grad_v));
  }

  // The reductions must have landed before the dQ conversion reads the accumulator.
  __device__ static void finish(const params&, scratch&, int) {
    if (sums_dq && is_warpgroup_leader()) tma::wait_stores<0>();
  }
};

// --------------------------------------------------------------------------------- dQ convert

// The accumulated method's last pass: dq = scale * the fp32 accumulator, one warpgroup per
// 64-row block of dQ (a partial's rows at both head dims), each warp reading its rows' fragments
// back as the dkdv kernel wrote them.
template <typename T>
struct dq_convert_params {
  const float* dq_accumulator;
  T* grad_q;  // (B, Hq, Nq, D) contiguous, or packed (total, Hq, D)
  sequence_layout sequences;
  int sequence_count, q_heads, statistics_rows;
  float scale;
  int64_t tiles;  // the statistics' rows over all heads / dq_partial_plan<D>::rows
};

template <typename T, int D>
__global__ void __launch_bounds__(WARPGROUP_THREADS) dq_convert_kernel(const dq_convert_params<T> p) {
  using partials = dq_partial_plan<D>;
  constexpr int block_q = partials::rows;
  constexpr int partial_floats = block_q * partials::part_cols;
  const int tiles_per_head = p.statistics_rows / block_q;
  for (int64_t tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const int64_t head_row = tile / tiles_per_head;  // batch * Hq + head (packed: head)
    const int64_t head = head_row % p.q_heads;
    const int tile_row0 = int(tile % tiles_per_head) * block_q;
    // Packed sequences share a head's statistics rows, each from its start (a multiple of the
    // statistics' row multiple, so a tile lies in one sequence's rows).
    const sequence_rows sequence =
        p.sequences.of(p.sequences.statistics_start != nullptr
                           ? p.sequences.sequence_of_statistics_row(tile_row0, p.sequence_count)
                           : int(head_row / p.q_heads));
    const int row0 = tile_row0 - sequence.statistics_row0 + warpgroup::warp_row();
    const int rows = min(BASE_TILE, sequence.q_rows - row0);
    if (rows <= 0) continue;  // padding rows: the whole warp skips them
    // dQ as q is laid out in the maps: (B, Hq, Nq, D), or (total, Hq, D) packed
    const int row_stride = p.sequences.packed() ? p.q_heads * D : D;
    T* grad_q = p.sequences.packed() ? p.grad_q + (int64_t(sequence.q_start + row0) * p.q_heads + head) * D
                                     : p.grad_q + (head_row * p.sequences.q_rows + row0) * D;
    for (int part = 0; part < partials::column_parts; ++part) {
      warpgroup::accumulator<partials::part_cols> dq;
      warp::load_fragments(dq, p.dq_accumulator + tile * block_q * D + part * partial_floats,
                           partials::part_cols / BASE_TILE, warp_in_warpgroup());
      warp::mul(dq, dq, p.scale);
      warp::store(grad_q + part * partials::part_cols, row_stride, dq, rows);
    }
  }
}

// ----------------------------------------------------------------------------------------- dQ

template <typename T, int D, backward_features FEATURES>
struct dq_kernel : dq_plan<D> {
  using plan = dq_plan<D>;
  using split = typename plan::split;
  static constexpr bool with_options = FEATURES != backward_features::plain;
  static constexpr bool with_softcap = FEATURES == backward_features::softcapped;
  using q_tile = head_tile<T, plan::rows_per_consumer, D>;  // 64 rows of Q / dO, later (per column part) dQ
  using kv_tile = head_tile<T, plan::block_kv, D>;
  using gradient_tile = head_tile<T, plan::rows_per_consumer, split::cols>;  // a consumer's dQ
  using scores = warpgroup::accumulator<plan::consumer_keys>;  // S and dP: a warp's 16 queries x its keys
  using operand = register_tile<T, BASE_TILE, plan::block_kv>;
  using gradient = warpgroup::accumulator<split::cols>;
  using row_vector = per_row_vector<scores>;

  // Split columns: each stage's dS, both consumers' halves, read whole by both consumers' dQ products
  // (indexed by the step's stage, as the dK/dV kernel's shared_scores).
  using score_tile = shared_tile<T, plan::rows_per_consumer, plan::block_kv>;
  struct shared_scores {
    score_tile grad[plan::stages];
  };
  using scratch = std::conditional_t<split::splits, shared_scores, pipeline::none>;

  struct resident {
    q_tile q[plan::query_tiles];
    q_tile grad_out[plan::query_tiles];
  };
  static constexpr uint32_t resident_bytes = 2 * plan::query_tiles * q_tile::bytes;

  struct stage {
    kv_tile k, v;
  };
  static constexpr uint32_t stage_bytes[] = {2 * kv_tile::bytes};

  struct params : std::conditional_t<with_options, options_params, no_options> {
    CUtensorMap q, k, v, grad_out, grad_q;
    const float* lse2;
    const float* delta;
    gradient_shape shape;
  };
  using context = pipeline::task_context<dq_kernel>;
  using task_order = task_order_for<with_options>;
  using task = task_for<with_options>;

  __device__ static sequence_rows rows_of(const params& p, const task& t) {
    return sequence_rows_of(t, p.shape.q_rows, p.shape.k_rows);
  }

  struct consumer_state {
    gradient grad_q;
  };

  enum class barrier_id : int {
    consumer_epilogue = FIRST_NAMED_BARRIER,
    scores_shared = consumer_epilogue + plan::consumer_warpgroups,
    count,
  };
  static_assert(fits_named_barriers<barrier_id>());

  __host__ __device__ static task_order tasks(const params& p) {
    if constexpr (with_options) {
      return {{ceil_div(p.sequences.max_q_rows, plan::block_q), p.shape.q_heads, p.shape.batch, p.shape.causal},
              p.sequences};
    } else {
      return {ceil_div(p.shape.q_rows, plan::block_q), p.shape.q_heads, p.shape.batch, p.shape.causal};
    }
  }

  // A packed sequence's blocks past its end are tasks with no work (and nothing to store).
  __device__ static int iterations(const params& p, const task& t) {
    if constexpr (with_options) {
      const int q0 = t.block * plan::block_q;
      return q0 < t.rows.q_rows ? p.window_of(t).key_blocks(q0, plan::block_q, plan::block_kv) : 0;
    } else {
      return p.shape.vis().key_blocks(t.block * plan::block_q, plan::block_q, plan::block_kv);
    }
  }

  // The key block of iteration 0: under a window, the first block the task's queries see.
  __device__ static int first_key_block(const params& p, const task& t) {
    if constexpr (with_options) {
      return p.window_of(t).first_key_block(t.block * plan::block_q, plan::block_kv);
    } else {
      return 0;
    }
  }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.k);
    tma::prefetch_descriptor(p.v);
  }

  __device__ static void load_resident(const params& p, const task& t, resident& r, mbarrier& full) {
    const sequence_rows rows = rows_of(p, t);
    const int row0 = rows.q_start + t.block * plan::block_q;
    load_consumer_rows(r.q, p.q, full, rows.map_batch, t.head, row0);
    load_consumer_rows(r.grad_out, p.grad_out, full, rows.map_batch, t.head, row0);
  }

  __device__ static void load(const params& p, const task& t, int j, int, stage& s, mbarrier& full) {
    const sequence_rows rows = rows_of(p, t);
    const int index[4] = {rows.map_batch, t.head / p.shape.group,
                          rows.k_start + (first_key_block(p, t) + j) * plan::block_kv, 0};
    tma::load(s.k, p.k, full, index);
    tma::load(s.v, p.v, full, index);
  }

  // This consumer's rows (its own 64, or the block's 64 shared by both), its first column of a stage's
  // keys, and its first gradient column.
  __device__ static int query_tile(const context& ctx) { return split::splits ? 0 : ctx.consumer; }
  __device__ static int first_row(const context& ctx) {
    return ctx.task.block * plan::block_q + query_tile(ctx) * plan::rows_per_consumer;
  }
  __device__ static int first_key_col(const context& ctx) { return split::splits ? ctx.consumer * plan::consumer_keys : 0; }
  __device__ static int first_gradient_col(const context& ctx) { return split::splits ? ctx.consumer * split::cols : 0; }

  __device__ static void compute(const context& ctx, consumer_state& state, pipeline::stage_inputs<dq_kernel>& in) {
    const params& p = ctx.params;
    const gradient_shape& g = p.shape;
    const visibility vis = g.vis();
    const q_tile& q = ctx.resident.q[query_tile(ctx)];
    const q_tile& grad_out = ctx.resident.grad_out[query_tile(ctx)];
    const int row0 = first_row(ctx);
    const int key_col0 = first_key_col(ctx);
    const int64_t statistics_row = statistics_offset(p, ctx.task, ctx.task.head) + row0 + warpgroup::warp_row();
    row_vector lse2, delta;
    warp::load(lse2, p.lse2 + statistics_row);
    warp::load(delta, p.delta + statistics_row);
    warp::zero(state.grad_q);
    scores s, grad_p;
    operand grad_s;

    const int first_block = first_key_block(p, ctx.task);
    auto at = in.first();
    for (int j = 0; j < ctx.iterations; ++j, at.advance()) {
      const int key0 = (first_block + j) * plan::block_kv + key_col0;  // this consumer's first key
      const stage& st = in.wait(at);
      // S = Q K^T and dP = dO V^T
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(s, q, 0, st.k, key_col0, false);
      warpgroup::mma<operand_major::k, operand_major::k>(grad_p, grad_out, 0, st.v, key_col0, false);
      warpgroup::commit();
      warpgroup::wait<0>(s, grad_p);

      // dS = P (dP - delta) with P = exp2(s2 - lse2), 0 where hidden (keys >= Nk included: their
      // zero-filled K would give P = exp2(-lse2), which may overflow); under a softcap s2 is the
      // forward's capped score and dS takes its slope.
      if constexpr (with_softcap) warp::map<capped_score>(s, s, p.tanh_scale);
      warp::mul(s, s, g.scale_log2);
      warp::sub_row(s, s, lse2);
      warp::exp2(s, s);
      if constexpr (with_options) {
        const key_window w = p.window_of(ctx.task);
        if (!w.sees_whole(row0, plan::rows_per_consumer, key0, plan::consumer_keys)) {
          warp::mask(s, {row0 + warpgroup::warp_row(), key0},
                     [&](int query, int key) { return key >= w.key_floor(query) && key < w.key_limit(query); }, 0.0f);
        }
      } else if (vis.needs_mask(row0, key0, plan::consumer_keys)) {
        warp::mask(s, {row0 + warpgroup::warp_row(), key0}, [&](int query, int key) { return vis.visible(query, key); },
                   0.0f);
      }
      if constexpr (with_softcap) {
        warp::map<probability_times_slope>(s, s, broadcast<tile_axis::rows, row_vector>{lse2}, p.inverse_c);
      }
      warp::sub_row(grad_p, grad_p, delta);
      warp::mul(grad_p, grad_p, s);
      if constexpr (split::splits) {
        // Split columns: this consumer's half of dS into the stage's shared tile, then its columns of
        // dQ += dS K over all the stage's keys (SS), once both halves are there.
        score_tile& shared_grad = ctx.scratch.grad[at.stage];
        warp::store(shared_grad, grad_p, warpgroup::warp_row(), key_col0);
        publish(barrier_id::scores_shared, plan::consumer_warpgroups * WARPGROUP_THREADS);
        warpgroup::fence();
        warpgroup::mma<operand_major::k, operand_major::mn>(state.grad_q, shared_grad, 0, st.k,
                                                            first_gradient_col(ctx), true);
        warpgroup::commit();
        warpgroup::wait<0>(state.grad_q);
      } else {
        warp::copy(grad_s, grad_p);
        // dQ += dS K
        warpgroup::fence();
        warpgroup::mma<operand_major::mn>(state.grad_q, grad_s, st.k, 0, true);
        warpgroup::commit();
        warpgroup::wait<0>(state.grad_q, grad_s);
      }
      in.release(at);
    }
  }

  // dQ, staged in this consumer's Q tile, or split, in its columns of the shared one: after the last
  // step's barrier no product reads Q any more.
  __device__ static void store(const context& ctx, consumer_state& state) {
    const params& p = ctx.params;
    warp::mul(state.grad_q, state.grad_q, p.shape.scale);
    const sequence_rows rows = rows_of(p, ctx.task);
    const int col0 = first_gradient_col(ctx);
    if constexpr (with_options) {
      if (p.packed_grad_q != nullptr) {
        store_packed_rows<T>(p.packed_grad_q, p.shape.q_heads, ctx.task.head, rows.q_start, rows.q_rows, first_row(ctx),
                             state.grad_q, D, col0);
        return;
      }
    }
    const int index[4] = {rows.map_batch, ctx.task.head, first_row(ctx), col0};
    store_outputs(barrier_after(barrier_id::consumer_epilogue, ctx.consumer), index,
                  staged(p.grad_q, column_part<gradient_tile>(ctx.resident.q[query_tile(ctx)], col0 / split::cols),
                         state.grad_q));
  }
};

// ----------------------------------------------------------------------------------- sinks

// The sinks' gradient. A sink is one more key of value 0 in each row of its head, of probability
// p = exp2(sink * log2(e) - lse2) there (lse2 includes it), so d loss / d sink = -sum over the head's
// rows of p * delta, from the statistics the gradient kernels read (padding rows have lse2 = +inf,
// p = 0, and delta = 0). One block per query head sums its rows in a fixed order (reproducible).
constexpr int SINK_GRADIENT_THREADS = 256;

struct sink_gradient_params {
  const float* sinks;
  const float* lse2;
  const float* delta;
  float* grad_sinks;
  int batch, q_heads, statistics_rows;
};

__global__ void __launch_bounds__(SINK_GRADIENT_THREADS) sink_gradient_kernel(const sink_gradient_params p) {
  constexpr int warps = SINK_GRADIENT_THREADS / WARP_THREADS;
  __shared__ float warp_sums[warps];
  const int head = int(blockIdx.x);
  const float sink2 = p.sinks[head] * LOG2_E;
  float sum = 0.0f;
  for (int b = 0; b < p.batch; ++b) {
    const int64_t rows = (int64_t(b) * p.q_heads + head) * p.statistics_rows;
    for (int r = int(threadIdx.x); r < p.statistics_rows; r += SINK_GRADIENT_THREADS) {
      sum += exp2f(sink2 - p.lse2[rows + r]) * p.delta[rows + r];
    }
  }
  for (int lanes = WARP_THREADS / 2; lanes > 0; lanes /= 2) sum += __shfl_xor_sync(ALL_LANES, sum, lanes);
  if (threadIdx.x % WARP_THREADS == 0) warp_sums[threadIdx.x / WARP_THREADS] = sum;
  __syncthreads();
  if (threadIdx.x != 0) return;
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += warp_sums[w];
  p.grad_sinks[head] = -total;
}

// ------------------------------------------------------------------------------------ host

// The workspace: lse2 and delta per padded statistics row, then (accumulated dQ) the fp32 dQ
// accumulator, D floats per padded row.
struct workspace_view {
  float* lse2;
  float* delta;
  float* dq_accumulator;  // null for the recomputed method
};

// The problem's sequences: its batch, or its packed sequences.
int64_t sequence_count(const backward_problem& pr) { return pr.packed.given() ? pr.packed.count : pr.q.batch; }

// Whether packed sequences share each head's statistics rows (their starts given): otherwise every
// (sequence, head) has the longest sequence's rows.
bool shared_statistics(const backward_problem& pr) { return pr.packed.given() && pr.packed.statistics_start != nullptr; }

// The batches of statistics: one per sequence, or one for all packed sequences that share the rows.
int64_t statistics_batches(const backward_problem& pr) { return shared_statistics(pr) ? 1 : sequence_count(pr); }

// Statistics rows per (batch, query head): the longest sequence's, padded; or every packed sequence's,
// each padded.
int64_t statistics_rows(const backward_problem& pr) {
  if (shared_statistics(pr)) return packed_statistics_rows(pr.packed, pr.q.rows);
  return padded_statistics_rows(sequence_layout_of(pr.packed, pr.q.rows, pr.k.rows).max_q_rows);
}

int64_t statistics_floats(const backward_problem& pr) {
  return statistics_batches(pr) * pr.q.heads * statistics_rows(pr);
}

// The one-pass method's fixed cost (zeroing, then converting, an fp32 copy of dq) pays off only
// against enough score work per query row. One-pass / recompute time measured on the H100
// (benchmarks/results/attention.md): at D = 128, 0.91-0.98x from Nk = 4096 and 0.98-1.21x
// below. At D = 64, whose dK/dV steps take 128 queries (twice D = 128's: half the share of fixed costs),
// one-pass is the faster at every length measured: 0.94-0.97x at Nk = 512-1024, 0.90-0.91x at
// 2048, 0.84-0.86x from 4096, causal or not.
constexpr int64_t ONE_PASS_MIN_KEYS = 4096;
constexpr int ONE_PASS_ALWAYS_HEAD_DIM = 64;

bool one_pass(const backward_problem& pr) {
  if (pr.q.dim > MAX_UNSPLIT_HEAD_DIM) return false;  // (dkdv_plan::has_one_pass)
  switch (pr.method) {
    case backward_method::recompute: return false;
    case backward_method::one_pass: return true;
    case backward_method::fastest:
      return pr.q.dim == ONE_PASS_ALWAYS_HEAD_DIM || pr.k.rows >= ONE_PASS_MIN_KEYS;
  }
  return false;
}

int64_t dq_accumulator_floats(const backward_problem& pr) {
  return one_pass(pr) ? statistics_floats(pr) * pr.q.dim : 0;
}

workspace_view split_workspace(const backward_problem& pr) {
  const int64_t rows = statistics_floats(pr);
  return {pr.workspace, pr.workspace + rows, one_pass(pr) ? pr.workspace + 2 * rows : nullptr};
}

// lse2 or delta as a (statistics batches * Hq, statistics_rows) matrix, for tensor maps.
global_layout<float, 2> statistics_layout(const backward_problem& pr, float* data) {
  const int64_t rows = statistics_rows(pr);
  return {data, {statistics_batches(pr) * pr.q.heads, rows}, {rows}};
}

// The options' rules, as the forward's: the edges and the softcap it takes, and the lengths key_window's
// int bounds take.
std::string options_reason(const backward_problem& pr) {
  if (pr.window_left < -1 || pr.window_right < -1) return "window edges must be >= -1 (-1 = unbounded)";
  if (!(std::isfinite(pr.softcap) && pr.softcap >= 0.0 && pr.softcap * LOG2_E <= FLT_MAX)) {
    return "softcap must be 0 (off) or a finite number > 0 below FLT_MAX / log2(e)";
  }
  if ((pr.has_options() || pr.sinks != nullptr) && pr.q.rows + pr.k.rows > MAX_WINDOWED_ROWS) {
    return "with a window, softcap or sinks, Nq + Nk must be at most 2^30";
  }
  return packed_reason(pr.packed, pr.q.heads, MIN_BACKWARD_BLOCK_Q);
}

template <typename T, int D>
std::string reason_for(const backward_problem& pr) {
  // both methods' and both variants' tiles are the same
  using KV = dkdv_kernel<T, D, dq_method::recomputed, backward_features::plain>;
  using Q = dq_kernel<T, D, backward_features::plain>;
  if (pr.out.batch != pr.q.batch || pr.out.heads != pr.q.heads || pr.out.rows != pr.q.rows || pr.out.dim != pr.q.dim ||
      pr.grad_out.batch != pr.q.batch || pr.grad_out.heads != pr.q.heads || pr.grad_out.rows != pr.q.rows ||
      pr.grad_out.dim != pr.q.dim) {
    return "out and grad_out must have q's shape";
  }
  const auto gradient = [&](void* data, const heads_view& like) { return output_view(data, like, pr.packed.given()); };
  const std::pair<const char*, heads_view> query_like[] = {
      {"q", pr.q}, {"out", pr.out}, {"grad_out", pr.grad_out}, {"grad_q", gradient(pr.grad_q, pr.q)}};
  for (const auto& [name, view] : query_like) {
    if (std::string r = layout_reason<typename KV::q_tile, T>(name, view); !r.empty()) return r;
    if (std::string r = layout_reason<typename Q::q_tile, T>(name, view); !r.empty()) return r;
    if (std::string r = layout_reason<typename Q::gradient_tile, T>(name, view); !r.empty()) return r;
  }
  const std::pair<const char*, heads_view> key_like[] = {
      {"k", pr.k}, {"v", pr.v}, {"grad_k", gradient(pr.grad_k, pr.k)}, {"grad_v", gradient(pr.grad_v, pr.v)}};
  for (const auto& [name, view] : key_like) {
    if (std::string r = layout_reason<typename KV::kv_tile, T>(name, view); !r.empty()) return r;
    if (std::string r = layout_reason<typename Q::kv_tile, T>(name, view); !r.empty()) return r;
    if (std::string r = layout_reason<typename KV::gradient_tile, T>(name, view); !r.empty()) return r;
  }
  return {};
}

gradient_shape shape_of(const backward_problem& pr) {
  return {int(pr.q.rows),
          int(pr.k.rows),
          int(pr.q.heads),
          int(sequence_count(pr)),
          int(pr.q.heads / pr.k.heads),
          int(statistics_rows(pr)),
          pr.scale,
          pr.scale * LOG2_E,
          pr.causal};
}

template <typename T>
cudaError_t run_statistics(const backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  statistics_params<T> p;
  p.out = static_cast<const T*>(pr.out.data);
  p.grad_out = static_cast<const T*>(pr.grad_out.data);
  copy_strides(p.out_strides, pr.out);
  copy_strides(p.grad_out_strides, pr.grad_out);
  p.lse = pr.lse;
  p.grad_lse = pr.grad_lse;
  p.lse2 = w.lse2;
  p.delta = w.delta;
  p.sequences = sequence_layout_of(pr.packed, pr.q.rows, pr.k.rows);
  p.sequence_count = int(sequence_count(pr));
  p.q_heads = int(pr.q.heads);
  p.dim = int(pr.q.dim);
  p.statistics_rows = int(statistics_rows(pr));
  p.total_rows = statistics_floats(pr);
  constexpr int64_t rows_per_block = STATISTICS_THREADS / STATISTICS_LANES_PER_ROW;
  const unsigned blocks = unsigned(ceil_div(p.total_rows, rows_per_block));
  return pipeline::launch(statistics_kernel<T>, blocks, STATISTICS_THREADS, 0, stream, p);
}

// The options variant's parameters, as the forward's options variant has them: the window with causality
// folded in, and under a softcap its tanh's scale and the factor c = softcap * log2(e) of the capped score
// in place of scale * log2(e) (shape_of's; lifted to FLT_MIN below it, as the forward lifts it).
template <typename Params>
void set_options(const backward_problem& pr, Params& p) {
  p.sequences = sequence_layout_of(pr.packed, pr.q.rows, pr.k.rows);
  // Edges past every key and query reach as far as unbounded ones (key_window::of clamps them).
  p.window_left = int(std::min(pr.window_left, MAX_WINDOWED_ROWS));
  p.window_right = int(std::min(pr.window_right, MAX_WINDOWED_ROWS));
  p.causal = pr.causal;
  if (pr.packed.given()) {
    p.packed_grad_q = pr.grad_q;
    p.packed_grad_k = pr.grad_k;
    p.packed_grad_v = pr.grad_v;
  }
  if (pr.softcap > 0.0) {
    p.tanh_scale = float(std::clamp(double(pr.scale) / pr.softcap, double(-FLT_MAX), double(FLT_MAX)));
    const float c = std::max(float(pr.softcap * LOG2_E), FLT_MIN);
    p.shape.scale_log2 = c;
    p.inverse_c = 1.0f / c;
  }
}

template <typename T, int D, dq_method DQ, backward_features FEATURES>
cudaError_t run_dkdv(const backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  using K = dkdv_kernel<T, D, DQ, FEATURES>;
  typename K::params p;
  p.q = make_tma_map<typename K::q_tile>(heads_layout<T>(pr.q));
  p.grad_out = make_tma_map<typename K::q_tile>(heads_layout<T>(pr.grad_out));
  p.k = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.k));
  p.v = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.v));
  p.grad_k = make_tma_map<typename K::gradient_tile>(heads_layout<T>(output_view(pr.grad_k, pr.k, pr.packed.given())));
  p.grad_v = make_tma_map<typename K::gradient_tile>(heads_layout<T>(output_view(pr.grad_v, pr.v, pr.packed.given())));
  p.lse2 = make_tma_map<typename K::statistics_vector>(statistics_layout(pr, w.lse2));
  p.delta = make_tma_map<typename K::statistics_vector>(statistics_layout(pr, w.delta));
  p.lse2_rows = w.lse2;
  p.delta_rows = w.delta;
  p.dq_accumulator = w.dq_accumulator;
  p.shape = shape_of(pr);
  if constexpr (K::with_options) set_options(pr, p);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

// One block per 64-row block of dQ, up to a grid's limit (the kernel strides over the rest).
constexpr int64_t MAX_CONVERT_BLOCKS = int64_t(1) << 20;

template <typename T, int D>
cudaError_t run_dq_convert(const backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  dq_convert_params<T> p;
  p.dq_accumulator = w.dq_accumulator;
  p.grad_q = static_cast<T*>(pr.grad_q);
  p.sequences = sequence_layout_of(pr.packed, pr.q.rows, pr.k.rows);
  p.sequence_count = int(sequence_count(pr));
  p.q_heads = int(pr.q.heads);
  p.statistics_rows = int(statistics_rows(pr));
  p.scale = pr.scale;
  p.tiles = statistics_floats(pr) / dq_partial_plan<D>::rows;
  const unsigned blocks = unsigned(std::min(p.tiles, MAX_CONVERT_BLOCKS));
  return pipeline::launch(dq_convert_kernel<T, D>, blocks, WARPGROUP_THREADS, 0, stream, p);
}

template <typename T, int D, backward_features FEATURES>
cudaError_t run_dq(const backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  using K = dq_kernel<T, D, FEATURES>;
  typename K::params p;
  p.q = make_tma_map<typename K::q_tile>(heads_layout<T>(pr.q));
  p.grad_out = make_tma_map<typename K::q_tile>(heads_layout<T>(pr.grad_out));
  p.grad_q = make_tma_map<typename K::gradient_tile>(heads_layout<T>(output_view(pr.grad_q, pr.q, pr.packed.given())));
  p.k = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.k));
  p.v = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.v));
  p.lse2 = w.lse2;
  p.delta = w.delta;
  p.shape = shape_of(pr);
  if constexpr (K::with_options) set_options(pr, p);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

cudaError_t run_sink_gradient(const backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  const sink_gradient_params p{pr.sinks, w.lse2, w.delta, pr.grad_sinks, int(statistics_batches(pr)),
                               int(pr.q.heads), int(statistics_rows(pr))};
  return pipeline::launch(sink_gradient_kernel, unsigned(pr.q.heads), SINK_GRADIENT_THREADS, 0, stream, p);
}

// The one-pass method: dq summed into the fp32 accumulator by the dK/dV pass, then converted.
template <typename T, int D, backward_features FEATURES>
cudaError_t run_one_pass(const backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  const size_t accumulator_bytes = size_t(dq_accumulator_floats(pr)) * sizeof(float);
  if (const cudaError_t err = cudaMemsetAsync(w.dq_accumulator, 0, accumulator_bytes, stream); err != cudaSuccess) {
    return err;
  }
  if (const cudaError_t err = run_dkdv<T, D, dq_method::accumulated, FEATURES>(pr, w, stream); err != cudaSuccess) {
    return err;
  }
  return run_dq_convert<T, D>(pr, w, stream);
}

// dq, dk and dv by the problem's method, from the statistics.
template <typename T, int D, backward_features FEATURES>
cudaError_t run_gradients(const backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  if constexpr (dkdv_plan<D>::has_one_pass) {
    if (one_pass(pr)) return run_one_pass<T, D, FEATURES>(pr, w, stream);
  }
  if (const cudaError_t err = run_dkdv<T, D, dq_method::recomputed, FEATURES>(pr, w, stream); err != cudaSuccess) {
    return err;
  }
  return run_dq<T, D, FEATURES>(pr, w, stream);
}

template <typename T, int D, backward_features FEATURES>
cudaError_t run(const backward_problem& pr, cudaStream_t stream) {
  const workspace_view w = split_workspace(pr);
  if (const cudaError_t err = run_statistics<T>(pr, w, stream); err != cudaSuccess) return err;
  if (const cudaError_t err = run_gradients<T, D, FEATURES>(pr, w, stream); err != cudaSuccess) return err;
  return pr.sinks != nullptr ? run_sink_gradient(pr, w, stream) : cudaSuccess;
}

}  // namespace

int64_t backward_workspace_floats(const backward_problem& p) {
  return 2 * statistics_floats(p) + dq_accumulator_floats(p);
}

std::string unsupported_reason(const backward_problem& p) {
  if (std::string r = shape_reason<backward_head_dims>(p.q, p.k, p.v); !r.empty()) return r;
  if (std::string r = options_reason(p); !r.empty()) return r;
  return dispatch(p, [&]<typename T, int D>() { return reason_for<T, D>(p); });
}

cudaError_t launch(const backward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T, int D>() {
    if (p.softcap > 0.0) return run<T, D, backward_features::softcapped>(p, stream);
    return p.has_options() ? run<T, D, backward_features::windowed>(p, stream)
                           : run<T, D, backward_features::plain>(p, stream);
  });
}

}  // namespace tk::attention
