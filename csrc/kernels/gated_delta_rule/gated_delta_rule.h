// The gated delta rule forward launcher (tk::gated_delta_rule, tk_ops/ops/gated_delta_rule.py for the
// semantics and the chunked algorithm): q, k, v in bf16 or fp16, K = V = 128, Hv % Hk == 0,
// g and beta fp32, any T, optionally packed sequences (cu_seqlens). Plain C++ (no torch):
// csrc/torch/gated_delta_rule.cpp calls it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/common/heads_view.h"
#include "tk/element_type.h"

namespace tk::gdn {

struct forward_problem {
  element_type dtype;           // of q, k, v and o
  heads_view q, k;              // (B, Hk, T, K) views of q, k (B, T, Hk, K): any strides, unit last
  heads_view v;                 // (B, Hv, T, V) view of v (B, T, Hv, V)
  const float* g;               // (B, T, Hv) contiguous
  const float* beta;            // (B, T, Hv) contiguous
  float scale;
  bool l2norm;                  // normalise q and k over K first
  const float* initial_state;   // null or (N, Hv, K, V) contiguous, 8-byte aligned
  // Packed sequences (B = 1): null, or the checked cu_seqlens (N + 1 entries, from 0, non-decreasing,
  // ending at T) and the first chunk of every sequence in the workspace (N + 1 entries, the last the
  // total), both on the device.
  const int* cu_seqlens;
  const int* first_chunks;
  int sequences;                // N: B, or len(cu_seqlens) - 1
  int64_t chunks;               // chunks of all sequences together (see workspace_bytes)
  void* o;                      // (B, T, Hv, V) contiguous, q's dtype
  float* final_state;           // (N, Hv, K, V) contiguous
  void* workspace;              // workspace_bytes(...) bytes
};

// Positions per chunk (tk_ops' CHUNK_SIZE).
constexpr int CHUNK = 64;

// Bytes of workspace for `chunks` chunks (every sequence's own ceil(length / CHUNK)): per chunk and
// value head the solved W (CHUNK x K) and U0 (CHUNK x V) and the decayed causal scores P (CHUNK x CHUNK)
// in q's dtype and the cumulative log decays (CHUNK fp32); per chunk and key head the normalised Q
// (times scale) and K (CHUNK x K each) in q's dtype, which the scan copies as they are.
int64_t workspace_bytes(int64_t chunks, int64_t key_heads, int64_t value_heads, int64_t key_dim, int64_t value_dim);

// Empty when the kernels can run the problem (its dtype, q, k, v and initial_state); otherwise why not.
std::string unsupported_reason(const forward_problem& p);

// Launch on `stream`; return the first launch error.
cudaError_t launch(const forward_problem& p, cudaStream_t stream);

// The recurrent path (gated_delta_rule_recurrent.cu) for short sequences, as in decoding: the state in
// registers, stepped position by position in fp32, K = V in {64, 128}. It reads what launch does but
// first_chunks, chunks and workspace; it takes any length, but its FMAs grow with every position while
// the chunked kernels' tensor cores amortise theirs, so the caller takes it only when no sequence is
// longer than RECURRENT_MAX_T.
constexpr int RECURRENT_MAX_T = 16;

// Empty when the recurrent kernel can run the problem (its dtype, q, k, v and initial_state); otherwise why not.
std::string recurrent_unsupported_reason(const forward_problem& p);

// Launch the recurrent kernel on `stream`; return the launch error.
cudaError_t launch_recurrent(const forward_problem& p, cudaStream_t stream);

}  // namespace tk::gdn
