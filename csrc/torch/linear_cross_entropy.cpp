// CUDA kernels of tk::linear_cross_entropy, tk::linear_cross_entropy_bwd and
// tk::linear_cross_entropy_with_grads: the Hopper GEMM and the row kernel (kernels/linear_cross_entropy),
// tile by tile, never holding the (N, V) logits.
//
//   forward   per tile of rows, every class: logits = x_rows W^T + b (GEMM, in x's dtype), then the
//             loss pass writes the rows' lse and loss; the reduction sums the losses
//   with grads  the forward ("mean" and "sum": the output gradient is one scalar, applied later), and per
//             tile of rows, after the loss pass: the gradient pass with g = 1 ("sum") or 1 / count
//             ("mean"), over `unit`, then
//               grad_x_rows = unit dlogits W      complete (K = V): written straight into grad_x
//               grad_W     += unit dlogits^T x_rows  an fp32 sum over the tiles of rows, added by the GEMM's
//                                                 epilogue (accumulates_c); cast to W's dtype at the end
//               grad_b     += column sums of dlogits, in fp32, times unit at the end
//             three GEMMs of 2 N V H flops where the forward and the backward take four (the backward
//             recomputes the logits)
//   backward  per tile of classes, every row: logits = x W_c^T + b_c, the gradient pass overwrites
//             them with d loss / d logits over `unit` (the row gradients g / unit folded in), then
//               grad_W_c = unit dlogits^T x     complete (K = N): written straight into grad_weight
//               grad_x  += dlogits W_c           an fp32 sum over the tiles of classes, times unit at the end
//               grad_b_c = column sums of dlogits, in fp32, times unit at the end
//
// Tiles of classes rather than rows in the backward: the sum that crosses tiles is then grad_x (N H)
// rather than grad_weight (V H, 8x larger for a 16k-token batch against a 128k vocabulary).
// Memory beyond inputs and outputs: the forward a tile (about TILE_ELEMENTS of x's dtype) and two
// fp32 values per row (lse and the loss); the backward a tile, grad_x's fp32 sum and one tile's
// share of it in x's dtype (N H each), grad_b's fp32 sum (V).
//
// The logits are rounded to x's dtype by the GEMM before the row kernel reads them (as the unfused
// F.cross_entropy(F.linear(x, W).float()) rounds them), where the reference keeps the fp32
// accumulator; the arithmetic after that is fp32. What the kernels cannot take goes to the op's
// reference twin tk::<op>_ref, which warns once: kernels_take says what that is.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "kernels/gemm/gemm.h"
#include "kernels/linear_cross_entropy/linear_cross_entropy.h"
#include "registration.h"

