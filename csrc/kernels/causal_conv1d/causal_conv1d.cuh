// Causal depthwise conv1d (+ SiLU): the tile plans of the two layouts and what their kernels share.
//
// channel-first (unit stride along time: a (B, D, L) tensor)
//   lane    `steps` vectors of 16 bytes along time, 32 vectors apart (a warp reads 512 contiguous
//           bytes a step); every vector of the lane is loaded before the first is used
//   warp    one item: `segment` consecutive positions of one (b, d) row
//   halo    the W - 1 inputs before a lane's vector are the last ones of the lane before it, passed
//           by a shuffle (lane 0's come from lane 31's previous vector, or, at the segment's start,
//           from a load); the backward's W - 1 inputs and gradients after a vector likewise come from
//           the lane after it. Every input is read from memory once, plus W - 1 before (and after) a
//           segment
//   block   `warps` consecutive items, one grid over all items
// channel-last (unit stride along channels: a (B, L, D) tensor seen as (B, D, L))
//   lane    `channels` consecutive channels, walking along time with its last W - 1 inputs (and, in
//           the backward, gradients) in registers: each input is read once, plus W - 1 positions
//           before (and after) a walk
//   tile    the 32 * channels channels of a warp
//   grid    as many blocks as fit the device at once; the positions (tile, b, t), in that order, are
//           cut into contiguous ranges of equal length (to one), one per block, and a block's share of
//           each tile it meets is cut again among its warps, so every warp walks as far as every
//           other and the grid ends together (no wave of stragglers)
// Both read 16-byte vectors (channel-last: `channels` elements) when every row is aligned to one,
// and single elements otherwise and at the ends of rows; the arithmetic is fp32.
//
// Backward: g = grad * silu'(pre), with pre recomputed from x. grad_weight and grad_bias are summed
// in fp32 per lane, then per warp (channel-first: one row of partial sums per (b, segment)) or per
// block and tile (channel-last: one row per block that meets the tile); sum_partials_kernel adds
// the rows of each column in a fixed order, so both are the same bits on every run.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "causal_conv1d.h"
#include "tk/common.cuh"
#include "tk/dispatch.h"
#include "tk/pipeline/block.cuh"
#include "tk/pipeline/tile_scheduler.cuh"
#include "tk/types/register_numeric.cuh"

namespace tk::causal_conv1d {

// ------------------------------------------------------------------------------------- the plans

using widths = one_of<2, 3, 4>;
using dtypes = one_of<element_type::bf16, element_type::fp16, element_type::fp32>;

enum class layout { channel_first, channel_last };

constexpr int VECTOR_BYTES = 16;
// 16-bit elements packed two to a 32-bit word, the first in the low half.
constexpr int HALVES_PER_WORD = 2;
constexpr int HALF_WORD_BITS = 16;

struct channel_first_plan {
  static constexpr int warps = 4;
  static constexpr int block_threads = warps * WARP_THREADS;
  static constexpr int steps = 4;  // vectors a lane loads before it uses the first (64 bytes in flight)
  // Blocks per SM each kernel's register budget is sized for: 64 registers (forward), 128 (backward).
  static constexpr int forward_min_blocks = 8;
  static constexpr int backward_min_blocks = 4;
  template <typename T>
  static constexpr int elements = VECTOR_BYTES / int(sizeof(T));  // a lane's positions per step
  template <typename T>
  static constexpr int segment = WARP_THREADS * elements<T> * steps;  // a warp's positions per item
};

struct channel_last_plan {
  // 4-byte accesses of 16-bit data (a warp reads one whole 128-byte line a step), 8-byte of fp32: the
  // backward keeps W taps, a bias, two windows of W - 1 and W + 1 sums per channel in registers.
  static constexpr int channels = 2;
  static constexpr int warps = 8;
  static constexpr int block_threads = warps * WARP_THREADS;
  static constexpr int tile_channels = WARP_THREADS * channels;
  // Per input stream and lane, the bytes of the loads issued before the first is used: the
  // backward has half the lanes of the forward per SM (its registers) and two input streams.
  static constexpr int forward_in_flight_bytes = 16;
  static constexpr int backward_in_flight_bytes = 32;
  template <typename T>
  static constexpr int steps_for(int bytes) { return bytes / (channels * int(sizeof(T))); }
  static constexpr int64_t min_positions_per_warp = 64;  // a small problem gets fewer blocks
  // 64 registers (forward), 80 (backward).
  static constexpr int forward_min_blocks = 4;
  static constexpr int backward_min_blocks = 2;
  // Bounds `blocks * positions` (position_ranges) below 2^63 for any problem the kernels accept.
  static constexpr int64_t max_blocks = int64_t(1) << 16;
  static constexpr int64_t max_positions = INT64_MAX / max_blocks;
};

// The channel-last grid's positions (tile, b, t), tile-major, cut into `blocks` contiguous ranges
// whose lengths differ by at most one (blocks <= total, so none is empty).
struct position_ranges {
  int64_t per_tile;  // B * L
  int64_t total;     // tiles * B * L
  int64_t blocks;

