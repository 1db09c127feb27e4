// Attention backward: dq, dk, dv from dO (and dlse), recomputing P from q, k and the forward's lse.
//
//   dS = P * (dP - delta),  dP = dO v^T,  delta = rowsum(dO * O) - dlse
//   dq = scale * dS k,  dk = scale * dS^T q,  dv = P^T dO
//
// Three launches on one stream, none with atomics, so results are bitwise reproducible:
//   statistics_kernel   per query row: lse2 = lse * log2(e) (+inf for rows that saw no key, so
//                       their P is exactly 0) and delta; rows padded to STATISTICS_ROW_MULTIPLE
//   dkdv_kernel         a block owns 128 keys of one K/V head (64 per consumer warpgroup) and
//                       streams 64-row Q / dO tiles of every query head of the group:
//                         S^T = K Q^T, dP^T = V dO^T (SS);  P^T = exp2(S^T - lse2);  dV += P^T dO (RS)
//                         dS^T = P^T (dP^T - delta);  dK += dS^T Q (RS)
//   dq_kernel           a block owns 128 query rows and streams K/V blocks:
//                         S = Q K^T, dP = dO V^T (SS);  dS = P (dP - delta);  dQ += dS K (RS)
// The dq pass recomputes S and dP instead of adding fp32 partial dq across key blocks with atomics:
// that ordering is not deterministic, and CUDA-graph replays must reproduce eager results bitwise.
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
  __device__ int64_t statistics_offset(int batch, int q_head) const {
    return (int64_t(batch) * q_heads + q_head) * statistics_rows;
  }
};

// ------------------------------------------------------------------------------ statistics

constexpr int STATISTICS_LANES_PER_ROW = 8;
constexpr int STATISTICS_THREADS = 256;

template <typename T>
struct statistics_params {
  const T* out;
  const T* grad_out;
  int64_t out_strides[3];  // batch, head, row (elements)
  int64_t grad_out_strides[3];
  const float* lse;
  const float* grad_lse;  // or nullptr
  float* lse2;            // (B * Hq, statistics_rows)
  float* delta;
  int q_rows, q_heads, dim, statistics_rows;
  int64_t total_rows;  // B * Hq * statistics_rows
};

template <typename T>
__global__ void __launch_bounds__(STATISTICS_THREADS) statistics_kernel(const statistics_params<T> p) {
  const statistics_row r = statistics_row_dot<STATISTICS_LANES_PER_ROW, STATISTICS_THREADS>(
      p.out, p.out_strides, p.grad_out, p.grad_out_strides, p.q_heads, p.q_rows, p.statistics_rows, p.total_rows, p.dim);
  if (r.lane_in_row != 0 || r.row >= p.total_rows) return;
  if (r.real) {
    const int64_t source = r.head_row * p.q_rows + r.i;
    const float lse = p.lse[source];
    p.lse2[r.row] = lse == NEG_INF ? INFINITY : lse * LOG2_E;
    p.delta[r.row] = r.dot - (p.grad_lse != nullptr ? p.grad_lse[source] : 0.0f);
  } else {
    p.lse2[r.row] = INFINITY;  // padding rows: P = exp2(s - inf) = 0, so they add nothing
    p.delta[r.row] = 0.0f;
  }
}

// ------------------------------------------------------------------------------------ dK, dV

template <typename T, int D>
struct dkdv_kernel : dkdv_plan<D> {
  using plan = dkdv_plan<D>;
  using kv_tile = shared_tile<T, plan::rows_per_consumer, D>;  // one consumer's keys, later its dK / dV
  using q_tile = shared_tile<T, plan::block_q, D>;
  using scores = warpgroup::accumulator<plan::block_q>;  // S^T and dP^T: a warp's 16 keys x block_q queries
  using operand = register_tile<T, BASE_TILE, plan::block_q>;
  using gradient = warpgroup::accumulator<D>;
  using query_vector = per_col_vector<scores>;

  struct resident {
    kv_tile k[plan::consumer_warpgroups];
    kv_tile v[plan::consumer_warpgroups];
  };
  static constexpr uint32_t resident_bytes = 2 * plan::consumer_warpgroups * kv_tile::bytes;

  struct stage {
    q_tile q, grad_out;
  };
  static constexpr uint32_t stage_bytes[] = {2 * q_tile::bytes};