namespace {

using tk::registration::element_of;
using tk::registration::fallback;
using tk::registration::launch_on;

namespace lce = tk::linear_cross_entropy;
using tk::gemm::major;
using tk::gemm::stored_matrix;

// A tile of logits holds about this many elements (256 MiB in bf16: 1/16 of a 16k-token batch's
// logits against a 128k vocabulary). Larger tiles mean fewer passes over grad_x's fp32 sum in the
// backward (each about 10 N H bytes), smaller ones less memory.
constexpr int64_t TILE_ELEMENTS = int64_t(1) << 27;
// The same for the forward that computes the gradients: twice as many rows per tile (512 MiB in bf16).
// Each tile of rows costs a pass over grad_W's fp32 sum (the accumulating epilogue reads and writes it:
// 8 V H bytes, 2.1 GB at H = 2048, V = 128256), and grad_x's GEMM of a tile has rows / 128 x H / 256
// output tiles: 2048 rows give 128 at H = 2048, one wave of the H200's 132 SMs, where 1024 rows give 64
// (half the SMs idle, or narrow tiles at 0.75 of the rate). Memory at H = 4096, V = 128256: the tile and
// grad_W's fp32 sum, 0.5 + 2 GiB.
constexpr int64_t GRADS_TILE_ELEMENTS = int64_t(1) << 28;
// Tiles are cut at whole output tiles of the GEMM (kernels/gemm/gemm.cuh, tile_plan: 128 x 256).
constexpr int64_t GEMM_TILE_ROWS = 128;
constexpr int64_t GEMM_TILE_COLS = 256;

int64_t round_down(int64_t value, int64_t multiple) { return value / multiple * multiple; }

// Rows per forward tile (every class of each row), at least one GEMM tile of rows.
int64_t forward_tile_rows(int64_t rows, int64_t padded_vocab, int64_t tile_elements = TILE_ELEMENTS) {
  return std::min(rows, std::max(GEMM_TILE_ROWS, round_down(tile_elements / padded_vocab, GEMM_TILE_ROWS)));
}

// Classes per backward tile (every row), at least one GEMM tile of columns: for more than 2^19 rows
// the tile grows past TILE_ELEMENTS, to 256 N elements.
int64_t backward_tile_classes(int64_t rows, int64_t vocab) {
  return std::min(vocab, std::max(GEMM_TILE_COLS, round_down(TILE_ELEMENTS / rows, GEMM_TILE_COLS)));
}

// The backward's uniform factor. The tile holds d loss / d logits = g u over unit, where |u| <= 1 per
// element (p - q, times the softcap's derivative) and sum_v |u_v| <= 2 per row. In fp16, g u itself is
// mostly subnormal (below 2^-14) for "mean" (g = 1 / count, u ~ 1 / V) and keeps a few bits only, as in
// the unfused fp16 form. unit = 2^(e - DLOGITS_EXPONENT) with 2^(e - 1) <= max |g| < 2^e puts the
// largest |g| / unit in [2^7, 2^8): the tile's elements are normal fp16 down to |u| = 2^-21, at most 2^8,
// and a row's share of grad_x (sum_v dlogits_v W_v) stays below 2^9 max |W|, far below fp16's 65504.
// unit is a power of two on the device (no host sync, so CUDA graphs capture it), so dividing g by it
// and multiplying the fp32 results by it are exact: in bf16 the results are those of folding g in
// directly, bit for bit (barring fp32 overflow or underflow). grad_W = unit (dlogits^T x) takes unit
// in the GEMM's epilogue, on the fp32 accumulator before its one rounding: an fp16 C of dlogits^T x
// alone, or a pass over it after, could overflow (N rows of |x| summed) or round twice. One unit for every
// row rather than one per row: grad_W and grad_b sum over rows, so the rows' relative g must stay in the
// tile; with "none", a row whose |g| is far below the largest keeps fewer bits, as in the unfused form.
constexpr int DLOGITS_EXPONENT = 8;
// Exponents e with 2^e and 2^-e both normal floats, and the fields of a float's bits.
constexpr int FLOAT_EXPONENT_BIAS = std::numeric_limits<float>::max_exponent - 1;  // 127
constexpr int FLOAT_MANTISSA_BITS = std::numeric_limits<float>::digits - 1;        // 23
constexpr int FLOAT_SAFE_EXPONENT = FLOAT_EXPONENT_BIAS - 1;                        // 2^126 and 2^-126

// 2^exponent as float tensors, exactly: the IEEE bits of a normal power of two.
at::Tensor power_of_two(const at::Tensor& exponent) {
  const at::Tensor biased = exponent.clamp(-FLOAT_SAFE_EXPONENT, FLOAT_SAFE_EXPONENT) + FLOAT_EXPONENT_BIAS;
  return biased.to(at::kInt).bitwise_left_shift(FLOAT_MANTISSA_BITS).view(at::kFloat);
}

// The exponent of unit (above) for the row gradients g of the counted rows (not ignore_index): an ignored
// row's g reaches no gradient (its dlogits are zeros whatever g), so a large, inf or NaN one (e.g. 1 / 0 for
// a sequence of padding only) must not set unit. 1 - DLOGITS_EXPONENT, as for max |g| = 1, where that max is
// 0, inf or NaN (no rows, or gradients that are not finite anyway; g / unit keeps its zeros, infinities and NaNs).
at::Tensor unit_exponent(const at::Tensor& row_grad, const at::Tensor& counted) {
  const at::Tensor largest = row_grad.abs().masked_fill(counted.logical_not(), 0).amax();
  const at::Tensor usable = at::logical_and(largest.isfinite(), largest > 0);
  const at::Tensor exponent = std::get<1>(at::frexp(at::where(usable, largest, at::ones_like(largest))));
  return exponent - DLOGITS_EXPONENT;  // frexp: 2^(exponent - 1) <= largest < 2^exponent
}

// (g / unit per row, unit): the gradient g reaching each row's loss (the output gradient grad, over the
// number of counted rows under "mean") over the power of two unit (DLOGITS_EXPONENT), both on the device.
std::pair<at::Tensor, at::Tensor> scaled_row_gradients(const at::Tensor& grad, const at::Tensor& counted,
                                                       c10::string_view reduction) {
  at::Tensor row_grad = grad.to(at::kFloat).expand(counted.sizes());
  if (reduction == "mean") row_grad = row_grad / counted.sum();
  const at::Tensor exponent = unit_exponent(row_grad, counted);
  return {(row_grad * power_of_two(-exponent)).contiguous(), power_of_two(exponent)};
}

// Rows [first, first + count) of a row-major matrix, as the GEMM reads it.
stored_matrix rows_of(const at::Tensor& t, int64_t first, int64_t count) {
  return {static_cast<const char*>(t.data_ptr()) + first * t.stride(0) * t.element_size(), count, t.size(1),
          t.stride(0)};
}

// The three GEMMs of a tile: rows [r0, r0 + rows) of x against classes [c0, c0 + classes) of W, the
// logits tile `rows` x `classes` at `tile` with rows tile_stride apart.
struct tile_gemms {
  const at::Tensor& x;
  const at::Tensor& weight;
  const std::optional<at::Tensor>& bias;

