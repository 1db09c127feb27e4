// The attention launchers: softmax(scale * q k^T + causal mask) v and its gradients, bf16 or fp16
// in and out, fp32 softmax statistics. Plain C++ (no torch): csrc/torch/attention.cpp calls them.
//
// Tensors are (B, H, N, D) views with a unit last stride and any other strides (in elements).
// Query head h reads key/value head h / (Hq / Hkv). Causal masks are bottom-right aligned: query i
// sees key j iff j <= i + Nk - Nq; a query that sees no key gets out = 0 and lse = -inf.
//
// The forward also takes FlashAttention's options (tk_ops/ops/attention.py has the definition):
//   window (left, right)  query i sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq + right
//                         (-1 = unbounded; causal takes right as 0)
//   softcap c > 0         each scaled score t becomes c tanh(t / c) before the mask
//   sinks (Hq,) fp32      one logit per query head in each row's softmax denominator only:
//                         out = sum_j p_j v_j / (sum_j p_j + exp(sink)), lse includes it, and a
//                         row that sees no key gets out = 0 and lse = sink
// The backward takes all three (a sink's gradient: it is one more key of value 0 in every row).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/common/heads_view.h"
#include "tk/dispatch.h"
#include "tk/element_type.h"

namespace tk::attention {

using tk::element_type;

// The head dims the kernels are instantiated for (D = Dv); unsupported_reason rejects the others. Here
// rather than in attention.cuh so that the registration declares them to Python (kernel_support.h).
// The backward's plans hold dK and dV (or dQ) of 64 rows x D in a consumer's registers up to D = 128;
// at 192 and 256 the two consumers own the same 64 rows and half of the columns each (column_split,
// attention.cuh). D = 96 runs the D = 128 backward on
// zero-padded copies (csrc/torch/attention.cpp).
using forward_head_dims = one_of<64, 96, 128, 192, 256>;
using backward_head_dims = one_of<64, 128, 192, 256>;

using tk::heads_view;

// Packed sequences (attention_varlen), or none (a dense batch). Packed: q, k, v (and the backward's
// out and grad_out) are (1, H, total, D) views of the packed (total, H, D) tensors, the outputs are packed
// and contiguous ((total, H, D), lse (Hq, total)), and sequence b is rows [cu_seqlens_q[b],
// cu_seqlens_q[b + 1]) of q (cu_seqlens_k: of k and v), at most max_seqlen_q (max_seqlen_k) long;
// with seqused_k (FlashAttention's), sequence b's keys are the first seqused_k[b] rows of its span (a
// KV cache: each sequence's span is its capacity, seqused_k its length). The kernels read cu_seqlens
// and seqused_k on the device (int32, (count + 1,) and (count,)), clamped to the packed rows.
// The backward's per-row statistics are padded to whole blocks of this many rows, each packed sequence's
// too (packed_sequences::statistics_start).
constexpr int STATISTICS_ROW_MULTIPLE = 128;

// Every forward plan's key blocks (128 keys, or 64 beyond D = 128) divide this: a key block that starts at a
// multiple of it within a sequence's positions lies in one page of a paged cache whose pages hold a multiple
// of it (packed_sequences::page_table), so pages, and the spans of a KV-cache call's decode chunks, come in
// multiples of it.
constexpr int KEY_BLOCK_ALIGNMENT = 128;

struct packed_sequences {
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  int64_t count = 0;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  const int* seqused_k = nullptr;
  // The backward, optional: where each sequence's rows start in the statistics that every head keeps
  // for all sequences (count + 1 entries: 0, then the running sum of each sequence's query rows, clamped
  // to [0, min(max_seqlen_q, total_q)], rounded up to STATISTICS_ROW_MULTIPLE). Without it each
  // (sequence, head) has the longest sequence's rows.
  const int* statistics_start = nullptr;
  // Paged keys and values (a KV cache's blocks; the forward): k and v are the pool of `pages` pages of
  // page_rows rows (a multiple of 128), and sequence row r of cu_seqlens_k's rows, which then count
  // positions of table_rows logical caches of pages_per_row * page_rows positions each, is row
  // r % page_rows of page page_table[r / capacity][(r % capacity) / page_rows].
  const int* page_table = nullptr;
  int64_t table_rows = 0, pages_per_row = 0, page_rows = 0, pages = 0;

  bool given() const { return cu_seqlens_q != nullptr; }
};

struct forward_problem {
  element_type dtype;
  bool causal;
  float scale;
  heads_view q, k, v;
  void* out;   // (B, Hq, Nq, D) contiguous (packed: (total, Hq, D))
  float* lse;  // (B, Hq, Nq) contiguous, natural log (packed: (Hq, total))
  int64_t window_left = -1, window_right = -1;  // -1 = unbounded
  double softcap = 0.0;                          // 0 = off
  const float* sinks = nullptr;                  // (Hq,) contiguous, or none
  packed_sequences packed;

  bool has_options() const {
    return window_left >= 0 || window_right >= 0 || softcap != 0.0 || sinks != nullptr || packed.given();
  }
};

// How the backward forms dq:
//   recompute  a second kernel recomputes the scores per query block and sums dq in registers:
//              bitwise reproducible (what deterministic=True asks for)
//   one_pass   the dK/dV pass adds each step's dq partial into an fp32 accumulator with bulk
//              reductions in varying order (dq reproducible only to fp32 rounding), then converts
//   fastest    whichever measured faster for the shape (one_pass() in attention_bwd.cu)
// Beyond D = 128 only recompute exists (the one-pass dQ partials have no room in shared memory beside the
// split plans' tiles): one_pass and fastest run it there.
enum class backward_method { fastest, recompute, one_pass };

struct backward_problem {
  element_type dtype;
  bool causal;
  float scale;
  heads_view q, k, v, out, grad_out;
  const float* lse;       // (B, Hq, Nq) contiguous (packed: (Hq, total))
  const float* grad_lse;  // lse's shape, contiguous, or nullptr
  void* grad_q;           // (B, Hq, Nq, D) contiguous (packed: (total, Hq, D))
  void* grad_k;           // (B, Hkv, Nk, D) contiguous (packed: (total_k, Hkv, D))
  void* grad_v;
  // Workspace of backward_workspace_floats(*this) floats: the per-row statistics the gradient
  // kernels read (lse in base 2, rowsum(dO * O) - dlse) and, for the one-pass method, the fp32 dq
  // accumulator.
  float* workspace;
  backward_method method;
  int64_t window_left = -1, window_right = -1;  // the forward's window; -1 = unbounded
  double softcap = 0.0;                          // the forward's softcap; 0 = off
  const float* sinks = nullptr;                  // the forward's (Hq,) sinks (its lse includes them), or none
  float* grad_sinks = nullptr;                   // (Hq,) fp32, written when sinks are given
  packed_sequences packed;                       // the forward's; the gradients are then packed too

  // The window, the softcap and packed sequences change the gradient kernels (their options
  // variants); sinks do not.
  bool has_options() const { return window_left >= 0 || window_right >= 0 || softcap != 0.0 || packed.given(); }
};

// Floats of workspace the backward needs (every field but the pointers set).
int64_t backward_workspace_floats(const backward_problem& p);

// Empty when the kernels can run the problem; otherwise why not (a head dim, a stride TMA cannot take).
std::string unsupported_reason(const forward_problem& p);
std::string unsupported_reason(const backward_problem& p);

// Launch on `stream`; return the first launch error.
cudaError_t launch(const forward_problem& p, cudaStream_t stream);
cudaError_t launch(const backward_problem& p, cudaStream_t stream);

}  // namespace tk::attention
