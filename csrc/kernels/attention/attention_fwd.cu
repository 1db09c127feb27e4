// Attention forward: out = softmax(scale * q k^T + mask) v and lse, one 128-row query block per block.
//
//   producer (warpgroup 0)      TMA: Q once, then K_j and V_j through a ring of stages
//   consumers (warpgroups 1, 2) 64 query rows each; per key block j, overlapping the softmax of
//                               block j with the tensor cores working on P_{j-1} V_{j-1}:
//                                 issue S_j = Q K_j^T;  issue O += P_{j-1} V_{j-1}
//                                 wait S_j;  masked online softmax of S_j (rescale factor per row)
//                                 wait O;  O *= rescale;  P_j = bf16/fp16(S_j)
//                               and the two consumers take turns issuing (ping-pong), so one
//                               warpgroup's softmax runs while the other's products run
//   epilogue (consumers)        O /= rowsum, stmatrix into the Q tile, TMA store (tail rows clipped);
//                               lse = ln(sum) + max in natural log
//
// Key blocks past the last one a causal block sees are never loaded; masks run only on blocks that
// cross the diagonal or the key tail (TMA zero-fills keys >= Nk, whose scores must become -inf).
#include <utility>

#include "attention.cuh"

namespace tk::attention {
namespace {

template <typename T, int D>
struct forward_kernel {
  using plan = forward_plan<D>;
  using q_tile = shared_tile<T, CONSUMER_ROWS, D>;  // one consumer's query rows, later its output
  using kv_tile = shared_tile<T, plan::block_kv, D>;
  static constexpr int stages = plan::stages;
  static constexpr int threads = block_threads<1 + plan::consumer_warpgroups>;
  static_assert(fits_register_file<plan>());

  struct storage {
    q_tile q[plan::consumer_warpgroups];
    kv_tile k[stages];
    kv_tile v[stages];
    mbarrier q_full;
    mbarrier k_full[stages], k_empty[stages];
    mbarrier v_full[stages], v_empty[stages];
  };

  struct params {
    CUtensorMap q, k, v, out;  // boxes of one panel of q_tile / kv_tile / q_tile
    float* lse;
    int q_rows, k_rows, q_heads, group;  // group = Hq / Hkv
    float scale_log2;
    bool causal;
  };

  enum class barrier_id : int {
    consumer_epilogue = FIRST_NAMED_BARRIER,  // one per consumer: its output tile is written
    issue_turn = consumer_epilogue + plan::consumer_warpgroups,  // one per consumer: its turn to issue
    count = issue_turn + plan::consumer_warpgroups,
  };
  static_assert(fits_named_barriers<barrier_id>());

  // The consumers issue their wgmmas in turn: consumer c waits for its turn, issues, and passes
  // the turn to the next. Consumer 0 holds the first turn; the last consumer does not pass its
  // final turn, so every barrier phase that is opened also completes.
  static constexpr int turn_threads = 2 * WARPGROUP_THREADS;
  __device__ static void take_first_turn(int consumer) {
    if (consumer == 0) barrier_arrive(barrier_id::issue_turn, turn_threads);
  }
  __device__ static void wait_turn(int consumer) {
    barrier_sync(barrier_after(barrier_id::issue_turn, consumer), turn_threads);
  }
  __device__ static void pass_turn(int consumer, bool last_turn = false) {
    if (last_turn && consumer == plan::consumer_warpgroups - 1) return;
    barrier_arrive(barrier_after(barrier_id::issue_turn, (consumer + 1) % plan::consumer_warpgroups), turn_threads);
  }

  // Per-row running statistics of one lane's two rows (see attention.cuh on accumulator rows).
  struct online_softmax {
    float max[2] = {NEG_INF, NEG_INF};  // of the scaled log2 scores seen so far
    float sum[2] = {0.0f, 0.0f};        // this lane's share of sum exp2(s - max); reduced at the end