  // logits = x_rows W_c^T + b_c
  tk::gemm::problem logits(int64_t r0, int64_t rows, int64_t c0, int64_t classes, void* tile,
                           int64_t tile_stride) const {
    const void* bias_c =
        bias.has_value() ? static_cast<const char*>(bias->data_ptr()) + c0 * bias->element_size() : nullptr;
    return {element_of(x), rows, classes, x.size(1), rows_of(x, r0, rows), major::k, rows_of(weight, c0, classes),
            major::k, tile, tile_stride, bias_c};
  }

  // grad_x share = dlogits W_c: (rows x classes) (classes x H), W_c as stored (MN-major)
  tk::gemm::problem grad_x(int64_t rows, int64_t c0, int64_t classes, void* tile, int64_t tile_stride,
                           void* out) const {
    return {element_of(x), rows, x.size(1), classes, {tile, rows, classes, tile_stride}, major::k,
            rows_of(weight, c0, classes), major::mn, out, x.size(1), nullptr};
  }

  // grad_W_c = unit (dlogits^T x): (classes x rows) (rows x H), the tile read transposed (MN-major)
  tk::gemm::problem grad_weight(int64_t rows, int64_t classes, void* tile, int64_t tile_stride, void* out,
                                const float* unit) const {
    return {element_of(x), classes, x.size(1), rows, {tile, rows, classes, tile_stride}, major::mn,
            rows_of(x, 0, rows), major::mn, out, x.size(1), nullptr, unit};
  }

  // With grads, per tile of rows [r0, r0 + rows) holding every class:
  // grad_x[rows] = unit (dlogits W): (rows x V) (V x H), written once (K = V) in x's dtype at `out` (grad_x's
  // row r0)
  tk::gemm::problem grad_x_rows(int64_t rows, int64_t vocab, void* tile, int64_t tile_stride, void* out,
                                const float* unit) const {
    tk::gemm::problem p = grad_x(rows, 0, vocab, tile, tile_stride, out);
    p.c_scale = unit;
    return p;
  }

