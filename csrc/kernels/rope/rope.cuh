// Rotary position embedding: one streaming pass over q and k (or one tensor), forward or transpose.
//
//   thread   one slot of a row: VEC pairs (a vector of the first rotary half and the matching vector
//            of the second, or 2 VEC adjacent channels when interleaved), or one vector of the
//            pass-through channels; it reads that slot's cos and sin once per item
//   block    (slots, positions): the slots of `positions_per_block` consecutive (b, n) positions
//   item     a block's positions x a chunk of the heads of q then k, the table entries reused for
//            every head of the chunk; `heads_in_flight` rows are loaded before the first is used
//   grid     as many blocks as fit the device at once, striding over the items (chunks fastest, so
//            the blocks running together share their positions' table rows in L2)
#pragma once

#include <cstdint>

#include "rope.h"
#include "tk/types/register_numeric.cuh"

namespace tk::rope {

struct plan {
  static constexpr int access_bytes = 16;     // one LDG.128 / STG.128 per vector
  static constexpr int block_threads = 256;   // threads per block: slots x positions
  static constexpr int heads_in_flight = 4;   // a thread's independent row loads before their first use
  static constexpr int items_per_block = 8;   // aim: a block's last item is at most 1/8 of its work
};

template <typename T, typename Table>
struct params {
  struct tensor {
    const T* input;
    T* output;
    int64_t batch_stride;  // input strides, elements
    int64_t head_stride;
    int64_t seq_stride;
    int64_t output_batch_stride;  // the output is contiguous (B, heads, N, D)
    int64_t output_head_stride;
  };
  tensor tensors[MAX_TENSORS];
  int heads_first;  // heads of tensors[0]; the heads after them are tensors[1]'s
  int heads_total;
  int64_t seq_len;
  int64_t positions;  // B * N
  int head_dim;
  int half_rotary;   // R / 2: the pair count, and the distance between the channels of a pair (rotate_half)
  int rotary_slots;  // slots that turn pairs; slots from here to `slots` copy pass-through channels
  int slots;
  const Table* cos;
  const Table* sin;
  int64_t cos_batch_stride, cos_seq_stride;
  int64_t sin_batch_stride, sin_seq_stride;
  int heads_per_item;
  int head_chunks;
  int64_t items;
};

template <int BYTES> struct bits_of;
template <> struct bits_of<2> { using type = uint16_t; };
template <> struct bits_of<4> { using type = uint32_t; };
template <> struct bits_of<8> { using type = uint2; };
template <> struct bits_of<16> { using type = uint4; };

// N elements from src to dst, in accesses of at most access_bytes (src and dst aligned to one access).
template <int N, typename U>
__device__ __forceinline__ void copy_vector(U* dst, const U* src) {
  constexpr int bytes = N * int(sizeof(U));
  constexpr int access = bytes < plan::access_bytes ? bytes : plan::access_bytes;
  using bits = typename bits_of<access>::type;
#pragma unroll
  for (int offset = 0; offset < bytes; offset += access) {
    const bits chunk = *reinterpret_cast<const bits*>(reinterpret_cast<const char*>(src) + offset);
    *reinterpret_cast<bits*>(reinterpret_cast<char*>(dst) + offset) = chunk;
  }
}

template <int N, typename U>
__device__ __forceinline__ void load_floats(float (&dst)[N], const U* src) {
  alignas(plan::access_bytes) U raw[N];
  copy_vector<N>(raw, src);
#pragma unroll
  for (int i = 0; i < N; ++i) dst[i] = numeric<U>::to_float(raw[i]);
}

// The rows of one position (b, n) in q and k (or the one tensor): input and output bases, and how
// far apart consecutive heads are.
template <typename T, typename Table>
struct position_rows {
  const T* input[MAX_TENSORS];
  T* output[MAX_TENSORS];

  __device__ position_rows(const params<T, Table>& p, int64_t b, int64_t n) {
#pragma unroll
    for (int t = 0; t < MAX_TENSORS; ++t) {
      input[t] = p.tensors[t].input + b * p.tensors[t].batch_stride + n * p.tensors[t].seq_stride;
      output[t] = p.tensors[t].output + b * p.tensors[t].output_batch_stride + n * p.head_dim;
    }
  }

  __device__ const T* input_row(const params<T, Table>& p, int h) const {
    return h < p.heads_first ? input[0] + h * p.tensors[0].head_stride
                             : input[1] + (h - p.heads_first) * p.tensors[1].head_stride;
  }

