// Global-memory layouts and the TMA tensor maps that describe them.
//
// A global_layout is a strided view of up to five dimensions (outermost first) whose last
// dimension is contiguous; every other stride is free, so transposed and sliced views need no
// copy. `make_tma_map<Tile>(layout)` encodes, on the host, the tensor map whose box is
// Tile::box_rows rows of one panel of a shared tile (see shared_tile.cuh): the copy engine then
// handles tails itself, filling out-of-bounds reads with zeros and dropping out-of-bounds writes.
//
// The driver's cuTensorMapEncodeTiled is reached through the runtime's entry-point query, so
// nothing links libcuda. Each hardware limit is checked on its own line first:
// `tma_unsupported_reason` names the violated rule, which lets a caller fall back instead of
// failing, and `make_tma_map` throws std::invalid_argument with the same text.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "shared_tile.cuh"

namespace tk {

template <typename T, int RANK>
struct global_layout {
  static_assert(2 <= RANK && RANK <= 5, "TMA tensor maps have 2 to 5 dimensions here");
  static constexpr int rank = RANK;
  using element = T;

  T* data;
  std::array<int64_t, RANK> shape;        // elements, outermost first; shape[RANK - 1] is contiguous
  std::array<int64_t, RANK - 1> strides;  // elements, of dimensions 0 .. RANK - 2
};

// A strided view. A dimension of extent 1 is never stepped over, so whatever stride a framework
// reports for it (often 1, or the product of the inner extents, which TMA may reject) is replaced by
// one TMA accepts: the inner dimension's span rounded up to 16 bytes.
template <typename T, int RANK>
global_layout<T, RANK> strided_layout(T* data, const std::array<int64_t, RANK>& shape,
                                      std::array<int64_t, RANK - 1> strides) {
  constexpr int64_t elements_per_16_bytes = 16 / int64_t(sizeof(T));
  for (int d = RANK - 2; d >= 0; --d) {
    const int64_t inner_span = shape[d + 1] * (d + 1 < RANK - 1 ? strides[d + 1] : 1);
    if (shape[d] == 1) strides[d] = round_up(inner_span, elements_per_16_bytes);
  }
  return {data, shape, strides};
}

// A matrix: `rows` x `cols` with consecutive rows `row_stride` elements apart.
template <typename T>
global_layout<T, 2> matrix_layout(T* data, int64_t rows, int64_t cols, int64_t row_stride) {
  return strided_layout<T, 2>(data, {rows, cols}, {row_stride});
}

namespace detail {

template <typename T> constexpr CUtensorMapDataType tma_data_type();
template <> constexpr CUtensorMapDataType tma_data_type<bf16>() { return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16; }
template <> constexpr CUtensorMapDataType tma_data_type<half>() { return CU_TENSOR_MAP_DATA_TYPE_FLOAT16; }
template <> constexpr CUtensorMapDataType tma_data_type<float>() { return CU_TENSOR_MAP_DATA_TYPE_FLOAT32; }

constexpr CUtensorMapSwizzle tma_swizzle(swizzle_mode mode) {
  return mode == swizzle_mode::bytes128 ? CU_TENSOR_MAP_SWIZZLE_128B
       : mode == swizzle_mode::bytes64  ? CU_TENSOR_MAP_SWIZZLE_64B
       : mode == swizzle_mode::bytes32  ? CU_TENSOR_MAP_SWIZZLE_32B
                                        : CU_TENSOR_MAP_SWIZZLE_NONE;
}

// The tensor map's fields in the driver's vocabulary: dimension 0 is the innermost.
template <int RANK>
struct tma_fields {
  std::array<cuuint64_t, RANK> global_dim;
  std::array<cuuint64_t, RANK - 1> global_stride_bytes;  // of dimensions 1 .. RANK - 1
  std::array<cuuint32_t, RANK> box_dim;
  std::array<cuuint32_t, RANK> element_stride;
};

template <typename Tile, typename T, int RANK>
tma_fields<RANK> tma_fields_for(const global_layout<T, RANK>& layout) {
  tma_fields<RANK> f;
  for (int d = 0; d < RANK; ++d) {
    f.global_dim[d] = cuuint64_t(layout.shape[RANK - 1 - d]);
    f.box_dim[d] = 1;
    f.element_stride[d] = 1;
  }
  for (int d = 1; d < RANK; ++d) f.global_stride_bytes[d - 1] = cuuint64_t(layout.strides[RANK - 1 - d]) * sizeof(T);
  f.box_dim[0] = Tile::panel_cols;
  f.box_dim[1] = Tile::box_rows;
  return f;
}

inline std::string describe_fields(const void* data, const cuuint64_t* dims, const cuuint64_t* strides,
                                   const cuuint32_t* box, int rank) {
  std::string s = "address " + std::to_string(reinterpret_cast<uintptr_t>(data)) + ", dims (inner first)";
  for (int d = 0; d < rank; ++d) s += " " + std::to_string(dims[d]);
  s += ", strides in bytes";
  for (int d = 0; d + 1 < rank; ++d) s += " " + std::to_string(strides[d]);
  s += ", box";
  for (int d = 0; d < rank; ++d) s += " " + std::to_string(box[d]);
  return s;
}

inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled_entry_point() {
  static PFN_cuTensorMapEncodeTiled_v12000 entry = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &status);
#endif
    if (err == cudaSuccess && status == cudaDriverEntryPointSuccess) {
      entry = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }
  });
  if (entry == nullptr) throw std::runtime_error("tk: the CUDA driver does not provide cuTensorMapEncodeTiled");
  return entry;
}

