// What the gated delta rule's chunked (gated_delta_rule_fwd.cu) and recurrent
// (gated_delta_rule_recurrent.cu) forward kernels share: where a sequence's rows are, a row's address,
// the q/k normalisation's epsilon and the 16-byte row rule of their vector loads.
#pragma once

#include <cstdint>

#include "gated_delta_rule.h"

namespace tk::gdn {

constexpr float L2NORM_EPS = 1e-6f;  // tk_ops' (fla's, Hugging Face's) l2norm epsilon
constexpr int ROW_VECTOR_BYTES = 16;  // one vector load of a row of q, k or v
constexpr int ELEMENT_BYTES = 2;      // q, k, v and o: bf16 or fp16

// Sequence n's rows: row `start` of batch `batch` onwards, `length` of them (B rows of T, or the packed
// sequences of cu_seqlens in batch 0).
struct sequence_rows {
  int batch;
  int64_t start;
  int length;
};

__device__ __forceinline__ sequence_rows rows_of_sequence(const forward_problem& p, int n) {
  if (p.cu_seqlens == nullptr) return {n, 0, int(p.q.rows)};
  return {0, p.cu_seqlens[n], p.cu_seqlens[n + 1] - p.cu_seqlens[n]};
}

template <typename T>
__device__ __forceinline__ const T* row_of(const heads_view& view, int batch, int64_t head, int64_t row) {
  return static_cast<const T*>(view.data) + batch * view.batch_stride + head * view.head_stride + row * view.row_stride;
}

// Every row of the 16-bit view starts on a 16-byte boundary (its base and strides allow vector loads).
inline bool aligned_rows(const heads_view& view) {
  constexpr int64_t ELEMENTS_PER_VECTOR = ROW_VECTOR_BYTES / ELEMENT_BYTES;
  const auto multiple = [](int64_t stride) { return stride % ELEMENTS_PER_VECTOR == 0; };
  return reinterpret_cast<uintptr_t>(view.data) % ROW_VECTOR_BYTES == 0 && multiple(view.batch_stride) &&
         multiple(view.head_stride) && multiple(view.row_stride);
}

}  // namespace tk::gdn
