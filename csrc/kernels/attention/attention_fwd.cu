// Attention forward: out = softmax(scale * q k^T + mask) v and lse, one query block per task: 128
// rows (two consumers) at D = 128, 192 rows (three consumers) at D = 64 (forward_plan).
//
//   producer (warpgroup 0)      TMA: Q once per task (resident), then K_j and V_j into a ring whose
//                               K and V parts are released separately
//   consumers (warpgroups 1..)  64 query rows each; per key block j, overlapping the softmax of
//                               block j with the tensor cores working on P_{j-1} V_{j-1}:
//                                 issue S_j = Q K_j^T;  issue O += P_{j-1} V_{j-1}
//                                 wait S_j;  masked online softmax of S_j (rescale factor per row;
//                                 exp2(c s - max), scale and max in one FFMA per score)
//                                 wait O;  O *= rescale (only when a row's max moved far);
//                                 P_j = bf16/fp16(S_j)
//                               and the consumers take turns issuing in a fixed rotation (ping-pong
//                               with two; 0 -> 1 -> 2 -> 0 with three, as FA3 does at hdim 64), so
//                               the others' softmax runs while one warpgroup's products run
//   epilogue (consumers)        O /= rowsum, stmatrix into the Q tile, TMA store (tail rows clipped);
//                               lse = ln(sum) + max in natural log
//
// Key blocks past the last one a causal block sees are never loaded. The blocks every row of a
// consumer sees whole run first, without mask code; the blocks that cross the diagonal or the key
// tail (TMA zero-fills keys >= Nk, whose scores must become -inf) run after them, masked.
//
// The options variant (forward_features::options) adds FlashAttention's window, softcap and sinks
// (attention.h), each switched on or off per call by its parameters; the plain variant compiles to
// the code it had before they existed.
//   window   a task visits only the key blocks its queries see (key_window): the blocks left of
//            the window are never loaded either, so the work follows the visible pairs. A
//            consumer's blocks cut by the window's left edge run masked before its whole blocks,
//            those cut by the right edge or the key tail after them.
//   softcap  the raw score becomes t = tanh(scale / softcap * q.k) and the FFMA's factor
//            softcap * log2(e) instead of scale * log2(e): the capped score in log2 units, with
//            the row max still taken before the factor (t is increasing in q.k, the factor > 0)
//   sinks    joined in the epilogue as one more key of value 0 (join_sink)
#include <algorithm>
#include <cfloat>
#include <type_traits>

#include "attention.cuh"