// The driver's encoder needs a current context, and a thread that has made no runtime call yet (an
// autograd worker whose allocations all came from a cache, say) has none: cudaSetDevice makes the
// device's primary context current, once per thread.
inline void make_context_current() {
  thread_local bool current = false;
  if (current) return;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
    throw std::runtime_error("tk: no CUDA context for encoding a tensor map");
  }
  current = true;
}

}  // namespace detail

// Why the copy engine cannot move panels of `Tile` out of `layout`, or an empty string if it can.
template <typename Tile, typename T, int RANK>
std::string tma_unsupported_reason(const global_layout<T, RANK>& layout) {
  static_assert(std::is_same_v<typename Tile::element, T>, "the tile and the layout hold different types");
  const auto f = detail::tma_fields_for<Tile>(layout);
  // Global address: 16-byte aligned (the copy engine moves 16-byte units).
  if (reinterpret_cast<uintptr_t>(layout.data) % 16 != 0) return "the base address is not 16-byte aligned";
  for (int d = 0; d < RANK; ++d) {
    // Every extent in [1, 2^32].
    if (layout.shape[d] < 1 || layout.shape[d] > (int64_t(1) << 32)) {
      return "dimension " + std::to_string(d) + " has extent " + std::to_string(layout.shape[d]) +
             " outside [1, 2^32]";
    }
  }
  for (int d = 0; d + 1 < RANK; ++d) {
    const int64_t stride_bytes = layout.strides[d] * int64_t(sizeof(T));
    // Every stride but the innermost: a positive multiple of 16 bytes below 2^40.
    if (stride_bytes <= 0 || stride_bytes % 16 != 0 || stride_bytes >= (int64_t(1) << 40)) {
      return "dimension " + std::to_string(d) + " has a stride of " + std::to_string(stride_bytes) +
             " bytes; TMA needs a positive multiple of 16 below 2^40";
    }
  }
  for (int d = 0; d < RANK; ++d) {
    // Box extents in [1, 256].
    if (f.box_dim[d] < 1 || f.box_dim[d] > 256) return "a box extent is outside [1, 256]";
  }
  // The innermost box row is a multiple of 16 bytes and fits in one swizzle span.
  const int box_row_bytes = int(f.box_dim[0]) * int(sizeof(T));
  if (box_row_bytes % 16 != 0 || box_row_bytes > Tile::swizzle_bytes) return "the box row does not fit the swizzle span";
  return {};
}

// The tensor map for moving panels of `Tile` between `layout` and shared memory.
template <typename Tile, typename T, int RANK>
CUtensorMap make_tma_map(const global_layout<T, RANK>& layout) {
  const std::string reason = tma_unsupported_reason<Tile>(layout);
  auto f = detail::tma_fields_for<Tile>(layout);
  if (!reason.empty()) {
    throw std::invalid_argument("tk: TMA cannot describe this layout: " + reason + " (" +
                                detail::describe_fields(layout.data, f.global_dim.data(),
                                                        f.global_stride_bytes.data(), f.box_dim.data(), RANK) +
                                ")");
  }
  CUtensorMap map;
  detail::make_context_current();
  const CUresult result = detail::encode_tiled_entry_point()(
      &map, detail::tma_data_type<T>(), RANK, const_cast<void*>(static_cast<const void*>(layout.data)),
      f.global_dim.data(), f.global_stride_bytes.data(), f.box_dim.data(), f.element_stride.data(),
      CU_TENSOR_MAP_INTERLEAVE_NONE, detail::tma_swizzle(Tile::swizzle), CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    throw std::runtime_error("tk: cuTensorMapEncodeTiled failed with error " + std::to_string(int(result)) + " (" +
                             detail::describe_fields(layout.data, f.global_dim.data(), f.global_stride_bytes.data(),
                                                     f.box_dim.data(), RANK) +
                             ")");
  }
  return map;
}

}  // namespace tk