  struct params {
    CUtensorMap q, k, v, grad_out, grad_k, grad_v;
    const float* lse2;
    const float* delta;
    gradient_shape shape;
  };
  using context = pipeline::task_context<dkdv_kernel>;

  struct consumer_state {
    gradient grad_k, grad_v;
  };

  enum class barrier_id : int {
    consumer_epilogue = FIRST_NAMED_BARRIER,
    count = consumer_epilogue + plan::consumer_warpgroups,
  };
  static_assert(fits_named_barriers<barrier_id>());

  // Query tiles: every tile of each of the group's query heads, from the first the keys can see.
  struct schedule {
    int first_tile, tiles_per_head;
    __device__ int steps(int group) const { return group * tiles_per_head; }
    __device__ int head_in_group(int step) const { return step / tiles_per_head; }
    __device__ int tile(int step) const { return first_tile + step % tiles_per_head; }
  };

  __device__ static schedule schedule_for(const gradient_shape& g, pipeline::head_block task) {
    const int first = g.vis().first_query_tile(task.block * plan::block_kv, plan::block_q);
    return {first, max(0, ceil_div(g.q_rows, plan::block_q) - first)};
  }

  __host__ __device__ static pipeline::head_block_order tasks(const params& p) {
    return {ceil_div(p.shape.k_rows, plan::block_kv), p.shape.q_heads / p.shape.group, p.shape.batch, false};
  }

  __device__ static int iterations(const params& p, pipeline::head_block task) {
    return schedule_for(p.shape, task).steps(p.shape.group);
  }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.q);
    tma::prefetch_descriptor(p.grad_out);
  }

  __device__ static void load_resident(const params& p, pipeline::head_block task, resident& r, mbarrier& full) {
    load_consumer_rows(r.k, p.k, full, task, task.block * plan::block_kv);
    load_consumer_rows(r.v, p.v, full, task, task.block * plan::block_kv);
  }

  __device__ static int q_head(const params& p, pipeline::head_block task, const schedule& sched, int step) {
    return task.head * p.shape.group + sched.head_in_group(step);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int step, int, stage& s, mbarrier& full) {
    const schedule sched = schedule_for(p.shape, task);
    const int index[4] = {task.batch, q_head(p, task, sched, step), sched.tile(step) * plan::block_q, 0};
    tma::load(s.q, p.q, full, index);
    tma::load(s.grad_out, p.grad_out, full, index);
  }

  __device__ static void compute(const context& ctx, consumer_state& state, pipeline::stage_inputs<dkdv_kernel>& in) {
    const params& p = ctx.params;
    const gradient_shape& g = p.shape;
    const visibility vis = g.vis();
    const kv_tile& k = ctx.resident.k[ctx.consumer];
    const kv_tile& v = ctx.resident.v[ctx.consumer];
    const int key0 = ctx.task.block * plan::block_kv + ctx.consumer * plan::rows_per_consumer;
    warp::zero(state.grad_k);
    warp::zero(state.grad_v);
    scores s, grad_p;  // S^T and dP^T: rows are keys, columns queries
    operand prob, grad_s;

    const schedule sched = schedule_for(g, ctx.task);
    auto at = in.first();
    for (int step = 0; step < ctx.iterations; ++step, at.advance()) {
      const int q0 = sched.tile(step) * plan::block_q;
      // The statistics of this lane's query columns, fetched from global memory (L2) while the
      // tiles land and the products run.
      const int64_t statistics_offset = g.statistics_offset(ctx.task.batch, q_head(p, ctx.task, sched, step)) + q0;
      query_vector lse2, delta;
      warp::load(lse2, p.lse2 + statistics_offset);
      warp::load(delta, p.delta + statistics_offset);
      const stage& st = in.wait(at);
      // S^T = K Q^T and dP^T = V dO^T
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(s, k, 0, st.q, 0, false);
      warpgroup::mma<operand_major::k, operand_major::k>(grad_p, v, 0, st.grad_out, 0, false);
      warpgroup::commit();
      warpgroup::wait<0>(s, grad_p);

      // P^T = exp2(s2 - lse2[query]), 0 where the key is hidden from the query.
      warp::mul(s, s, g.scale_log2);
      warp::sub_col(s, s, lse2);
      warp::exp2(s, s);
      if (vis.needs_mask(q0, key0, plan::rows_per_consumer)) {
        warp::mask(s, {key0 + warpgroup::warp_row(), q0}, [&](int key, int query) { return vis.visible(query, key); },
                   0.0f);
      }
      warp::copy(prob, s);
      // dV += P^T dO runs while dS^T is formed.
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(state.grad_v, prob, st.grad_out, 0, true);
      warpgroup::commit();
      // dS^T = P^T (dP^T - delta[query])
      warp::sub_col(grad_p, grad_p, delta);
      warp::mul(grad_p, grad_p, s);
      warp::copy(grad_s, grad_p);
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(state.grad_k, grad_s, st.q, 0, true);
      warpgroup::commit();
      warpgroup::wait<0>(state.grad_k, state.grad_v, prob, grad_s);
      in.release(at);
    }
  }

  // dK and dV, staged in this consumer's K and V tiles.
  __device__ static void store(const context& ctx, consumer_state& state) {
    const params& p = ctx.params;
    warp::mul(state.grad_k, state.grad_k, p.shape.scale);
    const int index[4] = {ctx.task.batch, ctx.task.head,
                          ctx.task.block * plan::block_kv + ctx.consumer * plan::rows_per_consumer, 0};
    store_outputs(barrier_after(barrier_id::consumer_epilogue, ctx.consumer), index,
                  staged(p.grad_k, ctx.resident.k[ctx.consumer], state.grad_k),
                  staged(p.grad_v, ctx.resident.v[ctx.consumer], state.grad_v));
  }
};

