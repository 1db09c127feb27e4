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

namespace tk::attention {
namespace {

// What both gradient kernels know about the problem.
struct gradient_shape {
  int q_rows, k_rows, q_heads, group;  // group = Hq / Hkv
  int statistics_rows;                 // padded row count of each head's statistics
  float scale;
  float scale_log2;
  bool causal;

  __device__ visibility vis() const { return {q_rows, k_rows, causal}; }
  __device__ int64_t statistics_offset(int batch, int q_head) const {
    return (int64_t(batch) * q_heads + q_head) * statistics_rows;
  }
};

// ------------------------------------------------------------------------------ statistics

constexpr int STATISTICS_LANES_PER_ROW = 8;
constexpr int STATISTICS_THREADS = 256;
constexpr int CHUNK_ELEMENTS = 8;  // one 16-byte load of 16-bit elements

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
__device__ __forceinline__ float chunk_dot(const T* a, const T* b) {
  const uint4 x = *reinterpret_cast<const uint4*>(a);
  const uint4 y = *reinterpret_cast<const uint4*>(b);
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w};
  const uint32_t ys[4] = {y.x, y.y, y.z, y.w};
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 u = to_float2(pair_from_bits<packed_pair_t<T>>(xs[i]));
    const float2 w = to_float2(pair_from_bits<packed_pair_t<T>>(ys[i]));
    dot = fmaf(u.x, w.x, fmaf(u.y, w.y, dot));
  }
  return dot;
}

template <typename T>
__global__ void __launch_bounds__(STATISTICS_THREADS) statistics_kernel(const statistics_params<T> p) {
  const int64_t row = int64_t(blockIdx.x) * (STATISTICS_THREADS / STATISTICS_LANES_PER_ROW) +
                      threadIdx.x / STATISTICS_LANES_PER_ROW;
  const int lane_in_row = threadIdx.x % STATISTICS_LANES_PER_ROW;
  const int64_t head_row = row / p.statistics_rows;  // batch * Hq + head
  const int i = int(row % p.statistics_rows);
  const bool real = row < p.total_rows && i < p.q_rows;
  float dot = 0.0f;
  if (real) {
    const int64_t batch = head_row / p.q_heads, head = head_row % p.q_heads;
    const T* o = p.out + batch * p.out_strides[0] + head * p.out_strides[1] + i * p.out_strides[2];
    const T* d = p.grad_out + batch * p.grad_out_strides[0] + head * p.grad_out_strides[1] + i * p.grad_out_strides[2];
    for (int c = lane_in_row * CHUNK_ELEMENTS; c < p.dim; c += STATISTICS_LANES_PER_ROW * CHUNK_ELEMENTS) {
      dot += chunk_dot(o + c, d + c);
    }
  }
#pragma unroll
  for (int mask = 1; mask < STATISTICS_LANES_PER_ROW; mask *= 2) dot += __shfl_xor_sync(0xffffffffu, dot, mask);
  if (lane_in_row != 0 || row >= p.total_rows) return;
  if (real) {
    const int64_t source = head_row * p.q_rows + i;
    const float lse = p.lse[source];
    p.lse2[row] = lse == NEG_INF ? INFINITY : lse * LOG2_E;
    p.delta[row] = dot - (p.grad_lse != nullptr ? p.grad_lse[source] : 0.0f);
  } else {
    p.lse2[row] = INFINITY;  // padding rows: P = exp2(s - inf) = 0, so they add nothing
    p.delta[row] = 0.0f;
  }
}

// ------------------------------------------------------------------------------------ dK, dV

template <typename T, int D>
struct dkdv_kernel {
  using plan = dkdv_plan<D>;
  using kv_tile = shared_tile<T, CONSUMER_ROWS, D>;  // one consumer's keys, later its dK / dV
  using q_tile = shared_tile<T, plan::block_q, D>;
  static constexpr int stages = plan::stages;
  static constexpr int threads = block_threads<1 + plan::consumer_warpgroups>;
  static_assert(fits_register_file<plan>());

  static constexpr uint32_t stage_bytes = 2 * q_tile::bytes;

  struct storage {
    kv_tile k[plan::consumer_warpgroups];
    kv_tile v[plan::consumer_warpgroups];
    q_tile q[stages];
    q_tile grad_out[stages];
    mbarrier kv_full;
    mbarrier full[stages], empty[stages];
  };