  __host__ __device__ int64_t begin(int64_t block) const { return block * total / blocks; }
  // The block whose range holds position q: the last one that begins at or before it.
  __host__ __device__ int64_t block_of(int64_t q) const { return ((q + 1) * blocks - 1) / total; }
  // A tile's rows of partial sums: one per block whose range meets it, the first block's first.
  __host__ __device__ int64_t first_block(int64_t tile) const { return block_of(tile * per_tile); }
  __host__ __device__ int64_t rows(int64_t tile) const {
    return block_of((tile + 1) * per_tile - 1) - first_block(tile) + 1;
  }
};

// ----------------------------------------------------------------------------- kernel arguments

// A (B, D, L) activation; U is `const T` for inputs. The unit stride (time for channel-first,
// channels for channel-last) is never multiplied: kernels add that index to at(b, d, 0) or at(b, 0, t).
template <typename U>
struct view {
  U* data;
  int64_t batch_stride, channel_stride, time_stride;

  __device__ __forceinline__ U* at(int64_t b, int64_t d, int64_t t) const {
    return data + b * batch_stride + d * channel_stride + t * time_stride;
  }
};

struct parameters {
  const void* weight;  // (D, W)
  bool weight_fp32;    // else the activations' dtype
  const void* bias;    // (D,); nullptr: none
  bool bias_fp32;
};

// Which item or range each warp takes: channel-first items (b, d, segment), or channel-last ranges.
struct work {
  int64_t segments;  // per (b, d) row
  int64_t items;     // B * D * segments
  position_ranges ranges;
};

template <typename T>
struct forward_params {
  int64_t dim, seq_len;
  view<const T> x;
  view<T> out;
  parameters params;
  work grid;
};

template <typename T>
struct backward_params {
  int64_t dim, seq_len;
  view<const T> grad, x;
  view<T> grad_x;
  parameters params;
  work grid;
  float* partials;  // rows of `columns` floats: D * W weight columns, then D bias columns with a bias
  int64_t columns;
};

// ------------------------------------------------------------------------------ element access

// One access of BYTES bytes, to and from the 32-bit words it moves.
template <int BYTES> struct access_word;
template <> struct access_word<4> {
  using type = uint32_t;
  __device__ static type of(const uint32_t (&w)[1]) { return w[0]; }
  __device__ static void split(type v, uint32_t (&w)[1]) { w[0] = v; }
};
template <> struct access_word<8> {
  using type = uint2;
  __device__ static type of(const uint32_t (&w)[2]) { return make_uint2(w[0], w[1]); }
  __device__ static void split(type v, uint32_t (&w)[2]) { w[0] = v.x, w[1] = v.y; }
};
template <> struct access_word<16> {
  using type = uint4;
  __device__ static type of(const uint32_t (&w)[4]) { return make_uint4(w[0], w[1], w[2], w[3]); }
  __device__ static void split(type v, uint32_t (&w)[4]) { w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w; }
};

// N consecutive elements of T as one access moves them: 32-bit words, a 16-bit pair per word (the
// first element in the low half), zero where nothing was loaded.
template <typename T, int N>
struct elements {
  static constexpr int BYTES = N * int(sizeof(T));
  static_assert(BYTES % int(sizeof(uint32_t)) == 0, "a vector is whole 32-bit words");
  static constexpr int WORDS = BYTES / int(sizeof(uint32_t));
  uint32_t words[WORDS];

