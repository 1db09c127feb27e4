// CUDA kernels of tk::mamba2_ssd and tk::mamba2_ssd_bwd on the Hopper SSD kernels
// (csrc/kernels/mamba2_ssd).
//
// Each entry re-checks its arguments as tk_ops.mamba2_ssd does, describes x, B, C, z (and grad_y) to
// the kernels as they are stored (any strides with a unit last stride: (Bt, L, H, P) is read as
// (Bt, H, L, P) with no copy), brings dt, A, D, dt_bias, initial_states (and chunk_states,
// grad_final_states) to fp32 (what the reference computes in for 16-bit x; a no-op when they
// already are) and launches on the current stream. The backward's kernels leave grad_A, grad_D and
// grad_dt_bias as per-(batch, head) sums, which are summed here over the batch (and, for D of shape
// (H,), over the channels), and its fp32 grad_dt and grad_initial_states are cast to their inputs'
// dtypes. What the kernels cannot take (fp32/fp64 x, P != 64, N outside {64, 128}, chunk_size
// outside {64, 128, 256}, another GPU, strides TMA cannot describe) goes to the reference twins
// tk::mamba2_ssd_ref and tk::mamba2_ssd_bwd_ref, which warn once.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>

#include "kernels/mamba2_ssd/mamba2_ssd.h"
#include "registration.h"