// ----------------------------------------------------------------------------------------- dQ

template <typename T, int D>
struct dq_kernel : dq_plan<D> {
  using plan = dq_plan<D>;
  using q_tile = shared_tile<T, plan::rows_per_consumer, D>;  // one consumer's rows of Q / dO, later its dQ
  using kv_tile = shared_tile<T, plan::block_kv, D>;
  using scores = warpgroup::accumulator<plan::block_kv>;  // S and dP: a warp's 16 queries x 128 keys
  using operand = register_tile<T, BASE_TILE, plan::block_kv>;
  using gradient = warpgroup::accumulator<D>;
  using row_vector = per_row_vector<scores>;

  struct resident {
    q_tile q[plan::consumer_warpgroups];
    q_tile grad_out[plan::consumer_warpgroups];
  };
  static constexpr uint32_t resident_bytes = 2 * plan::consumer_warpgroups * q_tile::bytes;

  struct stage {
    kv_tile k, v;
  };
  static constexpr uint32_t stage_bytes[] = {2 * kv_tile::bytes};

  struct params {
    CUtensorMap q, k, v, grad_out, grad_q;
    const float* lse2;
    const float* delta;
    gradient_shape shape;
  };
  using context = pipeline::task_context<dq_kernel>;

  struct consumer_state {
    gradient grad_q;
  };

  enum class barrier_id : int {
    consumer_epilogue = FIRST_NAMED_BARRIER,
    count = consumer_epilogue + plan::consumer_warpgroups,
  };
  static_assert(fits_named_barriers<barrier_id>());

  __host__ __device__ static pipeline::head_block_order tasks(const params& p) {
    return {ceil_div(p.shape.q_rows, plan::block_q), p.shape.q_heads, p.shape.batch, p.shape.causal};
  }

  __device__ static int iterations(const params& p, pipeline::head_block task) {
    return p.shape.vis().key_blocks(task.block * plan::block_q, plan::block_q, plan::block_kv);
  }

  __device__ static void prefetch(const params& p) {
    tma::prefetch_descriptor(p.k);
    tma::prefetch_descriptor(p.v);
  }

  __device__ static void load_resident(const params& p, pipeline::head_block task, resident& r, mbarrier& full) {
    load_consumer_rows(r.q, p.q, full, task, task.block * plan::block_q);
    load_consumer_rows(r.grad_out, p.grad_out, full, task, task.block * plan::block_q);
  }

  __device__ static void load(const params& p, pipeline::head_block task, int j, int, stage& s, mbarrier& full) {
    const int index[4] = {task.batch, task.head / p.shape.group, j * plan::block_kv, 0};
    tma::load(s.k, p.k, full, index);
    tma::load(s.v, p.v, full, index);
  }

