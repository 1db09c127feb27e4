// The element types kernels are instantiated for, as launchers and the torch glue name them at run
// time. Plain C++ (no CUDA headers), so launcher headers and csrc/torch include it; the tile core
// maps each to its C++ type with element_t (common.cuh).
#pragma once

namespace tk {

enum class element_type { bf16, fp16, fp32 };

// Bytes of one element.
constexpr int element_bytes(element_type e) { return e == element_type::fp32 ? 4 : 2; }

}  // namespace tk