  struct params {
    CUtensorMap q, k, v, grad_out, grad_k, grad_v;
    const float* lse2;
    const float* delta;
    gradient_shape shape;
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

  __device__ static schedule schedule_for(const gradient_shape& g, int k0) {
    const int first = g.vis().first_query_tile(k0, plan::block_q);
    return {first, max(0, ceil_div(g.q_rows, plan::block_q) - first)};
  }

  __device__ static void produce(const params& p, storage& smem, int batch, int kv_head, int k0) {
    tma::prefetch_descriptor(p.q);
    tma::prefetch_descriptor(p.grad_out);
    smem.kv_full.arrive_expect_tx(2 * plan::consumer_warpgroups * kv_tile::bytes);
    for (int c = 0; c < plan::consumer_warpgroups; ++c) {
      const int index[4] = {batch, kv_head, k0 + c * CONSUMER_ROWS, 0};
      tma::load(smem.k[c], p.k, smem.kv_full, index);
      tma::load(smem.v[c], p.v, smem.kv_full, index);
    }
    const schedule sched = schedule_for(p.shape, k0);
    pipeline::ring_position<stages> write;
    for (int step = 0; step < sched.steps(p.shape.group); ++step, write.advance()) {
      const int q_head = kv_head * p.shape.group + sched.head_in_group(step);
      const int q0 = sched.tile(step) * plan::block_q;
      const int index[4] = {batch, q_head, q0, 0};
      smem.empty[write.stage].wait(write.phase ^ 1);
      mbarrier& full = smem.full[write.stage];
      full.arrive_expect_tx(stage_bytes);
      tma::load(smem.q[write.stage], p.q, full, index);
      tma::load(smem.grad_out[write.stage], p.grad_out, full, index);
    }
  }

  __device__ static void consume(const params& p, storage& smem, int consumer, int batch, int kv_head, int k0) {
    const gradient_shape& g = p.shape;
    const visibility vis = g.vis();
    const kv_tile& k = smem.k[consumer];
    const kv_tile& v = smem.v[consumer];
    const int key0 = k0 + consumer * CONSUMER_ROWS;
    accumulator<D> grad_k, grad_v;
    fill(grad_k, 0.0f);
    fill(grad_v, 0.0f);
    accumulator<plan::block_q> s, grad_p;  // S^T and dP^T: rows are keys, columns queries
    a_fragments<T, plan::block_q> p_frag, ds_frag;
    smem.kv_full.wait(0);

    const schedule sched = schedule_for(g, k0);
    pipeline::ring_position<stages> read;
    for (int step = 0; step < sched.steps(g.group); ++step, read.advance()) {
      const int q0 = sched.tile(step) * plan::block_q;
      const q_tile& q = smem.q[read.stage];
      const q_tile& grad_out = smem.grad_out[read.stage];
      // The statistics of this lane's query columns, fetched from global memory (L2) while the
      // tiles land and the products run: each 8-column block holds the pair first_col + {0, 1}.
      const int64_t statistics =
          g.statistics_offset(batch, kv_head * g.group + sched.head_in_group(step)) + q0 + accumulator<plan::block_q>::first_col();
      float2 lse2[plan::block_q / 8], delta[plan::block_q / 8];
#pragma unroll
      for (int b = 0; b < plan::block_q / 8; ++b) {
        lse2[b] = *reinterpret_cast<const float2*>(p.lse2 + statistics + 8 * b);
        delta[b] = *reinterpret_cast<const float2*>(p.delta + statistics + 8 * b);
      }
      smem.full[read.stage].wait(read.phase);
      // S^T = K Q^T and dP^T = V dO^T
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(s, k, 0, q, 0, false);
      warpgroup::mma<operand_major::k, operand_major::k>(grad_p, v, 0, grad_out, 0, false);
      warpgroup::commit();
      warpgroup::wait<0>(s);
      warpgroup::pin(grad_p);

      // P^T = exp2(s2 - lse2[query]), 0 where the key is hidden from the query.
      const bool masked = vis.needs_mask(q0, key0, CONSUMER_ROWS);
#pragma unroll
      for (int r = 0; r < accumulator<plan::block_q>::registers; ++r) {
        const float row_lse2 = r % 2 == 0 ? lse2[r / 4].x : lse2[r / 4].y;
        s.data[r] = fast_exp2(s.data[r] * g.scale_log2 - row_lse2);
        if (masked && !vis.visible(q0 + accumulator_col<plan::block_q>(r), key0 + accumulator_row<plan::block_q>(r))) {
          s.data[r] = 0.0f;
        }
      }
      p_frag.pack(s);
      // dV += P^T dO runs while dS^T is formed.
      warpgroup::fence();
      mma_rs(grad_v, p_frag, grad_out);
      warpgroup::commit();
#pragma unroll
      for (int r = 0; r < accumulator<plan::block_q>::registers; ++r) {
        const float row_delta = r % 2 == 0 ? delta[r / 4].x : delta[r / 4].y;
        grad_p.data[r] = s.data[r] * (grad_p.data[r] - row_delta);
      }
      ds_frag.pack(grad_p);
      warpgroup::fence();
      mma_rs(grad_k, ds_frag, q);
      warpgroup::commit();
      warpgroup::wait<0>(grad_k);
      warpgroup::pin(grad_v);
      p_frag.pin();
      ds_frag.pin();
      if (lane_id() == 0) smem.empty[read.stage].arrive();
    }
#pragma unroll
    for (int r = 0; r < accumulator<D>::registers; ++r) grad_k.data[r] *= g.scale;
    store(p, smem, consumer, grad_k, grad_v, batch, kv_head, key0);
  }