namespace tk::attention {
namespace {

// Lazy rescaling (FlashAttention-4's conditional rescale): a row's O and sum stay scaled to the max
// they were last rescaled to (`used`), and its exponentials are taken against that, until the row's
// running max exceeds it by more than RESCALE_THRESHOLD (log2 units); only then, in a branch that a
// warp takes when any of its rows needs it, are O and the sum rescaled to the new max. The common
// block, whose max moved little or not at all, skips the O multiplies (D / 2 per thread and block).
// Exact up to rounding: every row's O, sum and lse refer to the same `used`. The threshold bounds
// p = exp2(s - used) by 2^RESCALE_THRESHOLD = 256: fp16 P (max 65504, about 2^16) keeps 2^8 of
// headroom and bf16 (max about 2^128) far more; a row sum is at most Nk * 256 <= 2^38 in fp32; the
// precision of p, the sum and O is relative and does not change with the scale. One value for both
// types: fp16 bounds it below 16, and a larger one for bf16 would only skip the rare blocks whose
// max rises by more than 8 (a factor 256 in p) after the first.
constexpr float RESCALE_THRESHOLD = 8.0f;

// Whether a row's max has moved far enough from the one its O and sum are scaled to (used = -inf
// before the first visible key; -inf - -inf is NaN, which compares false: such a row stays put).
struct moves_max {
  __device__ static bool apply(float used, float max) { return max - used > RESCALE_THRESHOLD; }
};
struct lazy_max {
  __device__ static float apply(float used, float max) { return moves_max::apply(used, max) ? max : used; }
};

// A row that has seen only hidden keys keeps max = -inf: its exponentials are taken against 0
// instead (exp2(-inf - -inf) would be NaN).
struct exponent_offset {
  __device__ static float apply(float max) { return max == NEG_INF ? 0.0f : max; }
};
// sum is 0 exactly when the row saw no key (otherwise its max contributes exp2(0) = 1): out = 0.
struct reciprocal_or_zero {
  __device__ static float apply(float sum) { return sum > 0.0f ? 1.0f / sum : 0.0f; }
};
// The exponent of a score: c s - offset in one FFMA (one rounding).
struct scale_minus_offset {
  __device__ static float apply(float s, float c, float offset) { return fmaf(s, c, -offset); }
};
struct natural_lse {
  __device__ static float apply(float max2, float sum) { return sum > 0.0f ? (max2 + __log2f(sum)) * LN_2 : NEG_INF; }
};

// Which of FlashAttention's options an instantiation compiles in: none, or window, softcap and sinks
// together, each off unless its parameter switches it on (one variant rather than one per
// combination: the switches cost a few uniform branches, not registers in the mainloop).
enum class forward_features { plain, options };

// The options' parameters (run() sets them from the problem); the plain variant has none.
struct options_params {
  sequence_layout sequences;                // dense, or packed (attention_varlen)
  int window_left = -1, window_right = -1;  // the edges as given (-1 = unbounded): each task's key_window
                                            // is made from them and its sequence's lengths
  bool softcapped = false;
  float tanh_scale = 0.0f;        // scale / softcap, if softcapped
  const float* sinks = nullptr;  // (Hq,), or none
  void* packed_out = nullptr;    // packed: out (total, Hq, D), stored row by row (below); dense: none
};
struct no_options {};

template <typename T, int D, forward_features FEATURES>
struct forward_kernel : forward_plan<D> {
  using plan = forward_plan<D>;
  static constexpr bool with_options = FEATURES == forward_features::options;
  using q_tile = shared_tile<T, plan::rows_per_consumer, D>;  // one consumer's query rows, later its output
  using kv_tile = shared_tile<T, plan::block_kv, D>;
  using scores = warpgroup::accumulator<plan::block_kv>;      // a warp's 16 query rows x 128 keys
  using probabilities = register_tile<T, BASE_TILE, plan::block_kv>;
  using output = warpgroup::accumulator<D>;
  using row_vector = per_row_vector<scores>;

  struct resident {
    q_tile q[plan::consumer_warpgroups];
  };
  static constexpr uint32_t resident_bytes = plan::consumer_warpgroups * q_tile::bytes;

  struct stage {
    kv_tile k, v;
  };
  enum part : int { key_part, value_part };
  static constexpr uint32_t stage_bytes[] = {kv_tile::bytes, kv_tile::bytes};

  // The options' parameters are a base rather than a member: the plain variant's params keep their
  // layout (nvcc lays an empty [[no_unique_address]] member out differently on the device than on
  // the host).
  struct params : std::conditional_t<with_options, options_params, no_options> {
    CUtensorMap q, k, v, out;  // boxes of one panel of q_tile / kv_tile / q_tile
    float* lse;
    int q_rows, k_rows, q_heads, batch, group;  // group = Hq / Hkv
    float scale_log2;  // c = scale * log2(e) (softcap * log2(e) if softcapped), |c| >= FLT_MIN (run() lifts
                       // smaller ones, 0 included)
    bool negative;     // c < 0: the row max of c s is c times the raw scores' row min
    bool causal;

    __device__ visibility vis() const { return {q_rows, k_rows, causal}; }
  };
  using context = pipeline::task_context<forward_kernel>;
  using inputs = pipeline::stage_inputs<forward_kernel>;
  // The options variant's tasks carry their sequence's rows (dense or packed); the plain variant's are
  // the dense batch's.
  using task_order = task_order_for<with_options>;
  using task = task_for<with_options>;

  // Per row: the max O and the sum are scaled to (the running max of the scaled log2 scores, or up
  // to RESCALE_THRESHOLD below it; log2 units) and this lane's share of sum exp2(c s - max).
  struct consumer_state {
    output o;
    row_vector max, sum;
  };

