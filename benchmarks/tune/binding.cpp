// Python access to the candidate GEMM plans (benchmarks/tune_gemm.py).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "gemm_plans.h"

namespace {

// C = A B with candidate plan `i`; a and b row- or column-major bf16 matrices TMA can describe.
at::Tensor run(int64_t i, const at::Tensor& a, const at::Tensor& b) {
  using tk::gemm::major;
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16);
  const bool a_row_major = a.stride(1) == 1, b_row_major = b.stride(1) == 1;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  at::Tensor c = at::empty({m, n}, a.options());
  tk::gemm::problem p{tk::gemm::element_type::bf16, m, n, k,
                      a_row_major ? tk::gemm::stored_matrix{a.data_ptr(), m, k, a.stride(0)}
                                  : tk::gemm::stored_matrix{a.data_ptr(), k, m, a.stride(1)},
                      a_row_major ? major::k : major::mn,
                      b_row_major ? tk::gemm::stored_matrix{b.data_ptr(), k, n, b.stride(0)}
                                  : tk::gemm::stored_matrix{b.data_ptr(), n, k, b.stride(1)},
                      b_row_major ? major::mn : major::k, c.data_ptr(), n, nullptr};
  C10_CUDA_CHECK(tk::gemm::tuning::launch_candidate(int(i), p, c10::cuda::getCurrentCUDAStream().stream()));
  return c;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("candidates", &tk::gemm::tuning::candidates);
  m.def("candidate_name", &tk::gemm::tuning::candidate_name);
  m.def("run", &run);
}