  // dK and dV through this consumer's K and V tiles (no wgmma reads them any more), TMA stores.
  __device__ static void store(const params& p, storage& smem, int consumer, const accumulator<D>& grad_k,
                               const accumulator<D>& grad_v, int batch, int kv_head, int key0) {
    warpgroup::store<0>(smem.k[consumer], grad_k);
    warpgroup::store<0>(smem.v[consumer], grad_v);
    fence_async_shared();
    barrier_sync(barrier_after(barrier_id::consumer_epilogue, consumer), WARPGROUP_THREADS);
    if (threadIdx.x % WARPGROUP_THREADS == 0) {
      const int index[4] = {batch, kv_head, key0, 0};
      tma::store(p.grad_k, smem.k[consumer], index);
      tma::store(p.grad_v, smem.v[consumer], index);
      tma::commit_stores();
      tma::wait_stores_read<0>();
    }
  }

  __device__ static void run(const params& p) {
    extern __shared__ uint8_t shared_raw[];
    storage& smem = aligned_storage<storage>(shared_raw);
    const int k0 = blockIdx.x * plan::block_kv;
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z;
    if (threadIdx.x == 0) {
      smem.kv_full.init(1);
      for (int s = 0; s < stages; ++s) {
        smem.full[s].init(1);
        smem.empty[s].init(plan::consumer_warpgroups * WARPGROUP_WARPS);
      }
      fence_barrier_init();
    }
    __syncthreads();
    if (warpgroup_id() == 0) {
      warpgroup::decrease_registers<plan::producer_registers>();
      if (warp_in_warpgroup() == 0 && lane_id() == 0) produce(p, smem, batch, kv_head, k0);
    } else {
      warpgroup::increase_registers<plan::consumer_registers>();
      consume(p, smem, warpgroup_id() - 1, batch, kv_head, k0);
    }
  }
};

// ----------------------------------------------------------------------------------------- dQ

template <typename T, int D>
struct dq_kernel {
  using plan = dq_plan<D>;
  using q_tile = shared_tile<T, CONSUMER_ROWS, D>;  // one consumer's rows of Q / dO, later its dQ
  using kv_tile = shared_tile<T, plan::block_kv, D>;
  static constexpr int stages = plan::stages;
  static constexpr int threads = block_threads<1 + plan::consumer_warpgroups>;
  static_assert(fits_register_file<plan>());

  struct storage {
    q_tile q[plan::consumer_warpgroups];
    q_tile grad_out[plan::consumer_warpgroups];
    kv_tile k[stages];
    kv_tile v[stages];
    mbarrier q_full;
    mbarrier full[stages], empty[stages];
  };

  struct params {
    CUtensorMap q, k, v, grad_out, grad_q;
    const float* lse2;
    const float* delta;
    gradient_shape shape;
  };

  enum class barrier_id : int {
    consumer_epilogue = FIRST_NAMED_BARRIER,
    count = consumer_epilogue + plan::consumer_warpgroups,
  };
  static_assert(fits_named_barriers<barrier_id>());