  enum class barrier_id : int {
    consumer_epilogue = FIRST_NAMED_BARRIER,  // one per consumer: its output tile is written
    issue_turn = consumer_epilogue + plan::consumer_warpgroups,  // one per consumer: its turn to issue
    tail_values_zeroed = issue_turn + plan::consumer_warpgroups,  // packed: the last V tile's rows past the keys
    count,
  };
  static_assert(fits_named_barriers<barrier_id>());

  // ------------------------------------------------------------------------------ producer

  __host__ __device__ static task_order tasks(const params& p) {
    if constexpr (with_options) {
      const sequence_layout& seq = p.sequences;
      return {{ceil_div(seq.max_q_rows, plan::block_q), p.q_heads, p.batch, p.causal}, seq};
    } else {
      return {ceil_div(p.q_rows, plan::block_q), p.q_heads, p.batch, p.causal};
    }
  }

  // Where the task's sequence lies in the maps.
  __device__ static sequence_rows rows_of(const params& p, const task& t) { return sequence_rows_of(t, p.q_rows, p.k_rows); }

  // The options' mask of the task's sequence (causal folded in).
  __device__ static key_window window_of(const params& p, const task& t) {
    return key_window::of(t.rows.q_rows, t.rows.k_rows, p.causal, p.window_left, p.window_right);
  }

  // A packed sequence's blocks past its end are tasks with no work (and nothing to store).
  __device__ static int iterations(const params& p, const task& t) {
    if constexpr (with_options) {
      const int q0 = t.block * plan::block_q;
      return q0 < t.rows.q_rows ? window_of(p, t).key_blocks(q0, plan::block_q, plan::block_kv) : 0;
    } else {
      return p.vis().key_blocks(t.block * plan::block_q, plan::block_q, plan::block_kv);
    }
  }

  // The key block of iteration 0: under a window, the first block the task's queries see.
  __device__ static int first_key_block(const params& p, const task& t) {
    if constexpr (with_options) {
      return window_of(p, t).first_key_block(t.block * plan::block_q, plan::block_kv);
    } else {
      return 0;
    }
  }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.q);
    tma::prefetch_descriptor(p.k);
    tma::prefetch_descriptor(p.v);
    tma::prefetch_descriptor(p.out);
  }

  __device__ static void load_resident(const params& p, const task& t, resident& r, mbarrier& full) {
    const sequence_rows rows = rows_of(p, t);
    load_consumer_rows(r.q, p.q, full, rows.map_batch, t.head, rows.q_start + t.block * plan::block_q);
  }

  // Keys past the sequence's end (zero-filled past the tensor, or the next packed sequence's) are
  // masked as the key tail.
  __device__ static void load(const params& p, const task& t, int j, int part, stage& s, mbarrier& full) {
    const sequence_rows rows = rows_of(p, t);
    const int key0 = (first_key_block(p, t) + j) * plan::block_kv;
    int key_row = rows.k_start + key0;
    if constexpr (with_options) key_row = p.sequences.key_row(rows, key0);
    const int index[4] = {rows.map_batch, t.head / p.group, key_row, 0};
    tma::load(part == key_part ? s.k : s.v, part == key_part ? p.k : p.v, full, index);
  }

  // ------------------------------------------------------------------------------ consumers

  // The consumers issue their wgmmas in turn (sync/turn_rotation.cuh). Every consumer takes the
  // same number of turns per task (iterations + 1: the task's key blocks are the same for all its
  // consumers), so the rotation stays aligned for any number of consumers.
  using issue_rotation = turn_rotation<barrier_id, plan::consumer_warpgroups>;
  __device__ static issue_rotation issue_turns(const context& ctx) { return {barrier_id::issue_turn, ctx.consumer}; }

  __device__ static int first_row(const context& ctx) {
    return ctx.task.block * plan::block_q + ctx.consumer * plan::rows_per_consumer;
  }

