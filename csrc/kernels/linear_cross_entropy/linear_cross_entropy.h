// The row kernel of tk.linear_cross_entropy: one pass over each row of a tile of logits r (rows x
// classes, x's dtype) that the GEMM wrote. Plain C++ (no torch): csrc/torch/linear_cross_entropy.cpp
// runs the GEMMs around it, tile by tile.
//
//   loss pass      the tile holds every class of its rows; writes each row's lse and loss
//   gradient pass  the tile holds classes [first_class, first_class + classes) of its rows;
//                  overwrites r in place with d loss / d r, scaled by each row's gradient
//
// With z = softcap * tanh(r / softcap) (or z = r), e the label smoothing and t the row's target:
//   lse = log sum_v exp(z_v),   loss = lse - (1 - e) z_t - (e / V) sum_v z_v,   0 where t == ignore_index
//   d loss / d r_v = g ((p_v - e / V - (1 - e) [v == t]) (1 - (z_v / softcap)^2)),  p_v = exp(z_v - lse)
// in fp32. A target other than ignore_index outside [0, V) gives its row a NaN loss and NaN
// gradients (the kernel cannot raise; the reference does).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "tk/element_type.h"

namespace tk::linear_cross_entropy {

using tk::element_type;

enum class row_pass { loss, gradient };

// Elements between the rows of a tile of `classes` columns: padded to whole 16-byte accesses of
// 16-bit elements (the row kernel's and TMA's unit), so that any V is taken.
constexpr int64_t TILE_ROW_MULTIPLE = 8;
constexpr int64_t tile_row_stride(int64_t classes) {
  return (classes + TILE_ROW_MULTIPLE - 1) / TILE_ROW_MULTIPLE * TILE_ROW_MULTIPLE;
}

struct tile_problem {
  element_type dtype;  // of the logits: bf16 or fp16
  row_pass pass;
  void* logits;        // rows x classes, rows row_stride elements apart
  int64_t rows;
  int64_t row_stride;  // tile_row_stride(classes) or more, a multiple of 8; the base 16-byte aligned
  int64_t classes;
  int64_t first_class;     // the class of column 0 (0 in the loss pass)
  int64_t vocab;           // V (== classes in the loss pass)
  const int64_t* target;   // per row of the tile
  int64_t ignore_index;
  double label_smoothing;  // e in [0, 1]
  double softcap;          // > 0, or 0 for none
  float* lse;              // per row: written by the loss pass, read by the gradient pass
  float* loss;             // per row, loss pass
  const float* row_grad;   // per row, gradient pass: g, the gradient reaching the row's loss, or g over a
                           // uniform factor the caller applies to the GEMMs' results (fp16's range)
};

// Empty when the kernel can run the problem; otherwise why not.
std::string unsupported_reason(const tile_problem& p);

// Launch on `stream` (the current device's); returns the launch's error code.
cudaError_t launch(const tile_problem& p, cudaStream_t stream);

}  // namespace tk::linear_cross_entropy