  __device__ __forceinline__ float operator[](int e) const {
    if constexpr (std::is_same_v<T, float>) {
      return __uint_as_float(words[e]);
    } else {
      const float2 pair = to_float2(pair_from_bits<packed_pair_t<T>>(words[e / 2]));
      return e % 2 == 0 ? pair.x : pair.y;
    }
  }
};

// The elements of v, rounded to T (nearest even, as torch's casts do).
template <typename T, int N>
__device__ __forceinline__ elements<T, N> rounded(const float (&v)[N]) {
  elements<T, N> out;
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int e = 0; e < N; ++e) out.words[e] = __float_as_uint(v[e]);
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) out.words[i] = pair_bits(numeric<T>::pair_from_float2(make_float2(v[2 * i], v[2 * i + 1])));
  }
  return out;
}

// How many of the N elements from `index` on lie before `end` (0 to N).
template <int N>
__device__ __forceinline__ int valid_count(int64_t index, int64_t end) {
  return int(max(int64_t(0), min(int64_t(N), end - index)));
}

// How a kernel moves a lane's N consecutive elements: one access each, or one access for the whole
// vector (every row aligned to it). With `tails`, a vector cut by the end of its row (channel-first,
// L not a multiple of N) goes element by element; without, a lane has all N or none (channel-last
// takes vectors only when D is a multiple of N).
enum class access { elements, vectors, vectors_and_tails };

template <access A, int N>
__device__ __forceinline__ bool whole_vector(int count) {
  return A == access::vectors ? count > 0 : A == access::vectors_and_tails && count >= N;
}

// Inputs are never written while a kernel runs: the non-coherent path. The first `count` elements
// from p on are read, the others are 0.
template <access A, typename T, int N>
__device__ __forceinline__ elements<T, N> load(const T* p, int count) {
  using vector = elements<T, N>;
  vector out{};
  if (whole_vector<A, N>(count)) {
    using word = access_word<vector::BYTES>;
    word::split(__ldg(reinterpret_cast<const typename word::type*>(p)), out.words);
  } else if constexpr (A == access::vectors) {
    // no partial vectors
  } else if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (e < count) out.words[e] = __float_as_uint(__ldg(p + e));
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (e < count) out.words[e / HALVES_PER_WORD] |= uint32_t(__ldg(reinterpret_cast<const unsigned short*>(p) + e))
                                                   << (HALF_WORD_BITS * (e % HALVES_PER_WORD));
    }
  }
  return out;
}

// The first `count` elements of v to p on.
template <access A, typename T, int N>
__device__ __forceinline__ void store(T* p, const elements<T, N>& v, int count) {
  if (whole_vector<A, N>(count)) {
    using word = access_word<elements<T, N>::BYTES>;
    // The intrinsic keeps the access whole: a plain assignment was split into 32-bit stores at -O3.
    __stwb(reinterpret_cast<typename word::type*>(p), word::of(v.words));
  } else if constexpr (A == access::vectors) {
    // no partial vectors
  } else if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (e < count) reinterpret_cast<uint32_t*>(p)[e] = v.words[e];
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (e < count) reinterpret_cast<unsigned short*>(p)[e] = static_cast<unsigned short>(v.words[e / HALVES_PER_WORD] >>
                                                                            (HALF_WORD_BITS * (e % HALVES_PER_WORD)));
    }
  }
}

template <typename T>
__device__ __forceinline__ float load_one(const T* p) {
  return numeric<T>::to_float(__ldg(p));
}

// Entry i of a weight or bias in its run-time dtype (the activations' or fp32).
template <typename T>
__device__ __forceinline__ float parameter_at(const void* data, bool fp32, int64_t i) {
  return fp32 ? __ldg(static_cast<const float*>(data) + i) : load_one(static_cast<const T*>(data) + i);
}