  // grad_W (fp32, V x H) += unit (dlogits^T x_rows): (V x rows) (rows x H), the tile read transposed
  tk::gemm::problem grad_weight_sum(int64_t r0, int64_t rows, int64_t vocab, void* tile, int64_t tile_stride,
                                    float* sum, const float* unit) const {
    tk::gemm::problem p{element_of(x), vocab, x.size(1), rows, {tile, rows, vocab, tile_stride}, major::mn,
                        rows_of(x, r0, rows), major::mn, sum, x.size(1), nullptr, unit};
    p.accumulates_c = true;
    return p;
  }
};

// The one place that decides between the kernels and the reference: x (and so weight and bias) bf16
// or fp16 on a device that runs the kernels, no empty size, a bias with a unit stride, and every GEMM
// of the op able to read x and W as stored (rows 16-byte aligned: H a multiple of 8). Chunks start
// at whole GEMM tiles, so the first chunk's GEMMs speak for all of them.
bool kernels_take(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = x.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  if (!tk::registration::runs_kernels(x)) return false;
  if (x.numel() == 0 || weight.numel() == 0) return false;
  if (x.stride(1) != 1 || weight.stride(1) != 1) return false;
  if (bias.has_value() && bias->stride(0) != 1 && bias->size(0) > 1) return false;
  const tile_gemms gemms{x, weight, bias};
  const int64_t rows = x.size(0), vocab = weight.size(0);
  const int64_t classes = std::min(vocab, GEMM_TILE_COLS);
  const int64_t stride = lce::tile_row_stride(classes);
  for (const tk::gemm::problem& p : {gemms.logits(0, rows, 0, classes, nullptr, stride),
                                     gemms.grad_x(rows, 0, classes, nullptr, stride, nullptr),
                                     gemms.grad_weight(rows, classes, nullptr, stride, nullptr, nullptr),
                                     gemms.grad_weight_sum(0, rows, classes, nullptr, stride, nullptr, nullptr)}) {
    if (!tk::gemm::unsupported_reason(p).empty()) return false;
  }
  return true;
}

void run_gemm(const tk::gemm::problem& p, const at::Tensor& like) {
  launch_on(like, [&](cudaStream_t stream) { return tk::gemm::launch(p, stream); });
}

void run_rows(const lce::tile_problem& p, const at::Tensor& like) {
  launch_on(like, [&](cudaStream_t stream) { return lce::launch(p, stream); });
}

lce::tile_problem row_problem(lce::row_pass pass, const at::Tensor& tile, int64_t rows, int64_t first_class,
                              int64_t classes, int64_t vocab, const int64_t* target, int64_t ignore_index,
                              double label_smoothing, std::optional<double> softcap) {
  lce::tile_problem p{};
  p.dtype = element_of(tile);
  p.pass = pass;
  p.logits = tile.data_ptr();
  p.rows = rows;
  p.row_stride = tile.stride(0);
  p.classes = classes;
  p.first_class = first_class;
  p.vocab = vocab;
  p.target = target;
  p.ignore_index = ignore_index;
  p.label_smoothing = label_smoothing;
  p.softcap = softcap.value_or(0.0);
  return p;
}

// The forward's work on the tile of rows [r0, r0 + count) (every class): the logits GEMM into `tile`, then the
// loss pass, which writes the rows' lse and loss. Returns the row problem, for a gradient pass on the tile.
lce::tile_problem logits_and_loss(const tile_gemms& gemms, const at::Tensor& tile, int64_t r0, int64_t count,
                                  const at::Tensor& targets, int64_t ignore_index, double label_smoothing,
                                  std::optional<double> softcap, const at::Tensor& lse, const at::Tensor& loss_rows) {
  const int64_t vocab = gemms.weight.size(0);
  run_gemm(gemms.logits(r0, count, 0, vocab, tile.data_ptr(), tile.stride(0)), gemms.x);
  lce::tile_problem p = row_problem(lce::row_pass::loss, tile, count, 0, vocab, vocab,
                                    targets.data_ptr<int64_t>() + r0, ignore_index, label_smoothing, softcap);
  p.lse = lse.data_ptr<float>() + r0;
  p.loss = loss_rows.data_ptr<float>() + r0;
  run_rows(p, gemms.x);
  return p;
}

// "sum" or "mean" of the rows' losses: 0 / 0 = NaN for "mean" when every row is ignored, as PyTorch.
at::Tensor reduced(const at::Tensor& loss_rows, const at::Tensor& targets, int64_t ignore_index,
                   c10::string_view reduction) {
  const at::Tensor total = loss_rows.sum();
  return reduction == "sum" ? total : total / (targets != ignore_index).sum();
}

bool is_reduction(c10::string_view reduction) {
  return reduction == "mean" || reduction == "sum" || reduction == "none";
}

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target,
                  const std::optional<at::Tensor>& bias, double label_smoothing, std::optional<double> softcap,
                  c10::string_view reduction) {
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be 2-D (N, H), got ", x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.size(1), op, ": weight must be (V, H) with H = ",
                    x.size(1), ", got ", weight.sizes());
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == x.size(0), op, ": target must be (N,) = (", x.size(0),
                    ",), got ", target.sizes());
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong, op, ": target must be int64, got ", target.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), op, ": weight must have x's dtype ", x.scalar_type(),
                   ", got ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.device() == x.device() && target.device() == x.device(), op,
                    ": weight and target must be on x's device ", x.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), op, ": bias must be (V,) = (",
                      weight.size(0), ",), got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), op, ": bias must have x's dtype ", x.scalar_type(),
                     ", got ", bias->scalar_type());
    TORCH_CHECK_VALUE(bias->device() == x.device(), op, ": bias must be on x's device ", x.device());
  }
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing must be in [0, 1], got ",
                    label_smoothing);
  TORCH_CHECK_VALUE(!softcap.has_value() || (std::isfinite(*softcap) && *softcap > 0.0), op,
                    ": softcap must be a finite number > 0 (None: no softcap), got ", softcap.value_or(0.0));
  TORCH_CHECK_VALUE(is_reduction(reduction), op, ": reduction must be 'mean', 'sum' or 'none', got '", reduction,
                    "'");
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                             const at::Tensor& target,
                                                             const std::optional<at::Tensor>& bias,
                                                             int64_t ignore_index, double label_smoothing,
                                                             std::optional<double> softcap,
                                                             c10::string_view reduction) {
  check_inputs("tk::linear_cross_entropy", x, weight, target, bias, label_smoothing, softcap, reduction);
  if (!kernels_take(x, weight, bias)) {
    return fallback<&linear_cross_entropy_cuda>("tk::linear_cross_entropy_ref", x, weight, target, bias, ignore_index,
                                                label_smoothing, softcap, reduction);
  }
  const int64_t rows = x.size(0), vocab = weight.size(0);
  const at::Tensor targets = target.contiguous();
  const int64_t tile_rows = forward_tile_rows(rows, lce::tile_row_stride(vocab));
  const at::Tensor tile = at::empty({tile_rows, lce::tile_row_stride(vocab)}, x.options());
  const at::Tensor lse = at::empty({rows}, x.options().dtype(at::kFloat));
  const at::Tensor loss_rows = at::empty({rows}, x.options().dtype(at::kFloat));
  const tile_gemms gemms{x, weight, bias};
  for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
    logits_and_loss(gemms, tile, r0, std::min(tile_rows, rows - r0), targets, ignore_index, label_smoothing, softcap,
                    lse, loss_rows);
  }
  if (reduction == "none") return {loss_rows, lse};
  return {reduced(loss_rows, targets, ignore_index, reduction), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, const at::Tensor& lse, int64_t ignore_index, double label_smoothing,
    std::optional<double> softcap, c10::string_view reduction, std::array<bool, 3> output_mask) {
  const char* op = "tk::linear_cross_entropy_bwd";
  check_inputs(op, x, weight, target, bias, label_smoothing, softcap, reduction);
  const int64_t rows = x.size(0), vocab = weight.size(0);
  const bool per_row = reduction == "none";
  TORCH_CHECK_VALUE(per_row ? grad.dim() == 1 && grad.size(0) == rows : grad.dim() == 0, op,
                    ": grad must have the loss's shape (", per_row ? "(N,)" : "()", "), got ", grad.sizes());
  TORCH_CHECK_VALUE(lse.dim() == 1 && lse.size(0) == rows && lse.scalar_type() == at::kFloat, op,
                    ": lse must be (N,) float32, got ", lse.sizes(), " ", lse.scalar_type());
  TORCH_CHECK_VALUE(grad.device() == x.device() && lse.device() == x.device(), op,
                    ": grad and lse must be on x's device ", x.device());
  if (!kernels_take(x, weight, bias)) {
    return fallback<&linear_cross_entropy_bwd_cuda>("tk::linear_cross_entropy_bwd_ref", grad, x, weight, target, bias,
                                                    lse, ignore_index, label_smoothing, softcap, reduction,
                                                    output_mask);
  }
  const bool want_x = output_mask[0], want_weight = output_mask[1], want_bias = output_mask[2] && bias.has_value();
  at::Tensor grad_x = x.new_empty({0}), grad_weight = x.new_empty({0}), grad_bias = x.new_empty({0});
  if (!want_x && !want_weight && !want_bias) return {grad_x, grad_weight, grad_bias};

  const at::Tensor targets = target.contiguous();
  const at::Tensor lse_rows = lse.contiguous();
  // g: the gradient reaching each row's loss (the kernel writes zeros on ignored rows whatever g is), over
  // unit (DLOGITS_EXPONENT).
  const at::Tensor counted = targets != ignore_index;
  const auto [row_grad, unit] = scaled_row_gradients(grad, counted, reduction);

  const int64_t tile_classes = backward_tile_classes(rows, vocab);
  const at::Tensor tile = at::empty({rows, lce::tile_row_stride(tile_classes)}, x.options());
  at::Tensor grad_x_sum, grad_x_share, grad_bias_sum;
  if (want_x) {
    grad_x_sum = at::zeros(x.sizes(), x.options().dtype(at::kFloat));
    grad_x_share = at::empty(x.sizes(), x.options());
  }
  if (want_weight) grad_weight = at::empty(weight.sizes(), weight.options());
  if (want_bias) grad_bias_sum = at::empty({vocab}, x.options().dtype(at::kFloat));

  const tile_gemms gemms{x, weight, bias};
  for (int64_t c0 = 0; c0 < vocab; c0 += tile_classes) {
    const int64_t classes = std::min(tile_classes, vocab - c0);
    run_gemm(gemms.logits(0, rows, c0, classes, tile.data_ptr(), tile.stride(0)), x);
    lce::tile_problem p = row_problem(lce::row_pass::gradient, tile, rows, c0, classes, vocab,
                                      targets.data_ptr<int64_t>(), ignore_index, label_smoothing, softcap);
    p.lse = lse_rows.data_ptr<float>();
    p.row_grad = row_grad.data_ptr<float>();
    run_rows(p, x);
    if (want_x) {
      run_gemm(gemms.grad_x(rows, c0, classes, tile.data_ptr(), tile.stride(0), grad_x_share.data_ptr()), x);
      grad_x_sum.add_(grad_x_share);
    }
    if (want_weight) {
      void* rows_c = static_cast<char*>(grad_weight.data_ptr()) + c0 * grad_weight.stride(0) * grad_weight.element_size();
      run_gemm(gemms.grad_weight(rows, classes, tile.data_ptr(), tile.stride(0), rows_c, unit.data_ptr<float>()), x);
    }
    if (want_bias) {
      at::Tensor bias_c = grad_bias_sum.narrow(0, c0, classes);
      at::sum_out(bias_c, tile.narrow(1, 0, classes), {0}, /*keepdim=*/false, at::kFloat);
    }
  }
  if (want_x) grad_x = grad_x_sum.mul_(unit).to(x.scalar_type());
  if (want_bias) grad_bias = grad_bias_sum.mul_(unit).to(bias->scalar_type());
  return {grad_x, grad_weight, grad_bias};
}

