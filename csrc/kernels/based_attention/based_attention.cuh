// What the Based forward and backward kernels share: the Taylor feature map phi at F = 16, cut into
// five 64-feature slabs that wgmma consumes as register operands, and the host-side shape rules.
//
// phi(x) . phi(y) = 1 + s + s^2 / 2 with s = x . y / sqrt(F). The kernels multiply raw x and y and
// fold phi's constants into the 16-bit copies of the moment states (copy_scale): phi's second-order
// entries multiply to x_a x_b y_a y_b / (2 F), its first-order ones to x_b y_b / sqrt(F).
//
// Slab t < 4 holds the second-order features (a, b) with a = 4 t + w, b = 0..15, in the 16 rows of
// warp w (of a state) or the 16 columns of k16 block w (of an operand); slab 4 holds the
// first-order features (warp / block 0) and the constant (warp / block 1, its first entry).
#pragma once

#include <string>

#include "kernels/common/chunked_causal.cuh"
#include "kernels/common/heads_view.h"
#include "tk/tk.cuh"

namespace tk::based {

constexpr int FEATURES = 16;               // F: the kernels' q/k feature dim
constexpr int CHUNK = warpgroup::WGMMA_M;  // positions per chunk: the rows of one wgmma
constexpr int VALUE_BLOCK = 32;            // value columns per task (two tasks per head at Dv = 64)
constexpr int SLAB_FEATURES = warpgroup::WGMMA_M;  // features per slab: the rows of one wgmma
constexpr int SECOND_ORDER_SLABS = FEATURES * FEATURES / SLAB_FEATURES;
constexpr int SLABS = SECOND_ORDER_SLABS + 1;  // and the lower-order slab last
constexpr int FEATURES_PER_WARP = FEATURES * FEATURES / (SECOND_ORDER_SLABS * WARPGROUP_WARPS);
static_assert(FEATURES_PER_WARP == BASE_TILE && FEATURES == BASE_TILE,
              "a warp's slab rows are one first feature a times the 16 second features b");

// The lower-order slab's warps: first-order features, then the constant feature in row 0.
constexpr int FIRST_ORDER_WARP = 0;
constexpr int ZEROTH_ORDER_WARP = 1;

// s = q.k / sqrt(F); phi(q).phi(k) = 1 + s + s^2 / 2.
constexpr float SCORE_SCALE = 0.25f;
static_assert(SCORE_SCALE * SCORE_SCALE * FEATURES == 1.0f, "SCORE_SCALE is 1 / sqrt(F)");
constexpr float SECOND_ORDER_SCALE = 0.5f * SCORE_SCALE * SCORE_SCALE;  // of q_a q_b k_a k_b
// d/dq of SECOND_ORDER_SCALE q^T G q (G symmetric) is this times G q.
constexpr float SECOND_ORDER_GRADIENT_SCALE = 2.0f * SECOND_ORDER_SCALE;


// Register operands of the slab products kept alive at once: each stays pinned until the product
// after the next is issued.
constexpr int OPERAND_BUFFERS = 2;

// Every Based kernel on the template: one consumer warpgroup per task (32 value columns), two tasks
// sharing an SM (232 consumer registers), three stages.
struct based_plan {
  static constexpr int consumer_warpgroups = 1;
  static constexpr int stages = 3;
  static constexpr int blocks_per_sm = 2;
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 232;
};

struct taylor_score {
  __device__ static float apply(float qk) {
    const float s = qk * SCORE_SCALE;
    return 1.0f + s + 0.5f * s * s;
  }
};

// phi's slabs built in registers from a chunk's raw q or k.
template <typename T>
struct taylor_slabs {
  using position_rows = register_tile<T, BASE_TILE, FEATURES>;  // a warp's 16 positions x F
  using position_cols = register_tile<T, CHUNK, FEATURES, register_layout::col>;  // the chunk, K x F
  using slab_rows = register_tile<T, BASE_TILE, SLAB_FEATURES>;  // a warp's rows of a phi operand
  // One entry per chunk position: 16-bit, so the products run packed, unless a float weight is
  // folded in first (one rounding for x_a * w).
  template <bool WEIGHTED>
  using position_vector = per_col_vector<slab_rows, std::conditional_t<WEIGHTED, float, T>>;
  using small_tile = register_tile<float, FEATURES, FEATURES>;