  __device__ static int first_row(const context& ctx) {
    return ctx.task.block * plan::block_q + ctx.consumer * plan::rows_per_consumer;
  }

  __device__ static void compute(const context& ctx, consumer_state& state, pipeline::stage_inputs<dq_kernel>& in) {
    const params& p = ctx.params;
    const gradient_shape& g = p.shape;
    const visibility vis = g.vis();
    const q_tile& q = ctx.resident.q[ctx.consumer];
    const q_tile& grad_out = ctx.resident.grad_out[ctx.consumer];
    const int row0 = first_row(ctx);
    const int64_t statistics_offset = g.statistics_offset(ctx.task.batch, ctx.task.head) + row0 + warpgroup::warp_row();
    row_vector lse2, delta;
    warp::load(lse2, p.lse2 + statistics_offset);
    warp::load(delta, p.delta + statistics_offset);
    warp::zero(state.grad_q);
    scores s, grad_p;
    operand grad_s;

    auto at = in.first();
    for (int j = 0; j < ctx.iterations; ++j, at.advance()) {
      const int key0 = j * plan::block_kv;
      const stage& st = in.wait(at);
      // S = Q K^T and dP = dO V^T
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(s, q, 0, st.k, 0, false);
      warpgroup::mma<operand_major::k, operand_major::k>(grad_p, grad_out, 0, st.v, 0, false);
      warpgroup::commit();
      warpgroup::wait<0>(s, grad_p);

      // dS = P (dP - delta) with P = exp2(s2 - lse2), 0 where hidden (keys >= Nk included: their
      // zero-filled K would give P = exp2(-lse2), which may overflow).
      warp::mul(s, s, g.scale_log2);
      warp::sub_row(s, s, lse2);
      warp::exp2(s, s);
      if (vis.needs_mask(row0, key0, plan::block_kv)) {
        warp::mask(s, {row0 + warpgroup::warp_row(), key0}, [&](int query, int key) { return vis.visible(query, key); },
                   0.0f);
      }
      warp::sub_row(grad_p, grad_p, delta);
      warp::mul(grad_p, grad_p, s);
      warp::copy(grad_s, grad_p);
      // dQ += dS K
      warpgroup::fence();
      warpgroup::mma<operand_major::mn>(state.grad_q, grad_s, st.k, 0, true);
      warpgroup::commit();
      warpgroup::wait<0>(state.grad_q, grad_s);
      in.release(at);
    }
  }

  __device__ static void store(const context& ctx, consumer_state& state) {
    const params& p = ctx.params;
    warp::mul(state.grad_q, state.grad_q, p.shape.scale);
    const int index[4] = {ctx.task.batch, ctx.task.head, first_row(ctx), 0};
    store_outputs(barrier_after(barrier_id::consumer_epilogue, ctx.consumer), index,
                  staged(p.grad_q, ctx.resident.q[ctx.consumer], state.grad_q));
  }
};

// ------------------------------------------------------------------------------------ host

struct workspace_view {
  float* lse2;
  float* delta;
};

workspace_view split_workspace(const backward_problem& pr) {
  const int64_t floats = pr.q.batch * pr.q.heads * padded_statistics_rows(pr.q.rows);
  return {pr.workspace, pr.workspace + floats};
}

heads_view output_view(void* data, const heads_view& like) {
  return contiguous_view(data, like.batch, like.heads, like.rows, like.dim);
}

