#pragma once

#include "kernels/gemm/gemm.h"

namespace tk::gemm::tuning {

int candidates();
const char* candidate_name(int i);
// bf16, no bias; the problem as for tk::gemm::launch.
cudaError_t launch_candidate(int i, const problem& p, cudaStream_t stream);

}  // namespace tk::gemm::tuning