  // The iterations [first, end) whose key blocks every row of this consumer sees whole, which run
  // without mask code: before them come the blocks that cross a window's left edge, after them those
  // that cross the diagonal (a window's right edge) or the key tail.
  __device__ static key_window::block_range unmasked_iterations(const context& ctx) {
    const int blocks = ctx.iterations;
    if constexpr (with_options) {
      const key_window::block_range whole =
          window_of(ctx.params, ctx.task).whole_key_blocks(first_row(ctx), plan::rows_per_consumer, plan::block_kv);
      const int first_block = first_key_block(ctx.params, ctx.task);
      const int first = min(blocks, max(0, whole.first - first_block));
      return {first, max(first, min(blocks, whole.end - first_block))};
    } else {
      return {0, min(blocks, ctx.params.vis().unmasked_key_blocks(first_row(ctx), plan::block_kv))};
    }
  }

  // Whether a query sees a key, from per-row bounds: a prefix (key < key_limit(query): 2 integers per
  // thread, compared with each element's key after the S wait), with a window a range (4 integers).
  // The per-element rule (vis.visible) let ptxas evaluate its 64 predicates ahead of the S wgmma and
  // pack them into bit fields: ~300-470 instructions between taking the issue turn and issuing
  // (benchmarks/results/attention.md).
  __device__ static auto visible_keys(const params& p, const task& t) {
    if constexpr (with_options) {
      return [window = window_of(p, t)](int query, int key) {
        return key >= window.key_floor(query) && key < window.key_limit(query);
      };
    } else {
      return [vis = p.vis()](int query, int key) { return key < vis.key_limit(query); };
    }
  }

  // s = q.k (raw), then the online softmax: s becomes exp2(c s - max) against the lazily moved max
  // (c = scale * log2(e)), one FFMA per score. The row max of c s is c times the row max of the raw
  // scores (c > 0) or their row min (c < 0), rounded once: the same float as the max over the
  // rounded products c s (rounding is monotone), so the statistics and lse are those of the scaled
  // scores. Hidden keys get the raw score that c turns into -inf (-inf, or +inf for c < 0), which
  // the reduction skips and the FFMA maps to -inf (p = 0; the offset is finite). Returns whether
  // the output rows must be scaled by `rescale` (the same answer on every lane of the warp;
  // `rescale` is set only then).
  template <bool MASKED>
  __device__ static bool softmax(const context& ctx, consumer_state& state, scores& s, int j, row_vector& rescale) {
    const params& p = ctx.params;
    if constexpr (with_options) {
      if (p.softcapped) warp::map<capped_score>(s, s, p.tanh_scale);  // before the mask hides keys
    }
    if constexpr (MASKED) {
      const auto sees = visible_keys(p, ctx.task);
      const fragment::coord origin{first_row(ctx) + warpgroup::warp_row(),
                                   (first_key_block(p, ctx.task) + j) * plan::block_kv};
      const float hidden = p.negative ? INFINITY : NEG_INF;
      warp::mask(s, origin, sees, hidden);
    }
    row_vector max, offset;
    if (!p.negative) {
      warp::row_max(max, s);
    } else {
      warp::row_min(max, s);
    }
    warp::mul(max, max, p.scale_log2);
    warp::max(max, max, state.max);
    const bool rescaled = warp::any_of<moves_max>(state.max, max);
    warp::map<lazy_max>(max, state.max, max);
    warp::map<exponent_offset>(offset, max);
    if (rescaled) {
      warp::sub(rescale, state.max, offset);
      warp::exp2(rescale, rescale);
      warp::mul(state.sum, state.sum, rescale);
    }
    state.max = max;
    warp::map<scale_minus_offset>(s, s, p.scale_log2, broadcast<tile_axis::rows, row_vector>{offset});
    warp::exp2(s, s);
    warp::lane_row_sum(state.sum, s, state.sum);
    return rescaled;
  }

