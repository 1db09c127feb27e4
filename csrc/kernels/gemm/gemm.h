// The GEMM launcher: C (M x N, row-major, rows c_row_stride apart) = (A (M x K) * B (K x N) [+ bias]) [* c_scale],
// fp32 accumulation, bf16 or fp16 in and out; or, with accumulates_c, an fp32 C += A * B [* c_scale].
// Plain C++ (no torch): csrc/torch/gemm.cpp and csrc/torch/linear_cross_entropy.cpp call it.
//
// Each operand is described as it is stored: a matrix of `rows` x `cols` whose columns are
// contiguous and whose rows are `row_stride` elements apart, read K-major (A stored M x K, B stored
// N x K) or MN-major (A stored K x M, B stored K x N). Transposed views are thus just the other
// major-ness, with no copy.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "tk/element_type.h"

namespace tk::gemm {

using tk::element_type;
enum class major { k, mn };

struct stored_matrix {
  const void* data;
  int64_t rows;
  int64_t cols;
  int64_t row_stride;  // elements
};

struct problem {
  element_type dtype;
  int64_t m, n, k;
  stored_matrix a;
  major a_major;
  stored_matrix b;
  major b_major;
  void* c;               // M x N
  int64_t c_row_stride;  // elements between C's rows: N, or more (a row-padded buffer)
  const void* bias;      // N elements, or nullptr
  // One fp32 value in device memory that the fp32 result is multiplied by before its one rounding to
  // the element type, or nullptr: a factor the caller kept out of the operands (e.g. to keep fp16
  // operands in fp16's normal range) without a second rounding or an fp16 overflow of C before it.
  const float* c_scale = nullptr;
  // C is fp32 and the (scaled) product is added to what it holds, C += A B [* c_scale], instead of C being
  // written in the element type: a sum over several products (e.g. a weight gradient over tiles of rows)
  // without a pass of its own. Each element of C is read and written by one thread, so C must not overlap
  // itself (c_row_stride >= N); launches on one stream add in order. Instantiated for A and B MN-major
  // without bias only (the use so far: dlogits^T x in csrc/torch/linear_cross_entropy.cpp).
  bool accumulates_c = false;
};

// Empty when the kernel can run the problem; otherwise why not (e.g. a stride TMA cannot take).
std::string unsupported_reason(const problem& p);

// Launch on `stream`; returns the launch's error code.
cudaError_t launch(const problem& p, cudaStream_t stream);

}  // namespace tk::gemm