  __device__ static void produce(const params& p, storage& smem, int batch, int head, int q0, int key_blocks) {
    tma::prefetch_descriptor(p.k);
    tma::prefetch_descriptor(p.v);
    smem.q_full.arrive_expect_tx(2 * plan::consumer_warpgroups * q_tile::bytes);
    for (int c = 0; c < plan::consumer_warpgroups; ++c) {
      const int index[4] = {batch, head, q0 + c * CONSUMER_ROWS, 0};
      tma::load(smem.q[c], p.q, smem.q_full, index);
      tma::load(smem.grad_out[c], p.grad_out, smem.q_full, index);
    }
    const int kv_head = head / p.shape.group;
    pipeline::ring_position<stages> write;
    for (int j = 0; j < key_blocks; ++j, write.advance()) {
      const int index[4] = {batch, kv_head, j * plan::block_kv, 0};
      smem.empty[write.stage].wait(write.phase ^ 1);
      smem.full[write.stage].arrive_expect_tx(2 * kv_tile::bytes);
      tma::load(smem.k[write.stage], p.k, smem.full[write.stage], index);
      tma::load(smem.v[write.stage], p.v, smem.full[write.stage], index);
    }
  }

  __device__ static void consume(const params& p, storage& smem, int consumer, int batch, int head, int q0,
                                 int key_blocks) {
    const gradient_shape& g = p.shape;
    const visibility vis = g.vis();
    const q_tile& q = smem.q[consumer];
    const q_tile& grad_out = smem.grad_out[consumer];
    const int row0 = q0 + consumer * CONSUMER_ROWS;
    float lse2[2], delta[2];
    const int64_t statistics = g.statistics_offset(batch, head) + row0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = accumulator<D>::first_row() + 8 * h;
      lse2[h] = p.lse2[statistics + row];
      delta[h] = p.delta[statistics + row];
    }
    accumulator<D> grad_q;
    fill(grad_q, 0.0f);
    accumulator<plan::block_kv> s, grad_p;
    a_fragments<T, plan::block_kv> ds_frag;
    smem.q_full.wait(0);

    pipeline::ring_position<stages> read;
    for (int j = 0; j < key_blocks; ++j, read.advance()) {
      const int key0 = j * plan::block_kv;
      smem.full[read.stage].wait(read.phase);
      // S = Q K^T and dP = dO V^T
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(s, q, 0, smem.k[read.stage], 0, false);
      warpgroup::mma<operand_major::k, operand_major::k>(grad_p, grad_out, 0, smem.v[read.stage], 0, false);
      warpgroup::commit();
      warpgroup::wait<0>(s);
      warpgroup::pin(grad_p);

      // dS = P (dP - delta) with P = exp2(s2 - lse2), 0 where hidden (keys >= Nk included: their
      // zero-filled K would give P = exp2(-lse2), which may overflow).
      const bool masked = vis.needs_mask(row0, key0, plan::block_kv);
#pragma unroll
      for (int r = 0; r < accumulator<plan::block_kv>::registers; ++r) {
        float prob = fast_exp2(s.data[r] * g.scale_log2 - lse2[row_half(r)]);
        if (masked && !vis.visible(row0 + accumulator_row<plan::block_kv>(r), key0 + accumulator_col<plan::block_kv>(r))) {
          prob = 0.0f;
        }
        grad_p.data[r] = prob * (grad_p.data[r] - delta[row_half(r)]);
      }
      ds_frag.pack(grad_p);
      // dQ += dS K
      warpgroup::fence();
      mma_rs(grad_q, ds_frag, smem.k[read.stage]);
      warpgroup::commit();
      warpgroup::wait<0>(grad_q);
      ds_frag.pin();
      if (lane_id() == 0) smem.empty[read.stage].arrive();
    }
#pragma unroll
    for (int r = 0; r < accumulator<D>::registers; ++r) grad_q.data[r] *= g.scale;

    q_tile& staging = smem.q[consumer];
    warpgroup::store<0>(staging, grad_q);
    fence_async_shared();
    barrier_sync(barrier_after(barrier_id::consumer_epilogue, consumer), WARPGROUP_THREADS);
    if (threadIdx.x % WARPGROUP_THREADS == 0) {
      const int index[4] = {batch, head, row0, 0};
      tma::store(p.grad_q, staging, index);
      tma::commit_stores();
      tma::wait_stores_read<0>();
    }
  }