  // Warp rows of slab t's phi(X)^T: features (a, b), b = 0..15, over the chunk's positions j:
  // X^T with column j scaled by x_ja (a = 4 t + warp); for the lower-order slab x_jb (first-order
  // warp), 1 in row 0 (zeroth-order warp) or nothing. A `weight` scales column j once more by
  // w_j (folded into x_ja, so the second-order entries are rounded once).
  template <typename... Weight>
  __device__ static void transposed(slab_rows& dst, const position_cols& x, int slab, const Weight&... weight) {
    static_assert(sizeof...(Weight) <= 1, "at most one position weight");
    const int warp = warp_in_warpgroup();
    if (slab < SECOND_ORDER_SLABS) {
      position_vector<(sizeof...(Weight) > 0)> x_a;
      warp::column(x_a, x, slab * WARPGROUP_WARPS + warp);
      (warp::mul(x_a, x_a, weight), ...);
      warp::transpose(dst, x);
      warp::mul_col(dst, dst, x_a);
    } else if (warp == FIRST_ORDER_WARP) {
      warp::transpose(dst, x);
      (warp::mul_col(dst, dst, weight), ...);
    } else {
      warp::fill(dst, warp == ZEROTH_ORDER_WARP ? 1.0f : 0.0f);
      warp::mask(dst, {0, 0}, [](int row, int) { return row == 0; }, 0.0f);
      (warp::mul_col(dst, dst, weight), ...);
    }
  }

  // The warp's positions' phi_t(x) over slab t's features: k16 block kb is x scaled by x_a
  // (a = 4 t + kb); for the lower-order slab x itself, then the constant 1 in the first column.
  __device__ static void rows(slab_rows& dst, const position_rows& x, int slab) {
    if (slab < SECOND_ORDER_SLABS) {
#pragma unroll
      for (int kb = 0; kb < WARPGROUP_WARPS; ++kb) {
        per_row_vector<position_rows> x_a;  // 16-bit: the products run packed
        warp::column(x_a, x, slab * WARPGROUP_WARPS + kb);
        position_rows block;
        warp::mul_row(block, x, x_a);
        set_block(dst, block, kb);
      }
    } else {
      position_rows constant;
      warp::fill(constant, 1.0f);
      warp::mask(constant, {0, 0}, [](int, int col) { return col == 0; }, 0.0f);
      warp::zero(dst);
      warp::set_columns<0>(dst, x);
      warp::set_columns<BASE_TILE>(dst, constant);
    }
  }

  __device__ static void set_block(slab_rows& dst, const position_rows& block, int kb) {
    switch (kb) {
      case 0: warp::set_columns<0 * BASE_TILE>(dst, block); break;
      case 1: warp::set_columns<1 * BASE_TILE>(dst, block); break;
      case 2: warp::set_columns<2 * BASE_TILE>(dst, block); break;
      default: warp::set_columns<3 * BASE_TILE>(dst, block); break;
    }
  }

  // What a slab's copy is scaled by so that raw products give phi(x) . phi(y) terms.
  __device__ static float copy_scale(int slab) {
    if (slab < SECOND_ORDER_SLABS) return SECOND_ORDER_SCALE;
    return warp_in_warpgroup() == FIRST_ORDER_WARP ? SCORE_SCALE : 1.0f;
  }

  // dst[i][a] = (gram x_i)[a] * gram_scale + sum[0][a] * sum_scale for the warp's positions i:
  // gram a symmetric F x F moment (sum_j y_j y_j^T), every row of `sum` the first moment sum_j y_j.
  __device__ static void moment_rows(small_tile& dst, const small_tile& gram, const small_tile& sum,
                                     const position_rows& x, float gram_scale, float sum_scale) {
    small_tile scaled;
    warp::mul(scaled, gram, gram_scale);
    register_tile<T, FEATURES, FEATURES, register_layout::col> gram_operand;
    warp::transpose(gram_operand, scaled);  // symmetric: its transpose is itself, as a B operand
    warp::zero(dst);
    warp::mma_AB(dst, x, gram_operand, dst);
    per_col_vector<small_tile> first_order;
    warp::row(first_order, sum, 0);
    warp::mul(first_order, first_order, sum_scale);
    warp::add_col(dst, dst, first_order);
  }
};

// Empty when q, k and v have the shapes the kernels take; otherwise why not.
inline std::string shape_reason(const heads_view& q, const heads_view& k, const heads_view& v) {
  if (q.dim != FEATURES) return "the feature dim must be " + std::to_string(FEATURES);
  return chunked_causal::sequence_shape_reason(q, k, v, VALUE_BLOCK);
}

}  // namespace tk::based
