// Row-kernel instantiations and the host side of the launcher (linear_cross_entropy.h).
#include <climits>

#include "linear_cross_entropy.cuh"
#include "tk/dispatch.h"
#include "tk/pipeline/block.cuh"

namespace tk::linear_cross_entropy {
namespace {

bool aligned(const void* address, int64_t bytes) { return reinterpret_cast<uintptr_t>(address) % bytes == 0; }

template <typename T, row_pass PASS, bool SOFTCAP>
cudaError_t run(const tile_problem& p, cudaStream_t stream) {
  tile_args<T> a{};
  a.logits = static_cast<T*>(p.logits);
  a.row_stride = p.row_stride;
  a.classes = int(p.classes);
  a.chunks = int(ceil_div<int64_t>(p.classes, CHUNK_ELEMENTS<T>));
  a.first_class = p.first_class;
  a.vocab = p.vocab;
  a.target = p.target;
  a.ignore_index = p.ignore_index;
  a.target_weight = float(1.0 - p.label_smoothing);
  a.smoothing_per_class = float(p.label_smoothing / double(p.vocab));
  a.softcap = float(p.softcap);
  a.inverse_softcap = SOFTCAP ? float(1.0 / p.softcap) : 0.0f;
  a.lse = p.lse;
  a.loss = p.loss;
  a.row_grad = p.row_grad;
  return pipeline::launch(row_kernel<T, PASS, SOFTCAP>, dim3(unsigned(p.rows)), dim3(ROW_THREADS), 0, stream, a);
}

}  // namespace

std::string unsupported_reason(const tile_problem& p) {
  if (p.dtype != element_type::bf16 && p.dtype != element_type::fp16) return "the logits must be bf16 or fp16";
  if (p.rows < 1 || p.classes < 1 || p.vocab < 1) return "empty sizes";
  if (p.rows > INT_MAX || p.classes > INT_MAX) return "rows and classes must fit 32 bits";
  static_assert(TILE_ROW_MULTIPLE * 2 == CHUNK_BYTES, "a padded row is whole chunks of 16-bit elements");
  if (!aligned(p.logits, CHUNK_BYTES) || p.row_stride % TILE_ROW_MULTIPLE != 0) {
    return "the tile's rows must start 16-byte aligned";
  }
  if (p.row_stride < tile_row_stride(p.classes)) return "the tile's rows must hold `classes` padded to whole chunks";
  if (p.first_class < 0 || p.first_class + p.classes > p.vocab) return "the tile's classes must lie in [0, V)";
  if (p.pass == row_pass::loss && (p.first_class != 0 || p.classes != p.vocab)) {
    return "the loss pass takes tiles of every class";
  }
  if (!(p.label_smoothing >= 0.0 && p.label_smoothing <= 1.0)) return "label_smoothing must be in [0, 1]";
  if (!(p.softcap >= 0.0 && std::isfinite(p.softcap))) return "softcap must be finite and > 0 (0: none)";
  return {};
}

cudaError_t launch(const tile_problem& p, cudaStream_t stream) {
  if (!unsupported_reason(p).empty()) return cudaErrorInvalidValue;
  using dtypes = one_of<element_type::bf16, element_type::fp16>;
  using passes = one_of<row_pass::loss, row_pass::gradient>;
  return dispatch<dtypes, passes, flags>(
      [&]<element_type E, row_pass PASS, bool SOFTCAP>() { return run<element_t<E>, PASS, SOFTCAP>(p, stream); },
      p.dtype, p.pass, p.softcap > 0.0);
}

}  // namespace tk::linear_cross_entropy
