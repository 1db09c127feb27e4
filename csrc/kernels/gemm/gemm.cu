// GEMM instantiations: every variant of gemm_kernel, and the dispatch of gemm.h onto them.
#include <array>
#include <utility>

#include "gemm.cuh"

namespace tk::gemm {
namespace {

// Every variant axis in one place: element type, A major-ness, B major-ness, bias.
constexpr int VARIANTS = 16;

int variant_index(const problem& p) {
  return (p.dtype == element_type::fp16 ? 1 : 0) | (p.a_major == major::mn ? 2 : 0) |
         (p.b_major == major::mn ? 4 : 0) | (p.bias != nullptr ? 8 : 0);
}

template <int V>
using variant_kernel = gemm_kernel<std::conditional_t<(V & 1) != 0, half, bf16>,
                                   (V & 2) != 0 ? operand_major::mn : operand_major::k,
                                   (V & 4) != 0 ? operand_major::mn : operand_major::k, (V & 8) != 0>;

template <int... V>
constexpr auto reason_table(std::integer_sequence<int, V...>) {
  return std::array<std::string (*)(const problem&), VARIANTS>{&unsupported_reason_for<variant_kernel<V>>...};
}

template <int... V>
constexpr auto launch_table(std::integer_sequence<int, V...>) {
  return std::array<cudaError_t (*)(const problem&, cudaStream_t), VARIANTS>{&launch_with<variant_kernel<V>>...};
}

constexpr auto reasons = reason_table(std::make_integer_sequence<int, VARIANTS>{});
constexpr auto launchers = launch_table(std::make_integer_sequence<int, VARIANTS>{});

}  // namespace

std::string unsupported_reason(const problem& p) { return reasons[variant_index(p)](p); }

cudaError_t launch(const problem& p, cudaStream_t stream) { return launchers[variant_index(p)](p, stream); }

}  // namespace tk::gemm
