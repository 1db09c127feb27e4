// GEMM instantiations: every variant of gemm_kernel, and the dispatch of gemm.h onto them.
#include "gemm.cuh"

namespace tk::gemm {
namespace {

using kernel_dtypes = one_of<element_type::bf16, element_type::fp16>;
using majors = one_of<major::k, major::mn>;

constexpr operand_major operand_major_of(major m) { return m == major::k ? operand_major::k : operand_major::mn; }

// Runs f.template operator()<K>() for the gemm_kernel variant of the problem (element type, A and
// B major-ness, bias, tile plan: narrow_tile_plan where faster_with_narrow_tiles expects it to win, C scale;
// or the accumulating variants).
template <typename F>
auto with_kernel(const problem& p, F&& f) {
  if (p.accumulates_c) {
    // fp32 C += A B [* c_scale]: instantiated for the one layout it serves (A and B MN-major, no bias, the
    // default tiles); unsupported_reason_for turns the other problems down.
    return dispatch<kernel_dtypes, flags>([&]<element_type E, bool SCALES_C>() {
      return f.template operator()<
          gemm_kernel<element_t<E>, operand_major::mn, operand_major::mn, false, accumulating<tile_plan>, SCALES_C>>();
    }, p.dtype, p.c_scale != nullptr);
  }
  return dispatch<kernel_dtypes, majors, majors, flags, flags, flags>(
      [&]<element_type E, major A, major B, bool BIAS, bool NARROW, bool SCALES_C>() {
        using plan = std::conditional_t<NARROW, narrow_tile_plan, tile_plan>;
        return f.template operator()<
            gemm_kernel<element_t<E>, operand_major_of(A), operand_major_of(B), BIAS, plan, SCALES_C>>();
      },
      p.dtype, p.a_major, p.b_major, p.bias != nullptr, faster_with_narrow_tiles(p, current_sm_count()),
      p.c_scale != nullptr);
}

}  // namespace

std::string unsupported_reason(const problem& p) {
  if (!kernel_dtypes::contains(p.dtype)) return "the element type must be bf16 or fp16";
  return with_kernel(p, [&]<typename K>() { return unsupported_reason_for<K>(p); });
}

cudaError_t launch(const problem& p, cudaStream_t stream) {
  return with_kernel(p, [&]<typename K>() { return launch_with<K>(p, stream); });
}

}  // namespace tk::gemm
