// CUDA kernel of tk::mamba2_ssd (the forward) on the Hopper SSD kernel (csrc/kernels/mamba2_ssd).
//
// The entry re-checks its arguments as tk_ops.mamba2_ssd does, describes x, B, C, z to the kernel
// as they are stored (any strides with a unit last stride: (Bt, L, H, P) is read as (Bt, H, L, P)
// with no copy), brings dt, A, D, dt_bias and initial_states to fp32 (what the reference computes
// in for 16-bit x; a no-op when they already are) and launches on the current stream. What the
// kernel cannot take (fp32/fp64 x, P != 64, N outside {64, 128}, chunk_size outside {64, 128, 256},
// another GPU, strides TMA cannot describe) goes to the reference twin tk::mamba2_ssd_ref, which
// warns once. tk::mamba2_ssd_bwd has no kernel: its reference serves every device.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <utility>

#include "kernels/mamba2_ssd/mamba2_ssd.h"
#include "registration.h"

namespace {

namespace mamba2 = tk::mamba2;
using outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using optional_tensor = std::optional<at::Tensor>;

constexpr const char* OP = "tk::mamba2_ssd";

void check_inputs(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                  const at::Tensor& C, int64_t chunk_size, const optional_tensor& D, const optional_tensor& z,
                  const optional_tensor& dt_bias, const optional_tensor& initial_states) {
  TORCH_CHECK_VALUE(x.dim() == 4, OP, ": x must be 4-D (Bt, L, H, P), got ", x.sizes());
  TORCH_CHECK_VALUE(dt.dim() == 3, OP, ": dt must be 3-D (Bt, L, H), got ", dt.sizes());
  TORCH_CHECK_VALUE(A.dim() == 1, OP, ": A must be 1-D (H,), got ", A.sizes());
  TORCH_CHECK_VALUE(B.dim() == 4, OP, ": B must be 4-D (Bt, L, G, N), got ", B.sizes());
  TORCH_CHECK_VALUE(C.sizes() == B.sizes(), OP, ": C must have B's shape ", B.sizes(), ", got ", C.sizes());
  TORCH_CHECK_VALUE(chunk_size > 0, OP, ": chunk_size must be positive, got ", chunk_size);
  const int64_t batch = x.size(0), seqlen = x.size(1), heads = x.size(2), head_dim = x.size(3);
  const int64_t groups = B.size(2), state_size = B.size(3);
  TORCH_CHECK_VALUE(dt.size(0) == batch && dt.size(1) == seqlen && dt.size(2) == heads, OP,
                    ": dt must be (Bt, L, H) with x's Bt, L, H, got ", dt.sizes());
  TORCH_CHECK_VALUE(A.size(0) == heads, OP, ": A must have H = ", heads, " entries, got ", A.sizes());
  TORCH_CHECK_VALUE(B.size(0) == batch && B.size(1) == seqlen, OP, ": B must be (Bt, L, G, N) with x's Bt, L, got ",
                    B.sizes());
  TORCH_CHECK_VALUE(groups > 0 && heads % groups == 0, OP, ": the heads H (", heads,
                    ") must be a multiple of the groups G (", groups, ")");
  for (const auto& [name, t] : {std::pair{"B", &B}, std::pair{"C", &C}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == x.scalar_type(), OP, ": ", name, " must have x's dtype ", x.scalar_type());
  }
  if (z) {
    TORCH_CHECK_VALUE(z->sizes() == x.sizes(), OP, ": z must have x's shape ", x.sizes(), ", got ", z->sizes());
    TORCH_CHECK_TYPE(z->scalar_type() == x.scalar_type(), OP, ": z must have x's dtype ", x.scalar_type());
  }
  if (D) {
    const bool per_head = D->dim() == 1 && D->size(0) == heads;
    const bool per_channel = D->dim() == 2 && D->size(0) == heads && D->size(1) == head_dim;
    TORCH_CHECK_VALUE(per_head || per_channel, OP, ": D must be (H,) or (H, P), got ", D->sizes());
  }
  if (dt_bias) {
    TORCH_CHECK_VALUE(dt_bias->dim() == 1 && dt_bias->size(0) == heads, OP, ": dt_bias must be (H,), got ",
                      dt_bias->sizes());
  }
  if (initial_states) {
    TORCH_CHECK_VALUE(initial_states->sizes() == at::IntArrayRef({batch, heads, head_dim, state_size}), OP,
                      ": initial_states must be (Bt, H, P, N), got ", initial_states->sizes());
  }
  for (const optional_tensor& t : {optional_tensor(dt), optional_tensor(A), optional_tensor(B), optional_tensor(C), D,
                                   z, dt_bias, initial_states}) {
    if (t) TORCH_CHECK_VALUE(t->device() == x.device(), OP, ": every tensor must be on x's device ", x.device());
  }
}

// The kernel's (Bt, heads, L, D) view of a (Bt, L, heads, D) tensor, or nothing without a unit last stride.
std::optional<tk::heads_view> view_of(const at::Tensor& t) {
  if (t.stride(3) != 1 && t.size(3) > 1) return std::nullopt;
  return tk::heads_view{t.data_ptr(), t.size(0), t.size(2), t.size(1), t.size(3), t.stride(0), t.stride(2), t.stride(1)};
}

at::Tensor fp32_contiguous(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

outputs mamba2_ssd_cuda(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                        const at::Tensor& C, int64_t chunk_size, const optional_tensor& D, const optional_tensor& z,
                        const optional_tensor& dt_bias, bool dt_softplus, const optional_tensor& initial_states) {
  check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states);
  const auto fallback = [&] {
    return tk::registration::fallback<&mamba2_ssd_cuda>("tk::mamba2_ssd_ref", x, dt, A, B, C, chunk_size, D, z,
                                                         dt_bias, dt_softplus, initial_states);
  };
  const at::ScalarType dtype = x.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return fallback();
  if (!tk::registration::runs_kernels(x) || x.numel() == 0 || B.numel() == 0) return fallback();
  if (chunk_size > (int64_t(1) << 30)) return fallback();
  const auto xv = view_of(x), bv = view_of(B), cv = view_of(C);
  const std::optional<tk::heads_view> zv = z ? view_of(*z) : std::optional<tk::heads_view>(tk::heads_view{});
  if (!xv || !bv || !cv || !zv) return fallback();

  mamba2::ssd_forward_problem p{};
  p.dtype = tk::registration::element_of(x);
  p.x = *xv;
  p.B = *bv;
  p.C = *cv;
  p.z = *zv;
  p.chunk_size = int(chunk_size);
  p.dt_softplus = dt_softplus;
  p.D_per_channel = D && D->dim() == 2;
  if (!mamba2::unsupported_reason(p).empty()) return fallback();

  // fp32 copies of the small inputs (no copy when they already are), kept alive through the launch.
  const at::Tensor dt32 = dt.to(at::kFloat);
  const at::Tensor A32 = fp32_contiguous(A);
  const std::optional<at::Tensor> D32 = D ? std::optional(fp32_contiguous(*D)) : std::nullopt;
  const std::optional<at::Tensor> bias32 = dt_bias ? std::optional(fp32_contiguous(*dt_bias)) : std::nullopt;
  const std::optional<at::Tensor> initial32 =
      initial_states ? std::optional(fp32_contiguous(*initial_states)) : std::nullopt;
  p.dt = dt32.data_ptr<float>();
  p.dt_batch_stride = dt32.stride(0);
  p.dt_row_stride = dt32.stride(1);
  p.dt_head_stride = dt32.stride(2);
  p.A = A32.data_ptr<float>();
  p.D = D32 ? D32->data_ptr<float>() : nullptr;
  p.dt_bias = bias32 ? bias32->data_ptr<float>() : nullptr;
  p.initial_states = initial32 ? initial32->data_ptr<float>() : nullptr;

  const int64_t batch = x.size(0), seqlen = x.size(1), heads = x.size(2), head_dim = x.size(3);
  const int64_t state_size = B.size(3), chunks = (seqlen + chunk_size - 1) / chunk_size;
  const at::TensorOptions states = x.options().dtype(at::kFloat);
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor final_states = at::empty({batch, heads, head_dim, state_size}, states);
  at::Tensor chunk_states = at::empty({batch, chunks, heads, head_dim, state_size}, states);
  p.y = y.data_ptr();
  p.final_states = final_states.data_ptr<float>();
  p.chunk_states = chunk_states.data_ptr<float>();
  tk::registration::launch_on(x, [&](cudaStream_t stream) { return mamba2::launch(p, stream); });
  return {y, final_states, chunk_states};
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) { m.impl("mamba2_ssd", &mamba2_ssd_cuda); }
