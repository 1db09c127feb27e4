// Python bindings of the tile-core test kernels, JIT-built by tests/test_core_pipeline.py.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "core_kernels.h"

namespace {

using tk::core_tests::element;

element element_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return element::bf16;
    case at::kHalf: return element::fp16;
    case at::kFloat: return element::fp32;
    default: TORCH_CHECK_TYPE(false, "test kernels take bf16, fp16 or fp32, got ", t.scalar_type());
  }
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Returns (dense copy of the shared tile, out) for the tile at (row0, col0) of `in`.
std::tuple<at::Tensor, at::Tensor> tma_round_trip(const at::Tensor& in, int64_t tile_cols, int64_t box_rows,
                                                  int64_t row0, int64_t col0) {
  TORCH_CHECK(in.dim() == 2 && in.stride(1) == 1, "in must be a matrix with contiguous rows");
  // The output's rows are padded to 16 bytes, as TMA needs; the caller sees the rows x cols view.
  const int64_t per_16_bytes = 16 / in.element_size();
  const int64_t out_row_stride = (in.size(1) + per_16_bytes - 1) / per_16_bytes * per_16_bytes;
  at::Tensor out = at::full({in.size(0), out_row_stride}, NAN, in.options());
  at::Tensor dense = at::full({64, tile_cols}, NAN, in.options());
  C10_CUDA_CHECK(tk::core_tests::tma_round_trip({element_of(in), in.data_ptr(), out.data_ptr(), dense.data_ptr(),
                                                 int(in.size(0)), int(in.size(1)), int(in.stride(0)),
                                                 int(out_row_stride), int(tile_cols), int(box_rows), int(row0),
                                                 int(col0)},
                                                stream()));
  return {dense, out.narrow(1, 0, in.size(1))};
}

// Returns (A B in fp32, A B + bias in the input type); a and b as stored (see core_kernels.h).
std::tuple<at::Tensor, at::Tensor> wgmma_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                                                 bool a_mn_major, bool b_mn_major, bool a_in_registers) {
  const int64_t n = b_mn_major ? b.size(1) : b.size(0);
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && bias.is_contiguous() && bias.numel() == n);
  at::Tensor out32 = at::full({64, n}, NAN, a.options().dtype(at::kFloat));
  at::Tensor out16 = at::full({64, n}, NAN, a.options());
  C10_CUDA_CHECK(tk::core_tests::wgmma_product({element_of(a), int(n), a.data_ptr(), b.data_ptr(), bias.data_ptr(), a_mn_major,
                                 b_mn_major, a_in_registers, out32.data_ptr<float>(), out16.data_ptr()},
                                stream()));
  return {out32, out16};
}

// Returns (out, tasks_before) of the template's test kernel (see core_kernels.h).
std::tuple<at::Tensor, at::Tensor> pipeline_sums(const at::Tensor& x, const at::Tensor& y, const at::Tensor& z,
                                                 int64_t iterations, int64_t stages, int64_t consumers,
                                                 int64_t group_rows, int64_t grid) {
  for (const at::Tensor* t : {&x, &y, &z}) TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kBFloat16);
  const int64_t rows_per_tile = 64 * iterations;
  const int64_t tiles_m = (x.size(0) + rows_per_tile - 1) / rows_per_tile;
  const int64_t tiles_n = (x.size(1) + 63) / 64;
  TORCH_CHECK(y.sizes() == x.sizes() && z.size(0) == 64 * tiles_m && z.size(1) == x.size(1));
  at::Tensor out = at::full({tiles_m, x.size(1)}, NAN, x.options().dtype(at::kFloat));
  at::Tensor tasks_before = at::full({tiles_m, tiles_n}, -1, x.options().dtype(at::kInt));
  C10_CUDA_CHECK(tk::core_tests::pipeline_sums({x.data_ptr(), y.data_ptr(), z.data_ptr(), out.data_ptr<float>(),
                                                tasks_before.data_ptr<int>(), int(x.size(0)), int(x.size(1)),
                                                int(iterations), int(stages), int(consumers), int(group_rows), int(grid)},
                                               stream()));
  return {out, tasks_before};
}

// Returns the column sums of x's work tiles by the template with its required hooks only.
at::Tensor pipeline_bare_sums(const at::Tensor& x, int64_t iterations, int64_t grid) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kBFloat16);
  const int64_t tiles_m = (x.size(0) + 64 * iterations - 1) / (64 * iterations);
  at::Tensor out = at::full({tiles_m, x.size(1)}, NAN, x.options().dtype(at::kFloat));
  C10_CUDA_CHECK(tk::core_tests::pipeline_bare_sums(x.data_ptr(), out.data_ptr<float>(), int(x.size(0)), int(x.size(1)),
                                                    int(iterations), int(grid), stream()));
  return out;
}

// Returns the tiles (tiles * 64 x 64, fp32) written through a store ring of `slots` (see core_kernels.h).
at::Tensor store_ring_tiles(int64_t tiles, int64_t slots) {
  at::Tensor out = at::full({tiles * 64, 64}, NAN, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
  C10_CUDA_CHECK(tk::core_tests::store_ring_tiles(out.data_ptr<float>(), int(tiles), int(slots), stream()));
  return out;
}

// Returns the 64 x 64 fp32 tile two warpgroups published to one TMA store (see core_kernels.h).
at::Tensor publish_tile() {
  at::Tensor out = at::full({64, 64}, NAN, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
  C10_CUDA_CHECK(tk::core_tests::publish_tile(out.data_ptr<float>(), stream()));
  return out;
}

// Returns the warpgroup that took each turn of a rotation, in order (see core_kernels.h).
at::Tensor turn_order(int64_t members, int64_t rounds) {
  at::Tensor order = at::full({members * rounds}, -1, at::TensorOptions().device(at::kCUDA).dtype(at::kInt));
  C10_CUDA_CHECK(tk::core_tests::turn_order(order.data_ptr<int>(), int(members), int(rounds), stream()));
  return order;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tma_round_trip", &tma_round_trip);
  m.def("wgmma_product", &wgmma_product);
  m.def("pipeline_sums", &pipeline_sums);
  m.def("pipeline_bare_sums", &pipeline_bare_sums);
  m.def("store_ring_tiles", &store_ring_tiles);
  m.def("publish_tile", &publish_tile);
  m.def("turn_order", &turn_order);
}