__device__ __forceinline__ float sigmoid(float z) { return 1.0f / (1.0f + __expf(-z)); }
__device__ __forceinline__ float silu(float z) { return z * sigmoid(z); }
// d silu / dz = sigmoid(z) (1 + z (1 - sigmoid(z)))
__device__ __forceinline__ float silu_grad(float z) {
  const float s = sigmoid(z);
  return s * (1.0f + z * (1.0f - s));
}

// ------------------------------------------------------------------------------ channel-first

// A channel-first warp's item: its (b, d) row and the first position of its segment.
template <typename T>
struct channel_first_item {
  int64_t b, d, segment, start;

  __device__ __forceinline__ channel_first_item(const work& grid, int64_t item, int64_t dim) {
    const int64_t row = item / grid.segments;
    segment = item - row * grid.segments;
    start = segment * channel_first_plan::segment<T>;
    b = row / dim;
    d = row - b * dim;
  }
  // The first position of the lane's vector of step k.
  __device__ __forceinline__ int64_t position(int k, int lane) const {
    return start + int64_t(k * WARP_THREADS + lane) * channel_first_plan::elements<T>;
  }
};

// row[first + i] for i < COUNT, 0 outside [0, seq_len): the W - 1 inputs around a segment.
template <int COUNT, typename T>
__device__ __forceinline__ void load_run(float (&out)[COUNT], const T* row, int64_t first, int64_t seq_len) {
#pragma unroll
  for (int i = 0; i < COUNT; ++i) {
    const int64_t t = first + i;
    out[i] = t >= 0 && t < seq_len ? load_one(row + t) : 0.0f;
  }
}

// `mine` of the lane before, and for lane 0 `previous` of lane 31: one shuffle, lane 31 passing on
// an element of its previous vector to lane 0.
__device__ __forceinline__ float from_lane_before(float mine, float previous) {
  const int lane = lane_id();
  return __shfl_sync(ALL_LANES, lane == WARP_THREADS - 1 ? previous : mine, (lane + WARP_THREADS - 1) % WARP_THREADS);
}

// The mirror image: lane 0 passes on its next vector to lane 31.
__device__ __forceinline__ float from_lane_after(float mine, float next) {
  const int lane = lane_id();
  return __shfl_sync(ALL_LANES, lane == 0 ? next : mine, (lane + 1) % WARP_THREADS);
}

// x[t0 - (W - 1) + i] for i < W - 1, before the lane's vector of step k (at t0): raw[k - 1] holds
// the step before; lane 0 of step 0 takes `before`, the W - 1 inputs before the segment. Called in
// loops over k that unroll, so every index is a constant.
template <int W, typename T, int N, int STEPS>
__device__ __forceinline__ void halo_before(float (&window)[W - 1], const elements<T, N> (&raw)[STEPS],
                                            const float (&before)[W - 1], int k) {
#pragma unroll
  for (int i = 0; i < W - 1; ++i) {
    const int e = N - (W - 1) + i;
    const float passed = from_lane_before(raw[k][e], k > 0 ? raw[k - 1][e] : 0.0f);
    window[i] = k == 0 && lane_id() == 0 ? before[i] : passed;
  }
}

// The W - 1 elements after the lane's vector of step k: raw[k + 1] holds the step after; lane 31 of
// the last step takes `after`, what follows the segment.
template <int W, typename T, int N, int STEPS>
__device__ __forceinline__ void halo_after(float (&window)[W - 1], const elements<T, N> (&raw)[STEPS],
                                           const float (&after)[W - 1], int k) {
#pragma unroll
  for (int i = 0; i < W - 1; ++i) {
    const float passed = from_lane_after(raw[k][i], k + 1 < STEPS ? raw[k + 1][i] : 0.0f);
    window[i] = k == STEPS - 1 && lane_id() == WARP_THREADS - 1 ? after[i] : passed;
  }
}

// --------------------------------------------------------------------------------- channel-last