  // Key block j >= 1: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight together, then the softmax
  // of S_j; `at` is block j's ring position.
  template <bool MASKED>
  __device__ static void step(const context& ctx, consumer_state& state, const inputs& in, scores& s,
                              probabilities& prob, int j, pipeline::ring_position<plan::stages> at) {
    const q_tile& q = ctx.resident.q[ctx.consumer];
    const pipeline::ring_position<plan::stages> previous = at.previous();
    const kv_tile& k = in.wait(at, key_part).k;
    const kv_tile& v = in.wait(previous, value_part).v;
    const issue_rotation turns = issue_turns(ctx);
    turns.wait();
    warpgroup::fence();
    warpgroup::mma<operand_major::k, operand_major::k>(s, q, 0, k, 0, false);
    warpgroup::commit();
    warpgroup::mma<operand_major::mn>(state.o, prob, v, 0, true);
    warpgroup::commit();
    turns.pass();
    warpgroup::wait<1>(s);
    in.release(at, key_part);
    row_vector rescale;
    const bool rescaled = softmax<MASKED>(ctx, state, s, j, rescale);
    warpgroup::wait<0>(state.o, prob);
    in.release(previous, value_part);
    if (rescaled) warp::mul_row(state.o, state.o, rescale);
    warp::copy(prob, s);
  }

  __device__ static void compute(const context& ctx, consumer_state& state, inputs& in) {
    warp::zero(state.o);
    warp::neg_infty(state.max);
    warp::zero(state.sum);
    const int blocks = ctx.iterations;
    if (blocks == 0) return;
    const q_tile& q = ctx.resident.q[ctx.consumer];
    const key_window::block_range unmasked = unmasked_iterations(ctx);
    scores s;
    probabilities prob;
    row_vector unused_rescale;  // the output is still zero

    // S_0 = Q K_0^T
    auto at = in.first();
    const issue_rotation turns = issue_turns(ctx);
    turns.grant_first();
    const kv_tile& k = in.wait(at, key_part).k;
    turns.wait();
    warpgroup::fence();
    warpgroup::mma<operand_major::k, operand_major::k>(s, q, 0, k, 0, false);
    warpgroup::commit();
    turns.pass();
    warpgroup::wait<0>(s);
    in.release(at, key_part);
    if (unmasked.first == 0 && unmasked.end > 0) {
      softmax<false>(ctx, state, s, 0, unused_rescale);
    } else {
      softmax<true>(ctx, state, s, 0, unused_rescale);
    }
    warp::copy(prob, s);

    int j = 1;
    at.advance();
    for (; j < unmasked.first; ++j, at.advance()) step<true>(ctx, state, in, s, prob, j, at);
    for (; j < unmasked.end; ++j, at.advance()) step<false>(ctx, state, in, s, prob, j, at);
    for (; j < blocks; ++j, at.advance()) step<true>(ctx, state, in, s, prob, j, at);

    // O += P_{n-1} V_{n-1}
    const pipeline::ring_position<plan::stages> last = at.previous();
    const kv_tile& v = in.wait(last, value_part).v;
    if constexpr (with_options) {
      if (ctx.params.sequences.packed()) zero_values_past_the_keys(ctx, in.stages[last.stage].v, blocks - 1);
    }
    turns.wait();
    warpgroup::fence();
    warpgroup::mma<operand_major::mn>(state.o, prob, v, 0, true);
    warpgroup::commit();
    turns.pass(/*last_turn=*/true);
    warpgroup::wait<0>(state.o, prob);
    in.release(last, value_part);
  }

  // A packed sequence's last key block may hold rows past its keys: the next sequence's, or a KV cache's
  // slots past its length, which may hold anything (NaN included). Their probabilities are 0, but
  // 0 * NaN is NaN in P V, so their values are zeroed first (a dense batch's rows past Nk are TMA's
  // zero fill). Consumer 0 writes the zeros; every consumer waits for them before its P V (all reach
  // here after their last step's issue turn, so the rotation cannot hold one of them back).
  __device__ static void zero_values_past_the_keys(const context& ctx, kv_tile& v, int j) {
    const int key0 = (first_key_block(ctx.params, ctx.task) + j) * plan::block_kv;
    const int first_row = max(0, ctx.task.rows.k_rows - key0);
    if (first_row >= plan::block_kv) return;  // the same answer on every consumer
    if (ctx.consumer == 0) {
      constexpr int chunks_per_row = kv_tile::swizzle_bytes / int(sizeof(uint4));
      constexpr int chunks_per_panel = plan::block_kv * chunks_per_row;
      const int zeroed = (plan::block_kv - first_row) * chunks_per_row;
      for (int i = threadIdx.x % WARPGROUP_THREADS; i < zeroed * kv_tile::panels; i += WARPGROUP_THREADS) {
        const int panel = i / zeroed, chunk = first_row * chunks_per_row + i % zeroed;
        reinterpret_cast<uint4*>(v.panel(panel))[chunk] = uint4{0, 0, 0, 0};
      }
      static_assert(chunks_per_panel * int(sizeof(uint4)) == kv_tile::panel_bytes);
    }
    // the zeros must be visible to wgmma (the async proxy) on every consumer
    publish(barrier_id::tail_values_zeroed, plan::consumer_warpgroups * WARPGROUP_THREADS);
  }