    // s (scaled, masked scores) becomes exp2(s - max); rescale[h] is what the output rows scale by.
    __device__ void update(accumulator<plan::block_kv>& s, float (&rescale)[2]) {
      float block_max[2] = {max[0], max[1]};
#pragma unroll
      for (int k = 0; k < accumulator<plan::block_kv>::registers; ++k) {
        block_max[row_half(k)] = fmaxf(block_max[row_half(k)], s.data[k]);
      }
      float offset[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        block_max[h] = reduce_row_max(block_max[h]);
        // A row that has seen only hidden keys keeps max = -inf: exponentiate against 0 instead of NaN.
        offset[h] = block_max[h] == NEG_INF ? 0.0f : block_max[h];
        rescale[h] = fast_exp2(max[h] - offset[h]);
        max[h] = block_max[h];
        sum[h] *= rescale[h];
      }
#pragma unroll
      for (int k = 0; k < accumulator<plan::block_kv>::registers; ++k) {
        s.data[k] = fast_exp2(s.data[k] - offset[row_half(k)]);
        sum[row_half(k)] += s.data[k];
      }
    }
  };

  // s = scale * log2(e) * (q.k), and -inf for the keys the rows do not see.
  __device__ static void scale_and_mask(const params& p, accumulator<plan::block_kv>& s, int row0, int key0) {
    const visibility vis{p.q_rows, p.k_rows, p.causal};
#pragma unroll
    for (int k = 0; k < accumulator<plan::block_kv>::registers; ++k) s.data[k] *= p.scale_log2;
    if (vis.needs_mask(row0, key0, plan::block_kv)) {
#pragma unroll
      for (int k = 0; k < accumulator<plan::block_kv>::registers; ++k) {
        const int row = row0 + accumulator_row<plan::block_kv>(k);
        const int key = key0 + accumulator_col<plan::block_kv>(k);
        if (!vis.visible(row, key)) s.data[k] = NEG_INF;
      }
    }
  }

  __device__ static void produce(const params& p, storage& smem, int batch, int head, int q0, int key_blocks) {
    tma::prefetch_descriptor(p.q);
    tma::prefetch_descriptor(p.k);
    tma::prefetch_descriptor(p.v);
    tma::prefetch_descriptor(p.out);
    smem.q_full.arrive_expect_tx(plan::consumer_warpgroups * q_tile::bytes);
    for (int c = 0; c < plan::consumer_warpgroups; ++c) {
      const int index[4] = {batch, head, q0 + c * CONSUMER_ROWS, 0};
      tma::load(smem.q[c], p.q, smem.q_full, index);
    }
    const int kv_head = head / p.group;
    pipeline::ring_position<stages> write;
    for (int j = 0; j < key_blocks; ++j, write.advance()) {
      const int index[4] = {batch, kv_head, j * plan::block_kv, 0};
      // A fresh barrier counts the phase before its first as complete: the first lap never waits.
      smem.k_empty[write.stage].wait(write.phase ^ 1);
      smem.k_full[write.stage].arrive_expect_tx(kv_tile::bytes);
      tma::load(smem.k[write.stage], p.k, smem.k_full[write.stage], index);
      smem.v_empty[write.stage].wait(write.phase ^ 1);
      smem.v_full[write.stage].arrive_expect_tx(kv_tile::bytes);
      tma::load(smem.v[write.stage], p.v, smem.v_full[write.stage], index);
    }
  }

  __device__ static void release(mbarrier& empty) {
    if (lane_id() == 0) empty.arrive();
  }

