// The LayerNorm forward kernels: every dtype and row-access variant of norm_forward.cuh.
#include "norm_forward.cuh"

namespace tk::norms {

template cudaError_t launch_forward_of<norm_kind::layer>(const forward_problem&, const row_plan&, cudaStream_t);

}  // namespace tk::norms
