// What every CUDA-key registration shares: which devices run our kernels, the kernels' name for a
// tensor's dtype, the launch on the current stream, and the way back to the op's reference twin
// tk::<op>_ref for inputs no kernel takes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

#include "tk/element_type.h"

namespace tk::registration {

// The extension is built for sm_90a only (see setup.py), so exactly compute capability 9.0 runs it.
constexpr int KERNEL_MAJOR = 9;
constexpr int KERNEL_MINOR = 0;

namespace detail {

inline bool is_kernel_device(int device) {
  int major_version = 0, minor_version = 0;
  if (cudaDeviceGetAttribute(&major_version, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&minor_version, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return false;
  return major_version == KERNEL_MAJOR && minor_version == KERNEL_MINOR;
}

}  // namespace detail

// Whether t's device runs our kernels. Every op asks on every call: the answer is read from the
// driver once per device (a device's compute capability never changes).
inline bool runs_kernels(const at::Tensor& t) {
  if (!t.is_cuda()) return false;
  constexpr int CACHED_DEVICES = 64;
  enum : uint8_t { unknown, kernels, no_kernels };
  static std::array<std::atomic<uint8_t>, CACHED_DEVICES> answers{};
  const int device = t.get_device();
  if (device < 0 || device >= CACHED_DEVICES) return detail::is_kernel_device(device);
  uint8_t answer = answers[device].load(std::memory_order_relaxed);
  if (answer == unknown) {
    answer = detail::is_kernel_device(device) ? kernels : no_kernels;
    answers[device].store(answer, std::memory_order_relaxed);
  }
  return answer == kernels;
}

namespace detail {

inline std::optional<element_type> element_type_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return element_type::bf16;
    case at::kHalf: return element_type::fp16;
    case at::kFloat: return element_type::fp32;
    default: return std::nullopt;
  }
}

// The CUDA impl's own signature, so the reference twin is looked up (and called) exactly as the
// dispatcher calls the impl; one handle per impl, found on its first fallback.
template <auto CUDA_IMPL, typename Signature = std::remove_pointer_t<decltype(CUDA_IMPL)>>
struct reference_twin;

template <auto CUDA_IMPL, typename Result, typename... Parameters>
struct reference_twin<CUDA_IMPL, Result(Parameters...)> {
  static Result call(const char* name, Parameters... args) {
    static const auto twin = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Result(Parameters...)>();
    return twin.call(args...);
  }
};

}  // namespace detail

// Whether some kernel takes t's dtype (bf16, fp16, fp32); others go to the reference twin.
inline bool has_element_type(const at::Tensor& t) { return detail::element_type_of(t.scalar_type()).has_value(); }

// The kernels' element type of t, whose dtype the caller has checked (has_element_type, or a
// narrower test such as bf16/fp16 only).
inline element_type element_of(const at::Tensor& t) {
  const std::optional<element_type> e = detail::element_type_of(t.scalar_type());
  TORCH_INTERNAL_ASSERT(e.has_value(), "no kernel takes ", t.scalar_type(), ": check the dtype before element_of");
  return *e;
}

// Runs `launch(stream)` (a kernel launcher returning its cudaError_t) with `like`'s device current,
// on that device's current stream, and raises the error it returns.
template <typename Launch>
void launch_on(const at::Tensor& like, Launch&& launch) {
  const c10::cuda::CUDAGuard guard(like.device());
  C10_CUDA_CHECK(std::forward<Launch>(launch)(c10::cuda::getCurrentCUDAStream(like.get_device()).stream()));
}

// The answer of the op's Python-defined reference twin (same schema; it warns once when it serves
// a GPU), for inputs no kernel takes. CUDA_IMPL is the calling impl and `args` its own arguments:
//   return registration::fallback<&matmul_cuda>("tk::matmul_ref", a, b);
template <auto CUDA_IMPL, typename... Args>
auto fallback(const char* reference_name, Args&&... args) {
  return detail::reference_twin<CUDA_IMPL>::call(reference_name, std::forward<Args>(args)...);
}

}  // namespace tk::registration