// The forward that also computes the gradients of the loss itself (output gradient 1), for "mean" and
// "sum": the autograd backward multiplies them by the output gradient. Per tile of rows (every class):
// the logits GEMM, the loss pass, the gradient pass in place, grad_x's rows (K = V, written once) and
// grad_W's fp32 sum (K = the tile's rows, added by the GEMM's epilogue), grad_b's fp32 column sums.
// Memory beyond inputs and outputs: the tile (GRADS_TILE_ELEMENTS of x's dtype), 8 bytes a row, grad_W's
// fp32 sum (4 V H bytes) while the tiles run, and with a bias 8 V bytes.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_with_grads_cuda(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target, const std::optional<at::Tensor>& bias,
    int64_t ignore_index, double label_smoothing, std::optional<double> softcap, c10::string_view reduction,
    std::array<bool, 3> output_mask) {
  const char* op = "tk::linear_cross_entropy_with_grads";
  check_inputs(op, x, weight, target, bias, label_smoothing, softcap, reduction);
  TORCH_CHECK_VALUE(reduction != "none", op,
                    ": reduction must be 'mean' or 'sum' (with 'none' the output gradient is one per row, "
                    "not known in the forward), got 'none'");
  if (!kernels_take(x, weight, bias)) {
    return fallback<&linear_cross_entropy_with_grads_cuda>("tk::linear_cross_entropy_with_grads_ref", x, weight,
                                                           target, bias, ignore_index, label_smoothing, softcap,
                                                           reduction, output_mask);
  }
  const int64_t rows = x.size(0), vocab = weight.size(0);
  const bool want_x = output_mask[0], want_weight = output_mask[1], want_bias = output_mask[2] && bias.has_value();
  const bool want_any = want_x || want_weight || want_bias;
  const at::Tensor targets = target.contiguous();
  const at::Tensor counted = targets != ignore_index;
  // g = 1 ("sum") or 1 / count ("mean"; inf when every row is ignored, where it reaches no gradient) on
  // every row, over unit.
  const auto [row_grad, unit] =
      scaled_row_gradients(at::ones({}, x.options().dtype(at::kFloat)), counted, reduction);

  const int64_t tile_rows = forward_tile_rows(rows, lce::tile_row_stride(vocab), GRADS_TILE_ELEMENTS);
  at::Tensor tile = at::empty({tile_rows, lce::tile_row_stride(vocab)}, x.options());
  const at::Tensor lse = at::empty({rows}, x.options().dtype(at::kFloat));
  const at::Tensor loss_rows = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor grad_x = x.new_empty({0}), grad_weight = x.new_empty({0}), grad_bias = x.new_empty({0});
  at::Tensor grad_weight_sum, grad_bias_sum;
  if (want_x) grad_x = at::empty(x.sizes(), x.options());
  if (want_weight) grad_weight_sum = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
  if (want_bias) grad_bias_sum = at::zeros({vocab}, x.options().dtype(at::kFloat));

  const tile_gemms gemms{x, weight, bias};
  for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
    const int64_t count_r = std::min(tile_rows, rows - r0);
    lce::tile_problem p = logits_and_loss(gemms, tile, r0, count_r, targets, ignore_index, label_smoothing, softcap,
                                          lse, loss_rows);
    if (!want_any) continue;
    p.pass = lce::row_pass::gradient;
    p.loss = nullptr;
    p.row_grad = row_grad.data_ptr<float>() + r0;
    run_rows(p, x);
    if (want_x) {
      void* rows_r = static_cast<char*>(grad_x.data_ptr()) + r0 * grad_x.stride(0) * grad_x.element_size();
      run_gemm(gemms.grad_x_rows(count_r, vocab, tile.data_ptr(), tile.stride(0), rows_r, unit.data_ptr<float>()),
               x);
    }
    if (want_weight) {
      run_gemm(gemms.grad_weight_sum(r0, count_r, vocab, tile.data_ptr(), tile.stride(0),
                                     grad_weight_sum.data_ptr<float>(), unit.data_ptr<float>()),
               x);
    }
    if (want_bias) {
      grad_bias_sum.add_(at::sum(tile.narrow(0, 0, count_r).narrow(1, 0, vocab), {0}, /*keepdim=*/false, at::kFloat));
    }
  }
  tile.reset();  // freed before grad_W's cast, the peak: its fp32 sum and its copy in W's dtype
  if (want_weight) {
    grad_weight = grad_weight_sum.to(weight.scalar_type());
    grad_weight_sum.reset();
  }
  if (want_bias) grad_bias = grad_bias_sum.mul_(unit).to(bias->scalar_type());
  return {reduced(loss_rows, targets, ignore_index, reduction), lse, grad_x, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("linear_cross_entropy", &linear_cross_entropy_cuda);
  m.impl("linear_cross_entropy_bwd", &linear_cross_entropy_bwd_cuda);
  m.impl("linear_cross_entropy_with_grads", &linear_cross_entropy_with_grads_cuda);
}
