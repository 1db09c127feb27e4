// What every CUDA-key registration shares: which devices run our kernels, and the way back to the
// op's reference twin tk::<op>_ref for inputs no kernel takes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cuda_runtime_api.h>

namespace tk::registration {

// The extension is built for sm_90a only (see setup.py), so exactly compute capability 9.0 runs it.
constexpr int KERNEL_MAJOR = 9;
constexpr int KERNEL_MINOR = 0;

inline bool runs_kernels(const at::Tensor& t) {
  if (!t.is_cuda()) return false;
  int major_version = 0, minor_version = 0;
  const int device = t.get_device();
  if (cudaDeviceGetAttribute(&major_version, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&minor_version, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return false;
  return major_version == KERNEL_MAJOR && minor_version == KERNEL_MINOR;
}

// The Python-defined reference twin of an op (same schema), which warns once when it serves a GPU.
template <typename Signature>
c10::TypedOperatorHandle<Signature> reference(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace tk::registration