  __device__ static void run(const params& p) {
    extern __shared__ uint8_t shared_raw[];
    storage& smem = aligned_storage<storage>(shared_raw);
    const int q_block = p.shape.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int q0 = q_block * plan::block_q;
    const int key_blocks = p.shape.vis().key_blocks(q0, plan::block_q, plan::block_kv);
    if (threadIdx.x == 0) {
      smem.q_full.init(1);
      for (int s = 0; s < stages; ++s) {
        smem.full[s].init(1);
        smem.empty[s].init(plan::consumer_warpgroups * WARPGROUP_WARPS);
      }
      fence_barrier_init();
    }
    __syncthreads();
    if (warpgroup_id() == 0) {
      warpgroup::decrease_registers<plan::producer_registers>();
      if (warp_in_warpgroup() == 0 && lane_id() == 0) produce(p, smem, batch, head, q0, key_blocks);
    } else {
      warpgroup::increase_registers<plan::consumer_registers>();
      consume(p, smem, warpgroup_id() - 1, batch, head, q0, key_blocks);
    }
  }
};

template <typename K>
__global__ void __launch_bounds__(K::threads, 1) gradient_entry(const __grid_constant__ typename K::params p) {
  K::run(p);
}

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
  if (std::string r = shape_reason(pr.q, pr.k, pr.v); !r.empty()) return r;
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
  const heads_view* views[2] = {&pr.out, &pr.grad_out};
  int64_t* strides[2] = {p.out_strides, p.grad_out_strides};
  for (int t = 0; t < 2; ++t) {
    strides[t][0] = views[t]->batch_stride;
    strides[t][1] = views[t]->head_stride;
    strides[t][2] = views[t]->row_stride;
  }
  p.lse = pr.lse;
  p.grad_lse = pr.grad_lse;
  p.lse2 = w.lse2;
  p.delta = w.delta;
  p.q_rows = int(pr.q.rows);
  p.q_heads = int(pr.q.heads);
  p.dim = int(pr.q.dim);
  p.statistics_rows = int(padded_statistics_rows(pr.q.rows));
  p.total_rows = pr.q.batch * pr.q.heads * p.statistics_rows;
  constexpr int rows_per_block = STATISTICS_THREADS / STATISTICS_LANES_PER_ROW;
  const unsigned blocks = unsigned((p.total_rows + rows_per_block - 1) / rows_per_block);
  statistics_kernel<T><<<blocks, STATISTICS_THREADS, 0, stream>>>(p);
  return cudaGetLastError();
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
  const dim3 grid(ceil_div(p.shape.k_rows, K::plan::block_kv), unsigned(pr.k.heads), unsigned(pr.q.batch));
  return launch_kernel(gradient_entry<K>, shared_bytes<typename K::storage>, grid, K::threads, p, stream);
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
  const dim3 grid(ceil_div(p.shape.q_rows, K::plan::block_q), unsigned(pr.q.heads), unsigned(pr.q.batch));
  return launch_kernel(gradient_entry<K>, shared_bytes<typename K::storage>, grid, K::threads, p, stream);
}

template <typename T, int D>
cudaError_t run(const backward_problem& pr, cudaStream_t stream) {
  const workspace_view w = split_workspace(pr);
  if (const cudaError_t err = run_statistics<T>(pr, w, stream); err != cudaSuccess) return err;
  if (const cudaError_t err = run_dkdv<T, D>(pr, w, stream); err != cudaSuccess) return err;
  return run_dq<T, D>(pr, w, stream);
}

template <typename F>
auto dispatch(const backward_problem& pr, F&& f) {
  const bool half_precision = pr.dtype == element_type::fp16;
  if (pr.q.dim == 64) return half_precision ? f.template operator()<half, 64>() : f.template operator()<bf16, 64>();
  return half_precision ? f.template operator()<half, 128>() : f.template operator()<bf16, 128>();
}

}  // namespace

int64_t backward_workspace_floats(int64_t batch, int64_t q_heads, int64_t q_rows) {
  return 2 * batch * q_heads * padded_statistics_rows(q_rows);
}

std::string unsupported_reason(const backward_problem& p) {
  if (p.q.dim != 64 && p.q.dim != 128) return "the head dim must be 64 or 128";
  return dispatch(p, [&]<typename T, int D>() { return reason_for<T, D>(p); });
}

cudaError_t launch(const backward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T, int D>() { return run<T, D>(p, stream); });
}

}  // namespace tk::attention