  __device__ static void consume(const params& p, storage& smem, int consumer, int batch, int head, int q0,
                                 int key_blocks) {
    const q_tile& q = smem.q[consumer];
    const int row0 = q0 + consumer * CONSUMER_ROWS;
    accumulator<D> o;
    fill(o, 0.0f);
    online_softmax softmax;
    accumulator<plan::block_kv> s;
    a_fragments<T, plan::block_kv> p_frag;
    float rescale[2];
    smem.q_full.wait(0);

    pipeline::ring_position<stages> read_k;
    pipeline::ring_position<stages> read_v;
    if (key_blocks > 0) {
      // S_0 = Q K_0^T
      take_first_turn(consumer);
      smem.k_full[read_k.stage].wait(read_k.phase);
      wait_turn(consumer);
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(s, q, 0, smem.k[read_k.stage], 0, false);
      warpgroup::commit();
      pass_turn(consumer);
      warpgroup::wait<0>(s);
      release(smem.k_empty[read_k.stage]);
      read_k.advance();
      scale_and_mask(p, s, row0, 0);
      softmax.update(s, rescale);
      p_frag.pack(s);
    }
    for (int j = 1; j < key_blocks; ++j) {
      // S_j = Q K_j^T, then O += P_{j-1} V_{j-1}: both in flight while the softmax of S_j runs.
      smem.k_full[read_k.stage].wait(read_k.phase);
      smem.v_full[read_v.stage].wait(read_v.phase);
      wait_turn(consumer);
      warpgroup::fence();
      warpgroup::mma<operand_major::k, operand_major::k>(s, q, 0, smem.k[read_k.stage], 0, false);
      warpgroup::commit();
      mma_rs(o, p_frag, smem.v[read_v.stage]);
      warpgroup::commit();
      pass_turn(consumer);
      warpgroup::wait<1>(s);
      release(smem.k_empty[read_k.stage]);
      read_k.advance();
      scale_and_mask(p, s, row0, j * plan::block_kv);
      softmax.update(s, rescale);
      warpgroup::wait<0>(o);
      p_frag.pin();
      release(smem.v_empty[read_v.stage]);
      read_v.advance();
#pragma unroll
      for (int k = 0; k < accumulator<D>::registers; ++k) o.data[k] *= rescale[row_half(k)];
      p_frag.pack(s);
    }
    if (key_blocks > 0) {
      smem.v_full[read_v.stage].wait(read_v.phase);
      wait_turn(consumer);
      warpgroup::fence();
      mma_rs(o, p_frag, smem.v[read_v.stage]);
      warpgroup::commit();
      pass_turn(consumer, /*last_turn=*/true);
      warpgroup::wait<0>(o);
      p_frag.pin();
      release(smem.v_empty[read_v.stage]);
    }
    store(p, smem, consumer, softmax, o, batch, head, row0);
  }

  // O /= rowsum into this consumer's Q tile (its wgmmas are done), then one TMA store; lse per row.
  __device__ static void store(const params& p, storage& smem, int consumer, online_softmax& softmax,
                               accumulator<D>& o, int batch, int head, int row0) {
    float inverse[2];
    float lse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = reduce_row_sum(softmax.sum[h]);
      // sum is 0 exactly when the row saw no key (otherwise its max contributes exp2(0) = 1).
      inverse[h] = sum > 0.0f ? 1.0f / sum : 0.0f;
      lse[h] = sum > 0.0f ? (softmax.max[h] + __log2f(sum)) * LN_2 : NEG_INF;
    }
#pragma unroll
    for (int k = 0; k < accumulator<D>::registers; ++k) o.data[k] *= inverse[row_half(k)];

    q_tile& staging = smem.q[consumer];
    warpgroup::store<0>(staging, o);
    fence_async_shared();  // the stmatrix writes must be visible to the copy engine
    const barrier_id written = barrier_after(barrier_id::consumer_epilogue, consumer);
    barrier_sync(written, WARPGROUP_THREADS);
    if (threadIdx.x % WARPGROUP_THREADS == 0) {
      const int index[4] = {batch, head, row0, 0};
      tma::store(p.out, staging, index);
      tma::commit_stores();
    }
    if (accumulator<D>::first_col() == 0) {
      float* lse_rows = p.lse + (int64_t(batch) * p.q_heads + head) * p.q_rows;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + accumulator<D>::first_row() + 8 * h;
        if (row < p.q_rows) lse_rows[row] = lse[h];
      }
    }
    // The block's shared memory must outlive the store's reads of it.
    if (threadIdx.x % WARPGROUP_THREADS == 0) tma::wait_stores_read<0>();
  }