// Calls f(tile, first, last) with the warp's share [first, last) of each tile the block's range
// meets, in order, on every thread of the block (the same number of calls on each: f may sync).
template <typename F>
__device__ __forceinline__ void for_each_tile_share(const position_ranges& ranges, F&& f) {
  const int64_t block_end = ranges.begin(int64_t(blockIdx.x) + 1);
  const int warp = warp_id();
  for (int64_t start = ranges.begin(blockIdx.x); start < block_end;) {
    const int64_t tile = start / ranges.per_tile;
    const int64_t end = min(block_end, (tile + 1) * ranges.per_tile);
    const int64_t length = end - start;
    f(tile, start + length * warp / channel_last_plan::warps, start + length * (warp + 1) / channel_last_plan::warps);
    start = end;
  }
}

// Calls f(b, t_begin, t_end) for each sequence the positions [first, last) of `tile` meet.
template <typename F>
__device__ __forceinline__ void for_each_walk(const position_ranges& ranges, int64_t tile, int64_t first, int64_t last,
                                              int64_t seq_len, F&& f) {
  for (int64_t q = first; q < last;) {
    const int64_t within = q - tile * ranges.per_tile;
    const int64_t b = within / seq_len;
    const int64_t t = within - b * seq_len;
    const int64_t t_end = min(seq_len, t + (last - q));
    f(b, t, t_end);
    q += t_end - t;
  }
}

// The taps and bias of a lane's channels c0 .. c0 + count - 1 (0 for channels past D).
template <typename T, int W, int N>
__device__ __forceinline__ void load_channel_parameters(const parameters& params, int64_t c0, int count,
                                                        float (&taps)[N][W], float (&bias)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
#pragma unroll
    for (int s = 0; s < W; ++s) taps[e][s] = e < count ? parameter_at<T>(params.weight, params.weight_fp32, (c0 + e) * W + s) : 0.0f;
    bias[e] = e < count && params.bias != nullptr ? parameter_at<T>(params.bias, params.bias_fp32, c0 + e) : 0.0f;
  }
}

// Pushes v onto the end of a window of the last W - 1 values of each channel.
template <int W, int N>
__device__ __forceinline__ void push(float (&window)[W - 1][N], const float (&v)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
#pragma unroll
    for (int s = 0; s + 1 < W - 1; ++s) window[s][e] = window[s + 1][e];
    window[W - 2][e] = v[e];
  }
}

// ------------------------------------------------------------------------------------- host side

inline bool x_or_fp32(element_type t, element_type x) { return t == x || t == element_type::fp32; }

template <typename V>
bool unit_time(const V& v, const sizes& s) { return s.seq_len == 1 || v.time_stride == 1; }
template <typename V>
bool unit_channel(const V& v, const sizes& s) { return s.dim == 1 || v.channel_stride == 1; }

// The layout every activation of a launch has: channel-last when they all have unit channel stride
// (preferred at L = 1, where a channel-first warp would hold one position), channel-first when they
// all have unit time stride; nothing when they share no unit-stride dimension.
template <typename... Views>
std::optional<layout> shared_layout(const sizes& s, const Views&... views) {
  const bool channel_last = (unit_channel(views, s) && ...);
  const bool channel_first = (unit_time(views, s) && ...);
  if (channel_last && (!channel_first || s.seq_len == 1)) return layout::channel_last;
  if (channel_first) return layout::channel_first;
  return std::nullopt;
}

// A stride matters only along a dimension of more than one index.
inline bool stride_multiple(int64_t stride, int64_t size, int64_t multiple) { return size <= 1 || stride % multiple == 0; }

// Whether every vector (`elements` consecutive elements along the unit-stride dimension, starting at
// a multiple of `elements`) of a view is aligned to its bytes.
template <typename V>
bool aligned_vectors(const V& v, const sizes& s, layout kind, int elements, element_type dtype) {
  const int64_t other_stride = kind == layout::channel_first ? v.channel_stride : v.time_stride;
  const int64_t other_size = kind == layout::channel_first ? s.dim : s.seq_len;
  return reinterpret_cast<uintptr_t>(v.data) % (uintptr_t(elements) * element_bytes(dtype)) == 0 &&
         stride_multiple(v.batch_stride, s.batch, elements) && stride_multiple(other_stride, other_size, elements);
}

inline int vector_elements(layout kind, element_type dtype) {
  return kind == layout::channel_first ? VECTOR_BYTES / element_bytes(dtype) : channel_last_plan::channels;
}

