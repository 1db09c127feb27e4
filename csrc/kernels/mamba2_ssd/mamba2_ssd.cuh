// What the Mamba-2 SSD kernels share (mamba2_ssd_fwd.cu, mamba2_ssd_bwd.cu): the variants they take,
// the 64-position block every kernel walks a sequence in, the register maps of the chunked
// algorithm, and a block's steps dt and cumulative log decays.
#pragma once

#include "kernels/common/heads_view.h"
#include "tk/tk.cuh"

namespace tk::mamba2 {

using kernel_dtypes = one_of<element_type::bf16, element_type::fp16>;
using state_sizes = one_of<64, 128>;
using chunk_sizes = one_of<64, 128, 256>;

constexpr int BLOCK = warpgroup::WGMMA_M;  // positions per block: the rows of one wgmma
constexpr int HEAD_DIM = 64;               // P
constexpr int64_t MAX_SEQUENCE = int64_t(1) << 30;  // TMA's 32-bit coordinates, with room
constexpr int STEPS_PER_LANE = BLOCK / WARP_THREADS;
static_assert(STEPS_PER_LANE == 2, "each lane reads two positions' dt (one float2 in shared memory)");
// Above this, softplus(v) is v (torch's and mamba_ssm's threshold).
constexpr float SOFTPLUS_THRESHOLD = 20.0f;

// A contiguous (Bt, L, H, P) output (y, grad_x, grad_z) seen as `like`'s (Bt, H, L, P) view is.
inline heads_view sequence_major_view(const void* data, const heads_view& like) {
  return {data, like.batch, like.heads, like.rows, like.dim, like.rows * like.heads * like.dim, like.dim,
          like.heads * like.dim};
}

// The register maps of a block (fp32, MUFU exp).
struct decayed_score {  // G_ij exp(cum_i - cum_j) dt_j (masked to j <= i afterwards)
  __device__ static float apply(float g, float cum_i, float cum_j, float dt_j) { return g * __expf(cum_i - cum_j) * dt_j; }
};
struct to_block_end {  // exp(cum_last - cum_j) dt_j
  __device__ static float apply(float cum_j, float dt_j, float cum_last) { return __expf(cum_last - cum_j) * dt_j; }
};
struct skip_add {  // y + D x
  __device__ static float apply(float y, float x, float d) { return fmaf(d, x, y); }
};
struct silu_gate {  // y silu(z)
  __device__ static float apply(float y, float z) { return y * __fdividef(z, 1.0f + __expf(-z)); }
};

// A task's column of dt and how it becomes steps: dt_l = dt[l * row_stride] for l < rows.
struct step_column {
  const float* dt;
  int64_t row_stride;
  int rows;
  float A, bias;
  bool softplus;
};

// The steps of this lane's positions of a block (STEPS_PER_LANE consecutive ones, lane-major).
struct lane_steps {
  float step[STEPS_PER_LANE];   // max(softplus(dt + bias), 0); 0 past the sequence
  float slope[STEPS_PER_LANE];  // d step / d dt: 0 where the clamp cuts and past the sequence
};

// This lane's raw dt of a block (0 past the sequence): a load a kernel may issue a block ahead, so
// that its latency hides behind the current block's products.
struct lane_dt {
  float dt[STEPS_PER_LANE];
};

__device__ __forceinline__ lane_dt load_dt(const step_column& c, int block) {
  lane_dt raw;
#pragma unroll
  for (int k = 0; k < STEPS_PER_LANE; ++k) {
    const int row = block * BLOCK + STEPS_PER_LANE * lane_id() + k;
    raw.dt[k] = row < c.rows ? c.dt[int64_t(row) * c.row_stride] : 0.0f;
  }
  return raw;
}

__device__ __forceinline__ lane_steps steps_of(const step_column& c, int block, const lane_dt& raw) {
  lane_steps s;
#pragma unroll
  for (int k = 0; k < STEPS_PER_LANE; ++k) {
    const int row = block * BLOCK + STEPS_PER_LANE * lane_id() + k;
    float v = 0.0f, slope = 0.0f;
    if (row < c.rows) {
      const float biased = raw.dt[k] + c.bias;
      v = biased;
      slope = 1.0f;
      if (c.softplus && biased <= SOFTPLUS_THRESHOLD) {
        v = log1pf(__expf(biased));
        slope = 1.0f / (1.0f + __expf(-biased));
      }
      if (!(v >= 0.0f)) slope = 0.0f;
      v = fmaxf(v, 0.0f);
    }
    s.step[k] = v;
    s.slope[k] = slope;
  }
  return s;
}

__device__ __forceinline__ lane_steps steps_of(const step_column& c, int block) {
  return steps_of(c, block, load_dt(c, block));
}

// This warp's copy of the block's steps and cum (inclusive prefix sums of step * A, by
// warp::inclusive_scan) in its shared slots, read back as register vectors of whatever layout a
// tile needs; returns cum_last.
__device__ __forceinline__ float write_block_steps(const lane_steps& s, float A, float (&steps)[BLOCK],
                                                   float (&cum)[BLOCK]) {
  float decay[STEPS_PER_LANE];
#pragma unroll
  for (int k = 0; k < STEPS_PER_LANE; ++k) decay[k] = s.step[k] * A;
  const float cum_last = warp::inclusive_scan(decay);
  const int lane = lane_id();
  __syncwarp();  // the previous block's reads of the slots are done
  *reinterpret_cast<float2*>(&steps[STEPS_PER_LANE * lane]) = {s.step[0], s.step[1]};
  *reinterpret_cast<float2*>(&cum[STEPS_PER_LANE * lane]) = {decay[0], decay[1]};
  __syncwarp();
  return cum_last;
}

}  // namespace tk::mamba2
