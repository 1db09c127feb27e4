// CUDA kernels of tk::fftconv and tk::fftconv_bwd on the Monarch FFT-convolution kernels
// (csrc/kernels/fftconv).
//
// The entries re-check their arguments as tk_ops.fftconv does, compute the filter's spectrum
// rfft(k, 2N) in fp32 (cuFFT; once per call, shared by the batch), and launch the kernels on the
// current stream. u (and grad) are read as stored when their rows start on 16-byte boundaries (any
// batch/head strides, unit last stride), copied otherwise; a sequence length that is not a power
// of two up to 16384 is zero-padded at the end to the next one (exact: the convolution is causal,
// and zeros past N add nothing to the correlations of the backward) and the outputs cut back.
// The backward's grad_k and grad_D come out of the kernels in fp32 and are cast to k's and D's
// dtypes. fp32 u runs the kernels with split operands (bf16 hi + lo) up to N = 8192. fp64 u, N >
// 16384 (fp32: N > 8192) and other GPUs go to the reference twins tk::fftconv_ref and
// tk::fftconv_bwd_ref, which warn once.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "kernels/fftconv/fftconv.h"
#include "registration.h"

namespace {

namespace fftconv = tk::fftconv;

constexpr const char* OP = "tk::fftconv";
constexpr const char* BACKWARD_OP = "tk::fftconv_bwd";
constexpr int64_t SHORTEST_KERNEL_SEQ_LEN = 256;  // the smallest N the kernels take; shorter u is padded to it
constexpr int64_t VECTOR_BYTES = 16;              // u's rows are read in 16-byte vectors

void check_inputs(const char* op, const at::Tensor& u, const at::Tensor& k, const std::optional<at::Tensor>& D) {
  TORCH_CHECK_VALUE(u.dim() == 3, op, ": u must be 3-D (B, H, N), got ", u.sizes());
  TORCH_CHECK_VALUE(k.dim() == 2 && k.size(0) == u.size(1), op, ": k must be (H, L) with H = ", u.size(1), ", got ",
                    k.sizes());
  TORCH_CHECK_VALUE(k.size(1) >= 1 && k.size(1) <= u.size(2), op, ": the filter length must be in [1, N = ",
                    u.size(2), "], got ", k.size(1));
  TORCH_CHECK_VALUE(k.device() == u.device(), op, ": k must be on u's device ", u.device());
  if (D) {
    TORCH_CHECK_VALUE(D->dim() == 1 && D->size(0) == u.size(1), op, ": D must be (H,), got ", D->sizes());
    TORCH_CHECK_VALUE(D->device() == u.device(), op, ": D must be on u's device ", u.device());
  }
}

bool rows_aligned(const at::Tensor& u) {
  const int64_t per_vector = VECTOR_BYTES / u.element_size();
  return reinterpret_cast<uintptr_t>(u.data_ptr()) % VECTOR_BYTES == 0 && u.stride(2) == 1 &&
         u.stride(0) % per_vector == 0 && u.stride(1) % per_vector == 0;
}

// The power of two the kernels run u of length n at.
int64_t kernel_seq_len(int64_t n) {
  int64_t padded = SHORTEST_KERNEL_SEQ_LEN;
  while (padded < n) padded *= 2;
  return padded;
}

// Whether the kernels take u at all (dtype, device, size); the launchers decide the rest (the
// sequence lengths: workspace_bytes is 0 for those they do not take).
bool kernel_inputs(const at::Tensor& u) {
  return (u.scalar_type() == at::kBFloat16 || u.scalar_type() == at::kHalf || u.scalar_type() == at::kFloat) &&
         tk::registration::runs_kernels(u) && u.numel() != 0;
}

// x as the kernels read it: padded at the end to their length, or copied when its rows are not aligned.
at::Tensor kernel_layout(const at::Tensor& x, int64_t padded_len) {
  if (padded_len != x.size(2)) return at::constant_pad_nd(x, {0, padded_len - x.size(2)});
  return rows_aligned(x) ? x : x.clone(at::MemoryFormat::Contiguous);
}

// rfft(k, 2 padded_len) in fp32: (H, padded_len + 1) complex, read as (re, im) float pairs.
at::Tensor filter_spectrum(const at::Tensor& k, int64_t padded_len) {
  return at::fft_rfft(k.to(at::kFloat), 2 * padded_len).contiguous();
}

std::optional<at::Tensor> fp32_skip(const std::optional<at::Tensor>& D) {
  return D ? std::optional(D->to(at::kFloat).contiguous()) : std::nullopt;
}

at::Tensor fftconv_cuda(const at::Tensor& u, const at::Tensor& k, const std::optional<at::Tensor>& D) {
  check_inputs(OP, u, k, D);
  const auto fallback = [&] { return tk::registration::fallback<&fftconv_cuda>("tk::fftconv_ref", u, k, D); };
  if (!kernel_inputs(u)) return fallback();
  const int64_t batch = u.size(0), heads = u.size(1), seq_len = u.size(2);
  const int64_t padded_len = kernel_seq_len(seq_len);
  const tk::element_type dtype = tk::registration::element_of(u);
  const int64_t workspace_bytes = fftconv::workspace_bytes(padded_len, heads, dtype);
  if (workspace_bytes == 0) return fallback();

  const at::Tensor u_kernel = kernel_layout(u, padded_len);
  const at::Tensor spectrum = filter_spectrum(k, padded_len);
  const std::optional<at::Tensor> D32 = fp32_skip(D);
  at::Tensor workspace = at::empty({workspace_bytes}, u.options().dtype(at::kByte));
  at::Tensor y = at::empty({batch, heads, padded_len}, u.options().memory_format(at::MemoryFormat::Contiguous));

  fftconv::forward_problem p{};
  p.dtype = dtype;
  p.u = u_kernel.data_ptr();
  p.batch = batch;
  p.heads = heads;
  p.seq_len = padded_len;
  p.u_batch_stride = u_kernel.stride(0);
  p.u_head_stride = u_kernel.stride(1);
  p.spectrum = reinterpret_cast<const float*>(spectrum.data_ptr());
  p.spectrum_head_stride = spectrum.stride(0);
  p.D = D32 ? D32->data_ptr<float>() : nullptr;
  p.y = y.data_ptr();
  p.workspace = workspace.data_ptr();
  TORCH_INTERNAL_ASSERT(rows_aligned(u_kernel), OP, ": u's rows must be aligned for the kernel by now");
  if (!fftconv::unsupported_reason(p).empty()) return fallback();
  tk::registration::launch_on(u, [&](cudaStream_t stream) { return fftconv::launch(p, stream); });
  return padded_len == seq_len ? y : y.narrow(2, 0, seq_len).contiguous();
}

using backward_outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

backward_outputs fftconv_bwd_cuda(const at::Tensor& grad, const at::Tensor& u, const at::Tensor& k,
                                  const std::optional<at::Tensor>& D) {
  check_inputs(BACKWARD_OP, u, k, D);
  TORCH_CHECK_VALUE(grad.sizes() == u.sizes(), BACKWARD_OP, ": grad must have u's shape ", u.sizes(), ", got ",
                    grad.sizes());
  TORCH_CHECK_TYPE(grad.scalar_type() == u.scalar_type(), BACKWARD_OP, ": grad must have u's dtype ", u.scalar_type(),
                   ", got ", grad.scalar_type());
  TORCH_CHECK_VALUE(grad.device() == u.device(), BACKWARD_OP, ": grad must be on u's device ", u.device());
  const auto fallback = [&] {
    return tk::registration::fallback<&fftconv_bwd_cuda>("tk::fftconv_bwd_ref", grad, u, k, D);
  };
  if (!kernel_inputs(u)) return fallback();
  const int64_t batch = u.size(0), heads = u.size(1), seq_len = u.size(2), filter_len = k.size(1);
  const int64_t padded_len = kernel_seq_len(seq_len);
  const tk::element_type dtype = tk::registration::element_of(u);
  const int64_t workspace_bytes = fftconv::workspace_bytes(padded_len, heads, dtype);
  if (workspace_bytes == 0) return fallback();

  const at::Tensor grad_kernel = kernel_layout(grad, padded_len);
  const at::Tensor u_kernel = kernel_layout(u, padded_len);
  const at::Tensor spectrum = filter_spectrum(k, padded_len);
  const std::optional<at::Tensor> D32 = fp32_skip(D);
  const at::TensorOptions fp32 = u.options().dtype(at::kFloat);
  at::Tensor workspace = at::empty({workspace_bytes}, u.options().dtype(at::kByte));
  at::Tensor grad_u = at::empty({batch, heads, padded_len}, u.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor grad_k32 = at::empty({heads, padded_len}, fp32);
  at::Tensor grad_D32 = at::empty({D ? heads : 0}, fp32);

  fftconv::backward_problem p{};
  p.dtype = dtype;
  p.grad = grad_kernel.data_ptr();
  p.grad_batch_stride = grad_kernel.stride(0);
  p.grad_head_stride = grad_kernel.stride(1);
  p.u = u_kernel.data_ptr();
  p.u_batch_stride = u_kernel.stride(0);
  p.u_head_stride = u_kernel.stride(1);
  p.batch = batch;
  p.heads = heads;
  p.seq_len = padded_len;
  p.filter_len = filter_len;
  p.spectrum = reinterpret_cast<const float*>(spectrum.data_ptr());
  p.spectrum_head_stride = spectrum.stride(0);
  p.D = D32 ? D32->data_ptr<float>() : nullptr;
  p.grad_u = grad_u.data_ptr();
  p.grad_k = grad_k32.data_ptr<float>();
  p.grad_D = D ? grad_D32.data_ptr<float>() : nullptr;
  p.workspace = workspace.data_ptr();
  TORCH_INTERNAL_ASSERT(rows_aligned(u_kernel) && rows_aligned(grad_kernel), BACKWARD_OP,
                        ": the rows of u and grad must be aligned for the kernel by now");
  if (!fftconv::unsupported_reason(p).empty()) return fallback();
  tk::registration::launch_on(u, [&](cudaStream_t stream) { return fftconv::launch(p, stream); });
  return {padded_len == seq_len ? grad_u : grad_u.narrow(2, 0, seq_len).contiguous(),
          grad_k32.narrow(1, 0, filter_len).to(k.scalar_type()).contiguous(),
          D ? grad_D32.to(D->scalar_type()) : u.new_empty({0})};
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("fftconv", &fftconv_cuda);
  m.impl("fftconv_bwd", &fftconv_bwd_cuda);
}