  // Causal blocks run longest first (blockIdx.x 0 takes the last query block) so the tail of the
  // grid is short work; consecutive blocks share a head, whose K/V stay in L2.
  __device__ static void run(const params& p) {
    extern __shared__ uint8_t shared_raw[];
    storage& smem = aligned_storage<storage>(shared_raw);
    const int q_block = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int q0 = q_block * plan::block_q;
    const visibility vis{p.q_rows, p.k_rows, p.causal};
    const int key_blocks = vis.key_blocks(q0, plan::block_q, plan::block_kv);

    if (threadIdx.x == 0) {
      smem.q_full.init(1);
      for (int s = 0; s < stages; ++s) {
        smem.k_full[s].init(1);
        smem.v_full[s].init(1);
        smem.k_empty[s].init(plan::consumer_warpgroups * WARPGROUP_WARPS);
        smem.v_empty[s].init(plan::consumer_warpgroups * WARPGROUP_WARPS);
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
__global__ void __launch_bounds__(K::threads, 1) forward_entry(const __grid_constant__ typename K::params p) {
  K::run(p);
}

template <typename T, int D>
std::string reason_for(const forward_problem& pr) {
  using K = forward_kernel<T, D>;
  if (std::string r = shape_reason(pr.q, pr.k, pr.v); !r.empty()) return r;
  const heads_view out = contiguous_view(pr.out, pr.q.batch, pr.q.heads, pr.q.rows, pr.q.dim);
  for (const auto& [name, view] : {std::pair{"q", pr.q}, std::pair{"out", out}}) {
    if (std::string r = layout_reason<typename K::q_tile, T>(name, view); !r.empty()) return r;
  }
  for (const auto& [name, view] : {std::pair{"k", pr.k}, std::pair{"v", pr.v}}) {
    if (std::string r = layout_reason<typename K::kv_tile, T>(name, view); !r.empty()) return r;
  }
  return {};
}

template <typename T, int D>
cudaError_t run(const forward_problem& pr, cudaStream_t stream) {
  using K = forward_kernel<T, D>;
  typename K::params p;
  p.q = make_tma_map<typename K::q_tile>(heads_layout<T>(pr.q));
  p.k = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.k));
  p.v = make_tma_map<typename K::kv_tile>(heads_layout<T>(pr.v));
  p.out = make_tma_map<typename K::q_tile>(
      heads_layout<T>(contiguous_view(pr.out, pr.q.batch, pr.q.heads, pr.q.rows, pr.q.dim)));
  p.lse = pr.lse;
  p.q_rows = int(pr.q.rows);
  p.k_rows = int(pr.k.rows);
  p.q_heads = int(pr.q.heads);
  p.group = int(pr.q.heads / pr.k.heads);
  p.scale_log2 = pr.scale * LOG2_E;
  p.causal = pr.causal;
  const dim3 grid(ceil_div(p.q_rows, K::plan::block_q), unsigned(pr.q.heads), unsigned(pr.q.batch));
  return launch_kernel(forward_entry<K>, shared_bytes<typename K::storage>, grid, K::threads, p, stream);
}

template <typename F>
auto dispatch(const forward_problem& pr, F&& f) {
  const bool half_precision = pr.dtype == element_type::fp16;
  if (pr.q.dim == 64) return half_precision ? f.template operator()<half, 64>() : f.template operator()<bf16, 64>();
  return half_precision ? f.template operator()<half, 128>() : f.template operator()<bf16, 128>();
}

}  // namespace

std::string unsupported_reason(const forward_problem& p) {
  if (p.q.dim != 64 && p.q.dim != 128) return "the head dim must be 64 or 128";
  return dispatch(p, [&]<typename T, int D>() { return reason_for<T, D>(p); });
}

cudaError_t launch(const forward_problem& p, cudaStream_t stream) {
  return dispatch(p, [&]<typename T, int D>() { return run<T, D>(p, stream); });
}

}  // namespace tk::attention