template <typename T, int D>
std::string reason_for(const backward_problem& pr) {
  using KV = dkdv_kernel<T, D>;
  using Q = dq_kernel<T, D>;
  if (pr.out.batch != pr.q.batch || pr.out.heads != pr.q.heads || pr.out.rows != pr.q.rows || pr.out.dim != pr.q.dim ||
      pr.grad_out.batch != pr.q.batch || pr.grad_out.heads != pr.q.heads || pr.grad_out.rows != pr.q.rows ||
      pr.grad_out.dim != pr.q.dim) {
    return "out and grad_out must have q's shape";
  }
  const std::pair<const char*, heads_view> query_like[] = {
      {"q", pr.q}, {"out", pr.out}, {"grad_out", pr.grad_out}, {"grad_q", output_view(pr.grad_q, pr.q)}};
  for (const auto& [name, view] : query_like) {
    if (std::string r = layout_reason<typename KV::q_tile, T>(name, view); !r.empty()) return r;
    if (std::string r = layout_reason<typename Q::q_tile, T>(name, view); !r.empty()) return r;
  }
  const std::pair<const char*, heads_view> key_like[] = {
      {"k", pr.k}, {"v", pr.v}, {"grad_k", output_view(pr.grad_k, pr.k)}, {"grad_v", output_view(pr.grad_v, pr.v)}};
  for (const auto& [name, view] : key_like) {
    if (std::string r = layout_reason<typename KV::kv_tile, T>(name, view); !r.empty()) return r;
    if (std::string r = layout_reason<typename Q::kv_tile, T>(name, view); !r.empty()) return r;
  }
  return {};
}

gradient_shape shape_of(const backward_problem& pr) {
  return {int(pr.q.rows),
          int(pr.k.rows),
          int(pr.q.heads),
          int(pr.q.batch),
          int(pr.q.heads / pr.k.heads),
          int(padded_statistics_rows(pr.q.rows)),
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
  p.q_rows = int(pr.q.rows);
  p.q_heads = int(pr.q.heads);
  p.dim = int(pr.q.dim);
  p.statistics_rows = int(padded_statistics_rows(pr.q.rows));
  p.total_rows = pr.q.batch * pr.q.heads * p.statistics_rows;
  constexpr int64_t rows_per_block = STATISTICS_THREADS / STATISTICS_LANES_PER_ROW;
  const unsigned blocks = unsigned(ceil_div(p.total_rows, rows_per_block));
  return pipeline::launch(statistics_kernel<T>, blocks, STATISTICS_THREADS, 0, stream, p);
}

template <typename T, int D>
cudaError_t run_dkdv(const backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  using K = dkdv_kernel<T, D>;
  typename K::params p;
  p.q = make_tma_map<typename K::q_tile>(heads_layout<T>(pr.q));
  p.grad_out = make_tma_map<typename K::q_tile>(heads_layout<T>(pr.grad_out));
  p.k = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.k));
  p.v = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.v));
  p.grad_k = make_tma_map<typename K::kv_tile>(heads_layout<T>(output_view(pr.grad_k, pr.k)));
  p.grad_v = make_tma_map<typename K::kv_tile>(heads_layout<T>(output_view(pr.grad_v, pr.v)));
  p.lse2 = w.lse2;
  p.delta = w.delta;
  p.shape = shape_of(pr);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

template <typename T, int D>
cudaError_t run_dq(const backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  using K = dq_kernel<T, D>;
  typename K::params p;
  p.q = make_tma_map<typename K::q_tile>(heads_layout<T>(pr.q));
  p.grad_out = make_tma_map<typename K::q_tile>(heads_layout<T>(pr.grad_out));
  p.grad_q = make_tma_map<typename K::q_tile>(heads_layout<T>(output_view(pr.grad_q, pr.q)));
  p.k = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.k));
  p.v = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.v));
  p.lse2 = w.lse2;
  p.delta = w.delta;
  p.shape = shape_of(pr);
  return pipeline::launch<K>(p, K::tasks(p).count(), stream);
}

template <typename T, int D>
cudaError_t run(const backward_problem& pr, cudaStream_t stream) {
  const workspace_view w = split_workspace(pr);
  if (const cudaError_t err = run_statistics<T>(pr, w, stream); err != cudaSuccess) return err;
  if (const cudaError_t err = run_dkdv<T, D>(pr, w, stream); err != cudaSuccess) return err;
  return run_dq<T, D>(pr, w, stream);
}

}  // namespace

int64_t backward_workspace_floats(int64_t batch, int64_t q_heads, int64_t q_rows) {
  return 2 * batch * q_heads * padded_statistics_rows(q_rows);
}

std::string unsupported_reason(const backward_problem& p) {
  if (std::string r = shape_reason(p.q, p.k, p.v); !r.empty()) return r;
  return dispatch(p, [&]<typename T, int D>() { return reason_for<T, D>(p); });
}

cudaError_t launch(const backward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T, int D>() { return run<T, D>(p, stream); });
}

}  // namespace tk::attention
