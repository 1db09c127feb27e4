// RoPE instantiations and the host side of the launcher (rope.h): vector width, block shape, grid.
#include <algorithm>
#include <climits>
#include <type_traits>

#include "rope.cuh"
#include "tk/dispatch.h"
#include "tk/pipeline/block.cuh"
#include "tk/pipeline/tile_scheduler.cuh"

namespace tk::rope {
namespace {

bool full_table(const problem& p) { return !p.interleaved && p.table_width == p.head_dim; }
int64_t half_rotary(const problem& p) { return full_table(p) ? p.head_dim / 2 : p.table_width; }

bool aligned(const void* address, int64_t bytes) { return reinterpret_cast<uintptr_t>(address) % bytes == 0; }
// A stride matters only along a dimension of more than one index.
bool stride_multiple(int64_t stride, int64_t size, int64_t multiple) { return size <= 1 || stride % multiple == 0; }

// The widest vector (in elements) every access of the problem can use: one access_bytes vector of x,
// or single elements when an address, stride or the rotary split is not a multiple of it.
int64_t vector_elements(const problem& p) {
  const int64_t vec = plan::access_bytes / element_bytes(p.x_type);
  const int64_t x_access = vec * element_bytes(p.x_type);
  const int64_t table_access = std::min<int64_t>(plan::access_bytes, vec * element_bytes(p.table_type));
  const int64_t table_access_elements = table_access / element_bytes(p.table_type);
  bool ok = half_rotary(p) % vec == 0 && p.head_dim % vec == 0;
  for (int t = 0; t < p.tensor_count; ++t) {
    const head_tensor& x = p.tensors[t];
    ok = ok && aligned(x.input, x_access) && aligned(x.output, x_access) &&
         stride_multiple(x.batch_stride, p.batch, vec) && stride_multiple(x.head_stride, x.heads, vec) &&
         stride_multiple(x.seq_stride, p.seq_len, vec);
  }
  for (const table& tab : {p.cos, p.sin}) {
    ok = ok && aligned(tab.data, table_access) && stride_multiple(tab.batch_stride, p.batch, table_access_elements) &&
         stride_multiple(tab.seq_stride, p.seq_len, table_access_elements);
  }
  return ok ? vec : 1;
}

template <typename T, typename Table, int VEC, bool INTERLEAVED, bool FULL_TABLE, bool BACKWARD>
cudaError_t run(const problem& p, cudaStream_t stream) {
  params<T, Table> k{};
  for (int t = 0; t < MAX_TENSORS; ++t) {
    const head_tensor& x = p.tensors[t < p.tensor_count ? t : 0];  // a single tensor fills both entries
    k.tensors[t] = {static_cast<const T*>(x.input), static_cast<T*>(x.output), x.batch_stride, x.head_stride,
                    x.seq_stride, x.heads * p.seq_len * p.head_dim, p.seq_len * p.head_dim};
  }
  k.heads_first = int(p.tensors[0].heads);
  k.heads_total = int(p.tensors[0].heads + (p.tensor_count > 1 ? p.tensors[1].heads : 0));
  k.seq_len = p.seq_len;
  k.positions = p.batch * p.seq_len;
  k.head_dim = int(p.head_dim);
  k.half_rotary = int(half_rotary(p));
  k.rotary_slots = k.half_rotary / VEC;
  k.slots = k.rotary_slots + int(p.head_dim - 2 * half_rotary(p)) / VEC;
  k.cos = static_cast<const Table*>(p.cos.data);
  k.sin = static_cast<const Table*>(p.sin.data);
  k.cos_batch_stride = p.cos.batch_stride;
  k.cos_seq_stride = p.cos.seq_stride;
  k.sin_batch_stride = p.sin.batch_stride;
  k.sin_seq_stride = p.sin.seq_stride;

  const dim3 block(std::min(k.slots, plan::block_threads), std::max(1, plan::block_threads / k.slots));
  const auto kernel = rope_kernel<T, Table, VEC, INTERLEAVED, FULL_TABLE, BACKWARD>;
  int device = 0, blocks_per_sm = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (const cudaError_t err = pipeline::resident_blocks_per_sm(&blocks_per_sm, kernel, int(block.x * block.y), 0);
      err != cudaSuccess) {
    return err;
  }
  const int64_t resident_blocks = int64_t(std::max(1, blocks_per_sm)) * pipeline::sm_count(device);
  const int64_t position_groups = ceil_div<int64_t>(k.positions, block.y);
  // Split the heads only as far as balance needs, in whole batches of rows in flight.
  const int64_t wanted_chunks = ceil_div<int64_t>(plan::items_per_block * resident_blocks, position_groups);
  const int64_t heads_per_chunk = ceil_div<int64_t>(k.heads_total, wanted_chunks);
  k.heads_per_item = int(std::min<int64_t>(k.heads_total, round_up<int64_t>(heads_per_chunk, plan::heads_in_flight)));
  k.head_chunks = ceil_div(k.heads_total, k.heads_per_item);
  k.items = position_groups * k.head_chunks;
  const int grid = int(std::min(k.items, resident_blocks));
  return pipeline::launch(kernel, grid, block, 0, stream, k);
}

}  // namespace

std::string unsupported_reason(const problem& p) {
  if (p.tensor_count < 1 || p.tensor_count > MAX_TENSORS) return "one or two tensors";
  if (p.table_type != p.x_type && p.table_type != element_type::fp32) return "tables must be x's dtype or fp32";
  if (p.batch < 1 || p.seq_len < 1 || p.head_dim < 1 || p.table_width < 1) return "empty sizes";
  int64_t heads = 0;
  for (int t = 0; t < p.tensor_count; ++t) {
    if (p.tensors[t].heads < 1) return "empty sizes";
    heads += p.tensors[t].heads;
  }
  if (heads > INT_MAX || p.head_dim > INT_MAX) return "head count and head dim must fit 32 bits";
  if (full_table(p) ? p.head_dim % 2 != 0 : 2 * p.table_width > p.head_dim) {
    return "tables must be (Bc, N, R/2) with R <= D, or (Bc, N, D) with D even when not interleaved";
  }
  return {};
}

cudaError_t launch(const problem& p, cudaStream_t stream) {
  if (!unsupported_reason(p).empty()) return cudaErrorInvalidValue;
  using x_dtypes = one_of<element_type::bf16, element_type::fp16, element_type::fp32>;
  return dispatch<x_dtypes, flags, flags, flags, flags, flags>(
      [&]<element_type X, bool FP32_TABLES, bool VECTORISED, bool INTERLEAVED, bool FULL_TABLE, bool BACKWARD>() {
        using T = element_t<X>;
        using Table = std::conditional_t<FP32_TABLES, float, T>;
        constexpr int vec = VECTORISED ? plan::access_bytes / int(sizeof(T)) : 1;
        if constexpr (INTERLEAVED && FULL_TABLE) {
          return cudaErrorInvalidValue;  // full tables are rotate_half only (full_table() is false when interleaved)
        } else {
          return run<T, Table, vec, INTERLEAVED, FULL_TABLE, BACKWARD>(p, stream);
        }
      },
      p.x_type, p.table_type == element_type::fp32, vector_elements(p) > 1, p.interleaved, full_table(p), p.backward);
}

}  // namespace tk::rope
