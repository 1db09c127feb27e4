// CUDA kernel of tk::fftconv (the forward) on the Monarch FFT-convolution kernels (csrc/kernels/fftconv).
//
// The entry re-checks its arguments as tk_ops.fftconv does, computes the filter's spectrum
// rfft(k, 2N) in fp32 (cuFFT; once per call, shared by the batch), and launches the table and
// convolution kernels on the current stream. u is read as stored when its rows start on 16-byte
// boundaries (any batch/head strides, unit last stride), copied otherwise; a sequence length that
// is not a power of two up to 16384 is zero-padded at the end to the next one (exact: the
// convolution is causal) and the output cut back. fp32/fp64 u, N > 16384 and other GPUs go to the
// reference twin tk::fftconv_ref, which warns once. tk::fftconv_bwd has no kernel: its reference
// serves every device.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "kernels/fftconv/fftconv.h"
#include "registration.h"

namespace {

namespace fftconv = tk::fftconv;

constexpr const char* OP = "tk::fftconv";
constexpr int64_t SHORTEST_KERNEL_SEQ_LEN = 256;  // the smallest N the kernels take; shorter u is padded to it
constexpr int64_t VECTOR_BYTES = 16;              // u's rows are read in 16-byte vectors

void check_inputs(const at::Tensor& u, const at::Tensor& k, const std::optional<at::Tensor>& D) {
  TORCH_CHECK_VALUE(u.dim() == 3, OP, ": u must be 3-D (B, H, N), got ", u.sizes());
  TORCH_CHECK_VALUE(k.dim() == 2 && k.size(0) == u.size(1), OP, ": k must be (H, L) with H = ", u.size(1), ", got ",
                    k.sizes());
  TORCH_CHECK_VALUE(k.size(1) >= 1 && k.size(1) <= u.size(2), OP, ": the filter length must be in [1, N = ",
                    u.size(2), "], got ", k.size(1));
  TORCH_CHECK_VALUE(k.device() == u.device(), OP, ": k must be on u's device ", u.device());
  if (D) {
    TORCH_CHECK_VALUE(D->dim() == 1 && D->size(0) == u.size(1), OP, ": D must be (H,), got ", D->sizes());
    TORCH_CHECK_VALUE(D->device() == u.device(), OP, ": D must be on u's device ", u.device());
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

at::Tensor fftconv_cuda(const at::Tensor& u, const at::Tensor& k, const std::optional<at::Tensor>& D) {
  check_inputs(u, k, D);
  const auto fallback = [&] { return tk::registration::fallback<&fftconv_cuda>("tk::fftconv_ref", u, k, D); };
  if (u.scalar_type() != at::kBFloat16 && u.scalar_type() != at::kHalf) return fallback();
  if (!tk::registration::runs_kernels(u) || u.numel() == 0) return fallback();
  const int64_t batch = u.size(0), heads = u.size(1), seq_len = u.size(2);
  const int64_t padded_len = kernel_seq_len(seq_len);
  const tk::element_type dtype = tk::registration::element_of(u);
  const int64_t workspace_bytes = fftconv::workspace_bytes(padded_len, heads, dtype);
  if (workspace_bytes == 0) return fallback();

  // u as the kernels read it: padded at the end to their length, or copied when its rows are not aligned.
  at::Tensor u_kernel = u;
  if (padded_len != seq_len) {
    u_kernel = at::constant_pad_nd(u, {0, padded_len - seq_len});
  } else if (!rows_aligned(u)) {
    u_kernel = u.clone(at::MemoryFormat::Contiguous);
  }
  const at::Tensor spectrum = at::fft_rfft(k.to(at::kFloat), 2 * padded_len).contiguous();
  const std::optional<at::Tensor> D32 = D ? std::optional(D->to(at::kFloat).contiguous()) : std::nullopt;
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

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) { m.impl("fftconv", &fftconv_cuda); }
