// The RMSNorm backward kernels: every dtype and row-access variant of norm_backward.cuh.
#include "norm_backward.cuh"

namespace tk::norms {

template cudaError_t launch_backward_of<norm_kind::rms>(const backward_problem&, const row_plan&, cudaStream_t);
template int64_t backward_blocks_of<norm_kind::rms>(const backward_problem&, const row_plan&, int);

}  // namespace tk::norms
