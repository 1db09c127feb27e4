// The row-norm launchers (LayerNorm and RMSNorm, forward and backward), plain C++ without torch:
// csrc/torch/norms.cpp calls them.
//
// Every tensor is a matrix of `rows` x `hidden` with contiguous columns, its rows `row_stride`
// elements apart. x, out and grad_out are bf16 or fp16; the residual stream h (and the residual,
// grad_h and grad_residual) is x's dtype or fp32; the weight and bias are each x's dtype or fp32.
// Statistics (mean, rstd) are fp32, one per row. The semantics, rounding order and dropout hash are
// those of the module docstrings of tk_ops/ops/layer_norm.py and tk_ops/ops/rms_norm.py.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "tk/element_type.h"

namespace tk::norms {

using tk::element_type;
enum class norm_kind { layer, rms };

struct row_matrix {
  const void* data;  // nullptr: absent
  int64_t row_stride;  // elements
  element_type dtype;
};

struct parameter {
  const void* data;  // nullptr: absent
  element_type dtype;
};

struct output_matrix {
  void* data;  // nullptr: not wanted
  element_type dtype;  // contiguous rows, `hidden` elements apart
};

struct forward_problem {
  int64_t rows;
  int64_t hidden;
  row_matrix x;
  row_matrix residual;
  parameter weight;
  parameter bias;  // layer norm only
  float eps;
  const int64_t* dropout_seed;  // device pointer to the seed; nullptr without dropout (layer norm only)
  double dropout_p;
  output_matrix out;
  output_matrix h;  // nullptr when h is not materialised (no residual, no dropout)
  float* mean;      // layer norm only
  float* rstd;
};

struct backward_problem {
  int64_t rows;
  int64_t hidden;
  row_matrix grad_out;
  row_matrix grad_h;  // absent when h was not materialised or its gradient is unused
  row_matrix h;       // the residual stream, or x when it was not materialised
  parameter weight;
  const float* mean;  // layer norm only
  const float* rstd;
  const int64_t* dropout_seed;
  double dropout_p;
  output_matrix grad_x;
  output_matrix grad_residual;
  output_matrix grad_weight;  // a `hidden` vector in the weight's dtype; nullptr: not wanted
  output_matrix grad_bias;    // layer norm only
  float* workspace;           // backward_workspace_floats() floats, any content
};

// Empty when the kernels can run the problem; otherwise why not (dtype, hidden size, alignment).
std::string unsupported_reason(norm_kind kind, const forward_problem& p);
std::string unsupported_reason(norm_kind kind, const backward_problem& p);

// fp32 scratch the backward needs for its per-block partial sums of grad_weight and grad_bias.
int64_t backward_workspace_floats(norm_kind kind, const backward_problem& p, int device);

// Launch on `stream`; return the launch's error code.
cudaError_t launch_forward(norm_kind kind, const forward_problem& p, cudaStream_t stream);
cudaError_t launch_backward(norm_kind kind, const backward_problem& p, cudaStream_t stream);

}  // namespace tk::norms