inline int64_t channel_first_segment(element_type dtype) {
  return int64_t(WARP_THREADS) * (VECTOR_BYTES / element_bytes(dtype)) * channel_first_plan::steps;
}

inline int64_t channel_last_tiles(const sizes& s) { return ceil_div<int64_t>(s.dim, channel_last_plan::tile_channels); }

// Why no kernel takes these sizes, parameters and layout (the checks both directions share).
template <typename... Views>
std::string common_reason(element_type dtype, const sizes& s, const parameter& weight, const parameter& bias,
                          const Views&... views) {
  if (s.batch < 1 || s.dim < 1 || s.seq_len < 1) return "B, D and L must be at least 1";
  if (!widths::contains(s.width)) return "the width W must be one of " + widths::names();
  if (weight.data == nullptr || !x_or_fp32(weight.dtype, dtype)) return "the weight must have x's dtype or fp32";
  if (bias.data != nullptr && !x_or_fp32(bias.dtype, dtype)) return "the bias must have x's dtype or fp32";
  const std::optional<layout> kind = shared_layout(s, views...);
  if (!kind) return "the activations share no unit-stride dimension (time or channel)";
  if (*kind == layout::channel_first) {
    const int64_t items = s.batch * s.dim * ceil_div<int64_t>(s.seq_len, channel_first_segment(dtype));
    if (ceil_div<int64_t>(items, channel_first_plan::warps) > INT_MAX) return "too many rows for one grid";
  } else if (channel_last_tiles(s) * s.batch * s.seq_len > channel_last_plan::max_positions) {
    return "too many positions for one grid";
  }
  return {};
}

// How a launch runs: the layout, and whether every row of every activation takes whole vectors.
struct launch_plan {
  layout kind;
  bool vectorised;
};

template <typename... Views>
launch_plan plan_launch(element_type dtype, const sizes& s, const Views&... views) {
  const layout kind = *shared_layout(s, views...);
  const int elements = vector_elements(kind, dtype);
  // Channel-last vectors are whole or absent (access::vectors): D must be a multiple of them.
  const bool whole = kind == layout::channel_first || s.dim % elements == 0;
  return {kind, whole && (aligned_vectors(views, s, kind, elements, dtype) && ...)};
}

// The channel-last grid of `kernel` for a problem of these sizes: as many blocks as fit the device
// at once, fewer for a small problem. The ranges of a launch and of its workspace count agree.
template <typename Kernel>
cudaError_t channel_last_ranges(Kernel kernel, const sizes& s, position_ranges& ranges) {
  int device = 0, per_sm = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (const cudaError_t err = pipeline::resident_blocks_per_sm(&per_sm, kernel, channel_last_plan::block_threads, 0);
      err != cudaSuccess) {
    return err;
  }
  ranges.per_tile = s.batch * s.seq_len;
  ranges.total = channel_last_tiles(s) * ranges.per_tile;
  const int64_t resident = int64_t(std::max(per_sm, 1)) * pipeline::sm_count(device);
  const int64_t wanted = ceil_div<int64_t>(ranges.total, channel_last_plan::warps * channel_last_plan::min_positions_per_warp);
  ranges.blocks = std::clamp<int64_t>(wanted, 1, std::min(resident, channel_last_plan::max_blocks));
  return cudaSuccess;
}

template <typename T>
view<const T> input_of(const input_view& v) {
  return {static_cast<const T*>(v.data), v.batch_stride, v.channel_stride, v.time_stride};
}

template <typename T>
view<T> output_of(const output_view& v) {
  return {static_cast<T*>(v.data), v.batch_stride, v.channel_stride, v.time_stride};
}

inline parameters parameters_of(const parameter& weight, const parameter& bias) {
  return {weight.data, weight.dtype == element_type::fp32, bias.data, bias.data != nullptr && bias.dtype == element_type::fp32};
}

inline work channel_first_work(const sizes& s, element_type dtype) {
  work w{};
  w.segments = ceil_div<int64_t>(s.seq_len, channel_first_segment(dtype));
  w.items = s.batch * s.dim * w.segments;
  return w;
}

}  // namespace tk::causal_conv1d