namespace {

namespace mamba2 = tk::mamba2;
using outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using gradients = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                             at::Tensor, at::Tensor>;
using optional_tensor = std::optional<at::Tensor>;

constexpr const char* OP = "tk::mamba2_ssd";
constexpr const char* BWD_OP = "tk::mamba2_ssd_bwd";

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                  const at::Tensor& C, int64_t chunk_size, const optional_tensor& D, const optional_tensor& z,
                  const optional_tensor& dt_bias, const optional_tensor& initial_states) {
  TORCH_CHECK_VALUE(x.dim() == 4, op, ": x must be 4-D (Bt, L, H, P), got ", x.sizes());
  TORCH_CHECK_VALUE(dt.dim() == 3, op, ": dt must be 3-D (Bt, L, H), got ", dt.sizes());
  TORCH_CHECK_VALUE(A.dim() == 1, op, ": A must be 1-D (H,), got ", A.sizes());
  TORCH_CHECK_VALUE(B.dim() == 4, op, ": B must be 4-D (Bt, L, G, N), got ", B.sizes());
  TORCH_CHECK_VALUE(C.sizes() == B.sizes(), op, ": C must have B's shape ", B.sizes(), ", got ", C.sizes());
  TORCH_CHECK_VALUE(chunk_size > 0, op, ": chunk_size must be positive, got ", chunk_size);
  const int64_t batch = x.size(0), seqlen = x.size(1), heads = x.size(2), head_dim = x.size(3);
  const int64_t groups = B.size(2), state_size = B.size(3);
  TORCH_CHECK_VALUE(dt.size(0) == batch && dt.size(1) == seqlen && dt.size(2) == heads, op,
                    ": dt must be (Bt, L, H) with x's Bt, L, H, got ", dt.sizes());
  TORCH_CHECK_VALUE(A.size(0) == heads, op, ": A must have H = ", heads, " entries, got ", A.sizes());
  TORCH_CHECK_VALUE(B.size(0) == batch && B.size(1) == seqlen, op, ": B must be (Bt, L, G, N) with x's Bt, L, got ",
                    B.sizes());
  TORCH_CHECK_VALUE(groups > 0 && heads % groups == 0, op, ": the heads H (", heads,
                    ") must be a multiple of the groups G (", groups, ")");
  for (const auto& [name, t] : {std::pair{"B", &B}, std::pair{"C", &C}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype ", x.scalar_type());
  }
  if (z) {
    TORCH_CHECK_VALUE(z->sizes() == x.sizes(), op, ": z must have x's shape ", x.sizes(), ", got ", z->sizes());
    TORCH_CHECK_TYPE(z->scalar_type() == x.scalar_type(), op, ": z must have x's dtype ", x.scalar_type());
  }
  if (D) {
    const bool per_head = D->dim() == 1 && D->size(0) == heads;
    const bool per_channel = D->dim() == 2 && D->size(0) == heads && D->size(1) == head_dim;
    TORCH_CHECK_VALUE(per_head || per_channel, op, ": D must be (H,) or (H, P), got ", D->sizes());
  }
  if (dt_bias) {
    TORCH_CHECK_VALUE(dt_bias->dim() == 1 && dt_bias->size(0) == heads, op, ": dt_bias must be (H,), got ",
                      dt_bias->sizes());
  }
  if (initial_states) {
    TORCH_CHECK_VALUE(initial_states->sizes() == at::IntArrayRef({batch, heads, head_dim, state_size}), op,
                      ": initial_states must be (Bt, H, P, N), got ", initial_states->sizes());
  }
  for (const optional_tensor& t : {optional_tensor(dt), optional_tensor(A), optional_tensor(B), optional_tensor(C), D,
                                   z, dt_bias, initial_states}) {
    if (t) TORCH_CHECK_VALUE(t->device() == x.device(), op, ": every tensor must be on x's device ", x.device());
  }
}

// The kernel's (Bt, heads, L, D) view of a (Bt, L, heads, D) tensor, or nothing without a unit last stride.
std::optional<tk::heads_view> view_of(const at::Tensor& t) {
  if (t.stride(3) != 1 && t.size(3) > 1) return std::nullopt;
  return tk::heads_view{t.data_ptr(), t.size(0), t.size(2), t.size(1), t.size(3), t.stride(0), t.stride(2), t.stride(1)};
}

at::Tensor fp32_contiguous(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

std::optional<at::Tensor> fp32_contiguous(const optional_tensor& t) {
  return t ? std::optional(fp32_contiguous(*t)) : std::nullopt;
}

const float* data_or_null(const std::optional<at::Tensor>& t) { return t ? t->data_ptr<float>() : nullptr; }

// The forward problem of the inputs and the fp32 copies of the small ones it points into (no copy
// when they already are fp32; kept alive through the launch), or nothing when no kernel takes them.
struct forward_plan {
  mamba2::ssd_forward_problem problem;
  at::Tensor dt32, A32;
  std::optional<at::Tensor> D32, bias32, initial32;
};

std::optional<forward_plan> plan_forward(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                                         const at::Tensor& B, const at::Tensor& C, int64_t chunk_size,
                                         const optional_tensor& D, const optional_tensor& z,
                                         const optional_tensor& dt_bias, bool dt_softplus,
                                         const optional_tensor& initial_states) {
  const at::ScalarType dtype = x.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return std::nullopt;
  if (!tk::registration::runs_kernels(x) || x.numel() == 0 || B.numel() == 0) return std::nullopt;
  if (chunk_size > std::numeric_limits<int>::max()) return std::nullopt;  // the plan holds it as an int
  const auto xv = view_of(x), bv = view_of(B), cv = view_of(C);
  const std::optional<tk::heads_view> zv = z ? view_of(*z) : std::optional<tk::heads_view>(tk::heads_view{});
  if (!xv || !bv || !cv || !zv) return std::nullopt;

  forward_plan plan;
  mamba2::ssd_forward_problem& p = plan.problem;
  p = mamba2::ssd_forward_problem{};
  p.dtype = tk::registration::element_of(x);
  p.x = *xv;
  p.B = *bv;
  p.C = *cv;
  p.z = *zv;
  p.chunk_size = int(chunk_size);
  p.dt_softplus = dt_softplus;
  p.D_per_channel = D && D->dim() == 2;
  if (!mamba2::unsupported_reason(p).empty()) return std::nullopt;

  plan.dt32 = dt.to(at::kFloat);
  plan.A32 = fp32_contiguous(A);
  plan.D32 = fp32_contiguous(D);
  plan.bias32 = fp32_contiguous(dt_bias);
  plan.initial32 = fp32_contiguous(initial_states);
  p.dt = {plan.dt32.data_ptr<float>(), plan.dt32.stride(0), plan.dt32.stride(1), plan.dt32.stride(2)};
  p.A = plan.A32.data_ptr<float>();
  p.D = data_or_null(plan.D32);
  p.dt_bias = data_or_null(plan.bias32);
  p.initial_states = data_or_null(plan.initial32);
  return plan;
}

outputs mamba2_ssd_cuda(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                        const at::Tensor& C, int64_t chunk_size, const optional_tensor& D, const optional_tensor& z,
                        const optional_tensor& dt_bias, bool dt_softplus, const optional_tensor& initial_states) {
  check_inputs(OP, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states);
  const auto fallback = [&] {
    return tk::registration::fallback<&mamba2_ssd_cuda>("tk::mamba2_ssd_ref", x, dt, A, B, C, chunk_size, D, z,
                                                         dt_bias, dt_softplus, initial_states);
  };
  std::optional<forward_plan> plan = plan_forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states);
  if (!plan) return fallback();
  mamba2::ssd_forward_problem& p = plan->problem;

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

gradients mamba2_ssd_bwd_cuda(const at::Tensor& grad_y, const optional_tensor& grad_final_states, const at::Tensor& x,
                              const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                              int64_t chunk_size, const optional_tensor& D, const optional_tensor& z,
                              const optional_tensor& dt_bias, bool dt_softplus, const optional_tensor& initial_states,
                              const at::Tensor& chunk_states) {
  check_inputs(BWD_OP, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states);
  const int64_t batch = x.size(0), seqlen = x.size(1), heads = x.size(2), head_dim = x.size(3);
  const int64_t state_size = B.size(3), chunks = (seqlen + chunk_size - 1) / chunk_size;
  const std::array<int64_t, 4> state_shape{batch, heads, head_dim, state_size};
  TORCH_CHECK_VALUE(grad_y.sizes() == x.sizes(), BWD_OP, ": grad_y must have x's shape ", x.sizes(), ", got ",
                    grad_y.sizes());
  TORCH_CHECK_VALUE(chunk_states.sizes() == at::IntArrayRef({batch, chunks, heads, head_dim, state_size}), BWD_OP,
                    ": chunk_states must be (Bt, ceil(L / chunk_size), H, P, N), got ", chunk_states.sizes());
  if (grad_final_states) {
    TORCH_CHECK_VALUE(grad_final_states->sizes() == at::IntArrayRef(state_shape), BWD_OP,
                      ": grad_final_states must be (Bt, H, P, N), got ", grad_final_states->sizes());
  }
  for (const optional_tensor& t : {optional_tensor(grad_y), grad_final_states, optional_tensor(chunk_states)}) {
    if (t) TORCH_CHECK_VALUE(t->device() == x.device(), BWD_OP, ": every tensor must be on x's device ", x.device());
  }
  const auto fallback = [&] {
    return tk::registration::fallback<&mamba2_ssd_bwd_cuda>("tk::mamba2_ssd_bwd_ref", grad_y, grad_final_states, x, dt,
                                                             A, B, C, chunk_size, D, z, dt_bias, dt_softplus,
                                                             initial_states, chunk_states);
  };
  if (grad_y.scalar_type() != x.scalar_type()) return fallback();
  std::optional<forward_plan> plan = plan_forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states);
  if (!plan) return fallback();

  mamba2::ssd_backward_problem p{};
  p.forward = plan->problem;
  // grad_y is read in place when TMA can; autograd often hands over an expanded one (the gradient of
  // a sum, stride 0) or another layout, which the kernels read as a contiguous copy.
  const auto takes = [&](const at::Tensor& g) {
    const std::optional<tk::heads_view> gv = view_of(g);
    if (gv) p.grad_y = *gv;
    return gv && mamba2::unsupported_reason(p).empty();
  };
  at::Tensor grad_y_read = grad_y;
  if (!takes(grad_y_read)) {
    grad_y_read = grad_y.contiguous();
    if (!takes(grad_y_read)) return fallback();
  }

  const at::Tensor chunk32 = fp32_contiguous(chunk_states);
  const std::optional<at::Tensor> grad_final32 = fp32_contiguous(grad_final_states);
  p.chunk_states = chunk32.data_ptr<float>();
  p.grad_final_states = data_or_null(grad_final32);

  const at::TensorOptions floats = x.options().dtype(at::kFloat);
  const auto contiguous = [](const at::Tensor& like) {
    return at::empty(like.sizes(), like.options().memory_format(at::MemoryFormat::Contiguous));
  };
  at::Tensor grad_x = contiguous(x), grad_B = contiguous(B), grad_C = contiguous(C);
  at::Tensor grad_z = z ? contiguous(*z) : at::empty({0}, x.options());
  at::Tensor grad_dt32 = at::empty({batch, seqlen, heads}, floats);
  at::Tensor grad_initial32 = initial_states ? at::empty(state_shape, floats) : at::empty({0}, floats);
  at::Tensor grad_A_partial = at::empty({batch, heads}, floats);
  at::Tensor grad_dt_bias_partial = at::empty({batch, heads}, floats);
  at::Tensor grad_D_partial = at::empty({D ? batch : 0, heads, head_dim}, floats);
  at::Tensor workspace =
      at::empty({mamba2::backward_workspace_floats(batch, heads, seqlen, state_size)}, floats);
  p.grad_x = grad_x.data_ptr();
  p.grad_z = z ? grad_z.data_ptr() : nullptr;
  p.grad_B = grad_B.data_ptr();
  p.grad_C = grad_C.data_ptr();
  p.grad_dt = grad_dt32.data_ptr<float>();
  p.grad_initial_states = initial_states ? grad_initial32.data_ptr<float>() : nullptr;
  p.grad_A_partial = grad_A_partial.data_ptr<float>();
  p.grad_dt_bias_partial = grad_dt_bias_partial.data_ptr<float>();
  p.grad_D_partial = D ? grad_D_partial.data_ptr<float>() : nullptr;
  p.workspace = workspace.data_ptr<float>();
  tk::registration::launch_on(x, [&](cudaStream_t stream) { return mamba2::launch(p, stream); });

  // As the reference: grad_A and grad_dt_bias in fp32, the others in their inputs' dtypes.
  const at::Tensor none = at::empty({0}, x.options());
  const at::Tensor grad_D =
      D ? (D->dim() == 2 ? grad_D_partial.sum(0) : grad_D_partial.sum(at::IntArrayRef({0, 2}))).to(D->scalar_type())
        : none;
  return {grad_x,
          grad_dt32.to(dt.scalar_type()),
          grad_A_partial.sum(0),
          grad_B,
          grad_C,
          grad_D,
          grad_z,
          dt_bias ? grad_dt_bias_partial.sum(0) : none,
          initial_states ? grad_initial32.to(initial_states->scalar_type()) : none};
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("mamba2_ssd", &mamba2_ssd_cuda);
  m.impl("mamba2_ssd_bwd", &mamba2_ssd_bwd_cuda);
}