  // A sink joins the row as one more key whose value is 0: O and the sum are rescaled to
  // M = max(max, sink) as the mainloop rescales to a new max, and exp2(sink - M) joins the sum.
  // Neither exponential exceeds 1 (a sink far above the scores cannot overflow); a row that saw no
  // key (max = -inf) gets O = 0, sum = 1 and lse = sink; a sink of -inf changes nothing.
  __device__ static void join_sink(float sink_log2, consumer_state& state, row_vector& sum) {
    row_vector joined, offset, rescale, sink_weight;
    warp::max(joined, state.max, sink_log2);
    warp::map<exponent_offset>(offset, joined);
    warp::sub(rescale, state.max, offset);
    warp::exp2(rescale, rescale);
    warp::sub(sink_weight, sink_log2, offset);
    warp::exp2(sink_weight, sink_weight);
    warp::mul(sum, sum, rescale);
    warp::add(sum, sum, sink_weight);
    warp::mul_row(state.o, state.o, rescale);
    state.max = joined;
  }

  // lse per row; O /= rowsum, staged in this consumer's Q tile (its wgmmas are done), one TMA store.
  __device__ static void store(const context& ctx, consumer_state& state) {
    const params& p = ctx.params;
    row_vector sum = state.sum, inverse, lse;
    warp::all_lanes_row_sum(sum);
    if constexpr (with_options) {
      if (p.sinks != nullptr) join_sink(p.sinks[ctx.task.head] * LOG2_E, state, sum);
    }
    warp::map<reciprocal_or_zero>(inverse, sum);
    warp::map<natural_lse>(lse, state.max, sum);
    warp::mul_row(state.o, state.o, inverse);

    // lse is (B, Hq, Nq), or (Hq, total) packed: both (map batch, head, row) of the maps' rows.
    const sequence_rows rows = rows_of(p, ctx.task);
    const int row0 = first_row(ctx);
    const int warp_row0 = row0 + warpgroup::warp_row();
    warp::store(p.lse + (int64_t(rows.map_batch) * p.q_heads + ctx.task.head) * p.q_rows + rows.q_start + warp_row0,
                lse, rows.q_rows - warp_row0);
    if constexpr (with_options) {
      if (p.packed_out != nullptr) {
        store_packed_rows<T>(p.packed_out, p.q_heads, ctx.task.head, rows.q_start, rows.q_rows, row0, state.o);
        return;
      }
    }
    const int index[4] = {rows.map_batch, ctx.task.head, row0, 0};
    store_outputs(barrier_after(barrier_id::consumer_epilogue, ctx.consumer), index,
                  staged(p.out, ctx.resident.q[ctx.consumer], state.o));
  }
};

// The options' rules: what the public function checks, re-checked (a kernel must not misread them), and
// the lengths key_window's int bounds take.
std::string options_reason(const forward_problem& pr) {
  if (!pr.has_options()) return {};
  if (pr.window_left < -1 || pr.window_right < -1) return "window edges must be >= -1 (-1 = unbounded)";
  if (!(std::isfinite(pr.softcap) && pr.softcap >= 0.0 && pr.softcap * LOG2_E <= FLT_MAX)) {
    return "softcap must be 0 (off) or a finite number > 0 below FLT_MAX / log2(e)";
  }
  if (pr.q.rows + pr.k.rows > MAX_WINDOWED_ROWS) return "with a window, softcap or sinks, Nq + Nk must be at most 2^30";
  return packed_reason(pr.packed, pr.q.heads, std::min(forward_plan<64>::block_q, forward_plan<128>::block_q));
}

