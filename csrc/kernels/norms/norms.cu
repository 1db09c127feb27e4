// The host side of the norm launchers (norms.h): what the kernels take, the row plan, dispatch by kind.
#include <climits>
#include <string>

#include "norms.cuh"

namespace tk::norms {
namespace {

bool is_16bit(element_type t) { return t == element_type::bf16 || t == element_type::fp16; }

// x's dtype or fp32: the dtypes a parameter or the residual stream may have.
bool x_or_fp32(element_type t, element_type x) { return t == x || t == element_type::fp32; }

std::string plan_reason(const row_plan& plan, int64_t rows, int64_t hidden, element_type x_dtype) {
  if (plan.threads_per_row == 0) {
    return "hidden size " + std::to_string(hidden) + " is above the kernels' maximum (" +
           std::to_string(max_hidden(x_dtype, true)) + " with 16-byte aligned rows, " +
           std::to_string(max_hidden(x_dtype, false)) + " otherwise)";
  }
  if (plan.blocks_for(rows) > INT_MAX) return "too many rows for one grid";
  return {};
}

bool forward_vectorisable(const forward_problem& p) {
  const int64_t per_access = VECTOR_BYTES / element_bytes(p.x.dtype);
  return p.hidden % per_access == 0 && aligned_rows(p.x.data, p.x.row_stride, p.x.dtype) &&
         aligned_rows(p.residual.data, p.residual.row_stride, p.residual.dtype) && aligned_vector(p.weight.data) &&
         aligned_vector(p.bias.data) && aligned_vector(p.out.data) && aligned_vector(p.h.data);
}

bool backward_vectorisable(const backward_problem& p) {
  const int64_t per_access = VECTOR_BYTES / element_bytes(p.grad_out.dtype);
  return p.hidden % per_access == 0 && aligned_rows(p.grad_out.data, p.grad_out.row_stride, p.grad_out.dtype) &&
         aligned_rows(p.grad_h.data, p.grad_h.row_stride, p.grad_h.dtype) &&
         aligned_rows(p.h.data, p.h.row_stride, p.h.dtype) && aligned_vector(p.weight.data) &&
         aligned_vector(p.grad_x.data) && aligned_vector(p.grad_residual.data);
}

row_plan forward_plan(const forward_problem& p) { return plan_rows(p.hidden, p.x.dtype, forward_vectorisable(p)); }
row_plan backward_plan(const backward_problem& p) {
  return plan_rows(p.hidden, p.grad_out.dtype, backward_vectorisable(p));
}

}  // namespace

std::string unsupported_reason(norm_kind kind, const forward_problem& p) {
  const element_type x = p.x.dtype;
  const element_type stream = p.residual.data != nullptr ? p.residual.dtype : x;
  if (p.rows < 1 || p.hidden < 1) return "rows and hidden must be at least 1";
  if (!is_16bit(x)) return "x must be bf16 or fp16";
  if (p.out.dtype != x) return "out must have x's dtype";
  if (!x_or_fp32(stream, x)) return "the residual must have x's dtype or fp32";
  if (p.h.data != nullptr && p.h.dtype != stream) return "h must have the residual stream's dtype";
  if (p.weight.data != nullptr && !x_or_fp32(p.weight.dtype, x)) return "the weight must have x's dtype or fp32";
  if (p.bias.data != nullptr && !x_or_fp32(p.bias.dtype, x)) return "the bias must have x's dtype or fp32";
  if (p.rstd == nullptr) return "rstd is required";
  if (kind == norm_kind::rms && (p.bias.data != nullptr || p.dropout_p != 0 || p.mean != nullptr)) {
    return "rms norm takes no bias, dropout or mean";
  }
  if (kind == norm_kind::layer && p.mean == nullptr) return "layer norm writes the mean";
  if (!(p.dropout_p >= 0 && p.dropout_p < 1)) return "dropout_p must be in [0, 1)";
  if (p.dropout_p > 0 && (p.dropout_seed == nullptr || p.h.data == nullptr)) return "dropout needs a seed and h";
  return plan_reason(forward_plan(p), p.rows, p.hidden, x);
}

std::string unsupported_reason(norm_kind kind, const backward_problem& p) {
  const element_type x = p.grad_out.dtype;
  const element_type stream = p.h.dtype;
  if (p.rows < 1 || p.hidden < 1) return "rows and hidden must be at least 1";
  if (!is_16bit(x)) return "grad_out must be bf16 or fp16";
  if (!x_or_fp32(stream, x)) return "h must have grad_out's dtype or fp32";
  if (p.grad_h.data != nullptr && p.grad_h.dtype != stream) return "grad_h must have h's dtype";
  if (p.grad_x.data != nullptr && p.grad_x.dtype != x) return "grad_x must have grad_out's dtype";
  if (p.grad_residual.data != nullptr && p.grad_residual.dtype != stream) return "grad_residual must have h's dtype";
  if (p.weight.data != nullptr && !x_or_fp32(p.weight.dtype, x)) return "the weight must have x's dtype or fp32";
  if (p.grad_weight.data != nullptr && (p.weight.data == nullptr || p.grad_weight.dtype != p.weight.dtype)) {
    return "grad_weight needs the weight and has its dtype";
  }
  if (p.grad_bias.data != nullptr && !x_or_fp32(p.grad_bias.dtype, x)) return "grad_bias must have x's dtype or fp32";
  if (p.rstd == nullptr) return "rstd is required";
  if (kind == norm_kind::rms && (p.grad_bias.data != nullptr || p.dropout_p != 0)) return "rms norm has no bias or dropout";
  if (kind == norm_kind::layer && p.mean == nullptr) return "layer norm needs the mean";
  if (!(p.dropout_p >= 0 && p.dropout_p < 1)) return "dropout_p must be in [0, 1)";
  if (p.dropout_p > 0 && p.dropout_seed == nullptr) return "dropout needs a seed";
  return plan_reason(backward_plan(p), p.rows, p.hidden, x);
}

int64_t backward_workspace_floats(norm_kind kind, const backward_problem& p, int device) {
  const int arrays = (p.grad_weight.data != nullptr ? 1 : 0) + (p.grad_bias.data != nullptr ? 1 : 0);
  if (arrays == 0) return 0;
  const row_plan plan = backward_plan(p);
  const int64_t blocks = kind == norm_kind::layer ? backward_blocks_of<norm_kind::layer>(p, plan, device)
                                                  : backward_blocks_of<norm_kind::rms>(p, plan, device);
  return blocks * p.hidden * arrays;
}

cudaError_t launch_forward(norm_kind kind, const forward_problem& p, cudaStream_t stream) {
  const row_plan plan = forward_plan(p);
  return kind == norm_kind::layer ? launch_forward_of<norm_kind::layer>(p, plan, stream)
                                  : launch_forward_of<norm_kind::rms>(p, plan, stream);
}

cudaError_t launch_backward(norm_kind kind, const backward_problem& p, cudaStream_t stream) {
  const row_plan plan = backward_plan(p);
  return kind == norm_kind::layer ? launch_backward_of<norm_kind::layer>(p, plan, stream)
                                  : launch_backward_of<norm_kind::rms>(p, plan, stream);
}

}  // namespace tk::norms
