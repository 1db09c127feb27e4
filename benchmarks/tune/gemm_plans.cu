// Candidate tile plans of the GEMM, compiled side by side so one device run can compare them
// (benchmarks/tune_gemm.py). The library itself builds only tile_plan (csrc/kernels/gemm/gemm.cuh).
#include <array>
#include <utility>

#include "gemm_plans.h"
#include "kernels/gemm/gemm.cuh"

namespace tk::gemm::tuning {
namespace {

struct three_stages_wide_store : tile_plan {
  static constexpr int stages = 3;
  static constexpr int store_cols = 128;
};
struct one_wide_store_slot : tile_plan {
  static constexpr int store_cols = 128;
  static constexpr int store_slots = 1;
};
struct registers_24_240 : tile_plan {
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 240;
};
struct three_stages_wide_store_240 : three_stages_wide_store {
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 240;
};
struct one_wide_store_slot_240 : one_wide_store_slot {
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 240;
};
struct boxes_of_64_rows_240 : registers_24_240 {
  static constexpr int box_rows = 64;
};

// Every candidate in one place: its name and its plan.
template <int I> struct candidate;
#define TK_CANDIDATE(I, PLAN, NAME)                \
  template <> struct candidate<I> {                \
    using plan = PLAN;                             \
    static constexpr const char* name = NAME;      \
  };
TK_CANDIDATE(0, tile_plan, "baseline")
TK_CANDIDATE(1, three_stages_wide_store, "3 stages, 128-col store")
TK_CANDIDATE(2, one_wide_store_slot, "1 store slot of 128 cols")
TK_CANDIDATE(3, registers_24_240, "registers 24/240")
TK_CANDIDATE(4, three_stages_wide_store_240, "3 stages, 128-col store, 24/240")
TK_CANDIDATE(5, one_wide_store_slot_240, "1 slot of 128 cols, 24/240")
TK_CANDIDATE(6, boxes_of_64_rows_240, "boxes of 64 rows, 24/240")
#undef TK_CANDIDATE
constexpr int CANDIDATES = 7;

using launcher = cudaError_t (*)(const problem&, cudaStream_t);

// Layout index: A major (bit 0), B major (bit 1), 1 = MN-major.
template <int I, int LAYOUT>
using candidate_kernel = gemm_kernel<bf16, (LAYOUT & 1) ? operand_major::mn : operand_major::k,
                                     (LAYOUT & 2) ? operand_major::mn : operand_major::k, false,
                                     typename candidate<I>::plan>;

template <int... V>
constexpr auto launchers(std::integer_sequence<int, V...>) {
  return std::array<launcher, CANDIDATES * 4>{&launch_with<candidate_kernel<V / 4, V % 4>>...};
}
template <int... I>
constexpr auto names(std::integer_sequence<int, I...>) {
  return std::array<const char*, CANDIDATES>{candidate<I>::name...};
}

constexpr auto table = launchers(std::make_integer_sequence<int, CANDIDATES * 4>{});
constexpr auto candidate_names = names(std::make_integer_sequence<int, CANDIDATES>{});

}  // namespace

int candidates() { return CANDIDATES; }
const char* candidate_name(int i) { return candidate_names[i]; }

cudaError_t launch_candidate(int i, const problem& p, cudaStream_t stream) {
  const int layout = (p.a_major == major::mn ? 1 : 0) | (p.b_major == major::mn ? 2 : 0);
  return table[i * 4 + layout](p, stream);
}

}  // namespace tk::gemm::tuning