// Layout rules (shape rules: shape_reason, checked before); the same for both variants.
template <typename T, int D>
std::string reason_for(const forward_problem& pr) {
  using K = forward_kernel<T, D, forward_features::plain>;
  const heads_view out = output_view(pr.out, pr.q, pr.packed.given());
  for (const auto& [name, view] : {std::pair{"q", pr.q}, std::pair{"out", out}}) {
    if (std::string r = layout_reason<typename K::q_tile, T>(name, view); !r.empty()) return r;
  }
  for (const auto& [name, view] : {std::pair{"k", pr.k}, std::pair{"v", pr.v}}) {
    if (std::string r = layout_reason<typename K::kv_tile, T>(name, view); !r.empty()) return r;
  }
  return {};
}

template <typename T, int D, forward_features FEATURES>
cudaError_t run(const forward_problem& pr, cudaStream_t stream) {
  using K = forward_kernel<T, D, FEATURES>;
  typename K::params p;
  p.q = make_tma_map<typename K::q_tile>(heads_layout<T>(pr.q));
  p.k = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.k));
  p.v = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.v));
  p.out = make_tma_map<typename K::q_tile>(heads_layout<T>(output_view(pr.out, pr.q, pr.packed.given())));
  p.lse = pr.lse;
  p.q_rows = int(pr.q.rows);
  p.k_rows = int(pr.k.rows);
  p.q_heads = int(pr.q.heads);
  p.batch = int(pr.packed.given() ? pr.packed.count : pr.q.batch);  // the sequences
  p.group = int(pr.q.heads / pr.k.heads);
  float c = pr.scale * LOG2_E;
  if constexpr (K::with_options) {
    p.sequences = sequence_layout_of(pr.packed, pr.q.rows, pr.k.rows);
    // Edges past every key and query reach as far as unbounded ones (key_window::of clamps them).
    p.window_left = int(std::min(pr.window_left, MAX_WINDOWED_ROWS));
    p.window_right = int(std::min(pr.window_right, MAX_WINDOWED_ROWS));
    p.packed_out = pr.packed.given() ? pr.out : nullptr;
    p.softcapped = pr.softcap > 0.0;
    p.sinks = pr.sinks;
    if (p.softcapped) {
      // |scale / softcap| beyond FLT_MAX saturates tanh just the same (scores of 0 stay 0, not NaN).
      p.tanh_scale = float(std::clamp(double(pr.scale) / pr.softcap, double(-FLT_MAX), double(FLT_MAX)));
      c = float(pr.softcap * LOG2_E);
    }
  }
  // A |c| below the smallest normal float (0 included) would be flushed to 0 by the FTZ arithmetic,
  // and 0 * -inf is NaN in a hidden key's FFMA. FLT_MIN gives the same probabilities: for any score
  // |q.k| < 2^100 (a softcapped |t| <= 1), c s and the offset are below 2^-26 each, where exp2 is 1
  // to fp32 rounding (uniform weights), and lse = ln(number of visible keys) to rounding.
  p.scale_log2 = std::fabs(c) < FLT_MIN ? FLT_MIN : c;
  p.negative = p.scale_log2 < 0.0f;
  p.causal = pr.causal;
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

}  // namespace

std::string unsupported_reason(const forward_problem& p) {
  if (std::string r = shape_reason<forward_head_dims>(p.q, p.k, p.v); !r.empty()) return r;
  if (std::string r = options_reason(p); !r.empty()) return r;
  return dispatch(p, [&]<typename T, int D>() { return reason_for<T, D>(p); });
}

cudaError_t launch(const forward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T, int D>() {
    return p.has_options() ? run<T, D, forward_features::options>(p, stream) : run<T, D, forward_features::plain>(p, stream);
  });
}

}  // namespace tk::attention