  __device__ T* output_row(const params<T, Table>& p, int h) const {
    return h < p.heads_first ? output[0] + h * p.tensors[0].output_head_stride
                             : output[1] + (h - p.heads_first) * p.tensors[1].output_head_stride;
  }
};

// Turn VEC pairs of every head in [head_begin, head_end). A pair (a, b) becomes
//   forward    (a cos1 - b sin1, b cos2 + a sin2)
//   transpose  (a cos1 + b sin2, b cos2 - a sin1)
// with cos2, sin2 the second-half entries of a full table (the same entries for half tables).
template <typename T, typename Table, int VEC, bool INTERLEAVED, bool FULL_TABLE, bool BACKWARD>
__device__ __forceinline__ void rotate_slot(const params<T, Table>& p, const position_rows<T, Table>& rows, int64_t b,
                                            int64_t n, int slot, int head_begin, int head_end) {
  const int pair0 = slot * VEC;
  const int first_channel = INTERLEAVED ? 2 * pair0 : pair0;
  const int second_channel = INTERLEAVED ? 2 * pair0 + VEC : pair0 + p.half_rotary;

  const Table* cos_row = p.cos + b * p.cos_batch_stride + n * p.cos_seq_stride + pair0;
  const Table* sin_row = p.sin + b * p.sin_batch_stride + n * p.sin_seq_stride + pair0;
  float cos_first[VEC], cos_second[VEC], sin_first[VEC], sin_second[VEC];
  load_floats(cos_first, cos_row);
  load_floats(sin_first, sin_row);
  if constexpr (FULL_TABLE) {
    load_floats(cos_second, cos_row + p.half_rotary);
    load_floats(sin_second, sin_row + p.half_rotary);
  }
  // The transpose is the forward map with sin1, sin2 replaced by -sin2, -sin1.
  float sin_a[VEC], sin_b[VEC];  // multiply b in the first output and a in the second
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    if constexpr (!FULL_TABLE) {
      cos_second[i] = cos_first[i];
      sin_second[i] = sin_first[i];
    }
    sin_a[i] = BACKWARD ? -sin_second[i] : sin_first[i];
    sin_b[i] = BACKWARD ? -sin_first[i] : sin_second[i];
  }

  for (int h0 = head_begin; h0 < head_end; h0 += plan::heads_in_flight) {
    // Channels [0, VEC) of a row hold the first vector, [VEC, 2 VEC) the second.
    alignas(plan::access_bytes) T x[plan::heads_in_flight][2 * VEC];
#pragma unroll
    for (int u = 0; u < plan::heads_in_flight; ++u) {
      if (h0 + u < head_end) {
        const T* in = rows.input_row(p, h0 + u);
        copy_vector<VEC>(x[u], in + first_channel);
        copy_vector<VEC>(x[u] + VEC, in + second_channel);
      }
    }
#pragma unroll
    for (int u = 0; u < plan::heads_in_flight; ++u) {
      if (h0 + u < head_end) {
        alignas(plan::access_bytes) T y[2 * VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const int ia = INTERLEAVED ? 2 * i : i;
          const int ib = INTERLEAVED ? 2 * i + 1 : VEC + i;
          const float a = numeric<T>::to_float(x[u][ia]);
          const float bb = numeric<T>::to_float(x[u][ib]);
          y[ia] = numeric<T>::from_float(a * cos_first[i] - bb * sin_a[i]);
          y[ib] = numeric<T>::from_float(bb * cos_second[i] + a * sin_b[i]);
        }
        T* out = rows.output_row(p, h0 + u);
        copy_vector<VEC>(out + first_channel, y);
        copy_vector<VEC>(out + second_channel, y + VEC);
      }
    }
  }
}

// Copy one vector of pass-through channels (R <= channel < D) of every head, bit for bit.
template <typename T, typename Table, int VEC>
__device__ __forceinline__ void copy_slot(const params<T, Table>& p, const position_rows<T, Table>& rows, int slot,
                                          int head_begin, int head_end) {
  const int channel = 2 * p.half_rotary + (slot - p.rotary_slots) * VEC;
  for (int h0 = head_begin; h0 < head_end; h0 += plan::heads_in_flight) {
    alignas(plan::access_bytes) T x[plan::heads_in_flight][VEC];
#pragma unroll
    for (int u = 0; u < plan::heads_in_flight; ++u) {
      if (h0 + u < head_end) copy_vector<VEC>(x[u], rows.input_row(p, h0 + u) + channel);
    }
#pragma unroll
    for (int u = 0; u < plan::heads_in_flight; ++u) {
      if (h0 + u < head_end) copy_vector<VEC>(rows.output_row(p, h0 + u) + channel, x[u]);
    }
  }
}

template <typename T, typename Table, int VEC, bool INTERLEAVED, bool FULL_TABLE, bool BACKWARD>
__global__ void __launch_bounds__(plan::block_threads) rope_kernel(const __grid_constant__ params<T, Table> p) {
  for (int64_t item = blockIdx.x; item < p.items; item += gridDim.x) {
    const int64_t group = item / p.head_chunks;
    const int chunk = int(item - group * p.head_chunks);
    const int64_t position = group * blockDim.y + threadIdx.y;
    if (position >= p.positions) continue;
    const int64_t b = position / p.seq_len;
    const int64_t n = position - b * p.seq_len;
    const int head_begin = chunk * p.heads_per_item;
    const int head_end = min(head_begin + p.heads_per_item, p.heads_total);
    const position_rows<T, Table> rows(p, b, n);
    for (int slot = threadIdx.x; slot < p.slots; slot += blockDim.x) {
      if (slot < p.rotary_slots) {
        rotate_slot<T, Table, VEC, INTERLEAVED, FULL_TABLE, BACKWARD>(p, rows, b, n, slot, head_begin, head_end);
      } else {
        copy_slot<T, Table, VEC>(p, rows, slot, head_begin, head_end);
      }
    }
  }
}

}  // namespace tk::rope
