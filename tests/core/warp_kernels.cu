// Test kernels for the warp-level tile core (csrc/tk/types/register_*, csrc/tk/ops/warp,
// csrc/tk/ops/warpgroup/register_fragments.cuh), one small kernel per primitive.
//
// tests/test_core_warp.py builds this file with torch.utils.cpp_extension.load and calls
// run_case(name, args, stream) through ctypes, with args the device pointers each kernel takes, in
// order. Nothing here knows torch. Every kernel is one warp, except the wgmma ones (one warpgroup).
#include <cuda_runtime.h>

#include <cmath>
#include <string_view>
#include <utility>

#include "tk/ops/warp/warp.cuh"
#include "tk/ops/warpgroup/register_fragments.cuh"
#include "tk/pipeline/block.cuh"
#include "tk/sync/fence.cuh"
#include "tk/types/shared_tile.cuh"

namespace {

using namespace tk;
using L = register_layout;

__host__ __device__ constexpr register_layout other(register_layout layout) { return layout == L::row ? L::col : L::row; }

// Tiles of several base tiles each way, so block indexing is exercised.
constexpr int ROWS = 2 * BASE_TILE;
constexpr int COLS = 3 * BASE_TILE;
constexpr int ROW_STRIDE = COLS + BASE_TILE / 2;  // a padded global row (even: row-layout pairs stay aligned)

// ---- global <-> register: ROWS x COLS of a ROWS x ROW_STRIDE matrix, and back -------------------

template <typename G, typename T, register_layout LAYOUT>
__global__ void global_round_trip(const G* src, G* dst) {
  register_tile<T, ROWS, COLS, LAYOUT> tile;
  warp::load(tile, src, ROW_STRIDE);
  warp::store(dst, ROW_STRIDE, tile);
}

// ---- shared <-> register: a register tile at (ORIGIN_ROW, ORIGIN_COL) of a swizzled shared tile --

constexpr int SHARED_ROWS = ROWS + BASE_TILE;
constexpr int SHARED_COLS = 4 * BASE_TILE;
constexpr int ORIGIN_ROW = BASE_TILE;
constexpr int ORIGIN_COL = BASE_TILE;

// dst = src (SHARED_ROWS x SHARED_COLS) after: load the register tile, clear shared memory, store it
// back. Outside the register tile's window dst comes back zero.
template <typename S, typename T, register_layout LAYOUT, swizzle_mode SWIZZLE>
__global__ void shared_round_trip(const S* src, S* dst) {
  using staging_tile = shared_tile<S, SHARED_ROWS, SHARED_COLS, SWIZZLE>;
  __shared__ staging_tile staging;
  for (int i = lane_id(); i < SHARED_ROWS * SHARED_COLS; i += WARP_THREADS) {
    staging.at(i / SHARED_COLS, i % SHARED_COLS) = src[i];
  }
  __syncwarp();
  register_tile<T, ROWS, COLS, LAYOUT> tile;
  warp::load(tile, staging, ORIGIN_ROW, ORIGIN_COL);
  __syncwarp();
  for (int i = lane_id(); i < SHARED_ROWS * SHARED_COLS; i += WARP_THREADS) {
    staging.at(i / SHARED_COLS, i % SHARED_COLS) = convert<S>(0.0f);
  }
  __syncwarp();
  warp::store(staging, tile, ORIGIN_ROW, ORIGIN_COL);
  __syncwarp();
  for (int i = lane_id(); i < SHARED_ROWS * SHARED_COLS; i += WARP_THREADS) {
    dst[i] = staging.at(i / SHARED_COLS, i % SHARED_COLS);
  }
}

// ---- mma: d = op(a) op(b) + c with operands row-major in global memory as each form stores them ---

constexpr int MMA_M = 2 * BASE_TILE;
constexpr int MMA_N = 3 * BASE_TILE;
constexpr int MMA_K = 4 * BASE_TILE;

// a: M x K (or K x M when A_TRANSPOSED), b: K x N (or N x K when B_TRANSPOSED), c and d: M x N.
template <typename T, bool A_TRANSPOSED, bool B_TRANSPOSED>
__global__ void mma_product(const T* a, const T* b, const float* c, float* d) {
  using a_tile = std::conditional_t<A_TRANSPOSED, register_tile<T, MMA_K, MMA_M, L::col>, register_tile<T, MMA_M, MMA_K, L::row>>;
  using b_tile = std::conditional_t<B_TRANSPOSED, register_tile<T, MMA_N, MMA_K, L::row>, register_tile<T, MMA_K, MMA_N, L::col>>;
  a_tile a_regs;
  b_tile b_regs;
  register_tile<float, MMA_M, MMA_N> acc;
  warp::load(a_regs, a, a_tile::cols);
  warp::load(b_regs, b, b_tile::cols);
  warp::load(acc, c, MMA_N);
  if constexpr (!A_TRANSPOSED && !B_TRANSPOSED) warp::mma_AB(acc, a_regs, b_regs, acc);
  if constexpr (!A_TRANSPOSED && B_TRANSPOSED) warp::mma_ABt(acc, a_regs, b_regs, acc);
  if constexpr (A_TRANSPOSED && !B_TRANSPOSED) warp::mma_AtB(acc, a_regs, b_regs, acc);
  if constexpr (A_TRANSPOSED && B_TRANSPOSED) warp::mma_AtBt(acc, a_regs, b_regs, acc);
  warp::store(d, MMA_N, acc);
}

// ---- maps, broadcasts, reductions, layout changes on one ROWS x COLS tile ------------------------
// The cases are written in order; test_core_warp.py lists the same names in the same order.

constexpr int TILE_CASES = 28;
constexpr int ROW_CASES = 9;
constexpr int COL_CASES = 5;

// x, y: ROWS x COLS (y > 0); u: ROWS entries (> 0); w: COLS entries (> 0).
// tiles: TILE_CASES x ROWS x COLS; rows: ROW_CASES x ROWS; cols: COL_CASES x COLS;
// transposed: COLS x ROWS (xᵀ); swapped: ROWS x COLS (x through swap_layout, 16-bit tiles only).
template <typename T, register_layout LAYOUT>
__global__ void elementwise_suite(const float* x_in, const float* y_in, const float* u_in, const float* w_in,
                                  float* tiles, float* rows, float* cols, float* transposed, float* swapped) {
  using tile = register_tile<T, ROWS, COLS, LAYOUT>;
  using row_vector = per_row_vector<tile, float>;
  using col_vector = per_col_vector<tile, float>;
  tile x, y, t;
  row_vector u, m, l;
  col_vector w, c;
  warp::load(x, x_in, COLS);
  warp::load(y, y_in, COLS);
  warp::load(u, u_in);
  warp::load(w, w_in);

  int tile_case = 0, row_case = 0, col_case = 0;
  const auto emit_tile = [&](const tile& out) { warp::store(tiles + ROWS * COLS * tile_case++, COLS, out); };
  const auto emit_row = [&](const row_vector& out) { warp::store(rows + ROWS * row_case++, out); };
  const auto emit_col = [&](const col_vector& out) { warp::store(cols + COLS * col_case++, out); };

  register_tile<bf16, ROWS, COLS, LAYOUT> narrowed;
  warp::copy(narrowed, x);
  warp::copy(t, narrowed);
  emit_tile(t);                                        // copy_through_bf16
  warp::exp2(t, x); emit_tile(t);                      // exp2
  warp::exp(t, x); emit_tile(t);                       // exp
  warp::log2(t, y); emit_tile(t);                      // log2
  warp::neg(t, x); emit_tile(t);                       // neg
  warp::add(t, x, y); emit_tile(t);                    // add
  warp::sub(t, x, y); emit_tile(t);                    // sub
  warp::mul(t, x, y); emit_tile(t);                    // mul
  warp::div(t, x, y); emit_tile(t);                    // div
  warp::max(t, x, y); emit_tile(t);                    // max
  warp::min(t, x, y); emit_tile(t);                    // min
  warp::add(t, x, 0.75f); emit_tile(t);                // add_scalar
  warp::mul(t, x, -1.25f); emit_tile(t);               // mul_scalar
  warp::add_row(t, x, u); emit_tile(t);                // add_row
  warp::sub_row(t, x, u); emit_tile(t);                // sub_row
  warp::mul_row(t, x, u); emit_tile(t);                // mul_row
  warp::div_row(t, x, u); emit_tile(t);                // div_row
  warp::add_col(t, x, w); emit_tile(t);                // add_col
  warp::sub_col(t, x, w); emit_tile(t);                // sub_col
  warp::mul_col(t, x, w); emit_tile(t);                // mul_col
  warp::div_col(t, x, w); emit_tile(t);                // div_col
  warp::zero(t); emit_tile(t);                         // zero
  warp::fill(t, 2.5f); emit_tile(t);                   // fill
  warp::neg_infty(t); emit_tile(t);                    // neg_infty
  warp::row_max(m, x);                                 // softmax: exp2(x - max) / sum
  warp::sub_row(t, x, m);
  warp::exp2(t, t);
  warp::row_sum(l, t);
  warp::div_row(t, t, l);
  emit_tile(t);
  warp::copy(t, x);
  warp::tril(t, {3, 5}, 2, -INFINITY); emit_tile(t);  // tril: keep col + 5 <= row + 3 + 2
  warp::copy(t, x);
  warp::mask(t, {7, 11}, [](int row, int col) { return (row + col) % 3 != 0; }, 0.0f);
  emit_tile(t);                                        // mask_predicate
  warp::zero(t);
  const auto last_columns = warp::columns<COLS - BASE_TILE, BASE_TILE>(x);
  for_each_pair<decltype(last_columns)>([&](int br, int bc, int q) { t.pairs[br][bc][q] = last_columns.pairs[br][bc][q]; });
  emit_tile(t);                                        // columns: x's last base-tile column first, zeros after

  warp::row_max(m, x); emit_row(m);                    // row_max
  warp::row_sum(m, x); emit_row(m);                    // row_sum
  warp::row_max(m, x, u); emit_row(m);                 // row_max_with_init
  warp::row_sum(m, x, u); emit_row(m);                 // row_sum_with_init
  emit_row(u);                                         // vector_round_trip
  warp::exp2(m, u); emit_row(m);                       // vector_exp2
  warp::row_max(m, x);
  warp::sub(m, m, u); emit_row(m);                     // vector_sub (row_max - u)
  warp::lane_row_sum(m, x);
  warp::lane_row_sum(m, y, m);
  warp::all_lanes_row_sum(m); emit_row(m);             // lane_row_sum: x's, then y's onto the partials
  warp::load(m, u_in, ROWS - 11); emit_row(m);         // bounded_load: u, zeros from ROWS - 11 on

  warp::col_max(c, x); emit_col(c);                    // col_max
  warp::col_sum(c, x); emit_col(c);                    // col_sum
  warp::col_max(c, x, w); emit_col(c);                 // col_max_with_init
  warp::col_sum(c, x, w); emit_col(c);                 // col_sum_with_init
  emit_col(w);                                         // vector_round_trip

  register_tile<T, COLS, ROWS, other(LAYOUT)> x_transposed;
  warp::transpose(x_transposed, x);
  warp::store(transposed, ROWS, x_transposed);
  if constexpr (is_16bit_float<T>) {
    register_tile<T, ROWS, COLS, other(LAYOUT)> x_swapped;
    warp::swap_layout(x_swapped, x);
    warp::store(swapped, COLS, x_swapped);
  }
}

// ---- wgmma register fragments -------------------------------------------------------------------

constexpr int WGMMA_N = 2 * BASE_TILE;

// out (64 x WGMMA_N): each lane puts the PTX ISA's coordinates of accumulator register d_k into
// element k of its accumulator tile and stores the tile; fragment_out: each register written at its
// PTX coordinates directly. Both must come back as row * WGMMA_N + col.
__global__ void accumulator_layout(float* out, float* fragment_out) {
  const int group = fragment::group_id();
  const int thread = fragment::thread_in_group();
  // The PTX ISA's formula for register d_k of wgmma .m64nNk16 (f32 accumulator).
  const auto ptx_row = [&](int k) { return warpgroup::warp_row() + group + 8 * ((k / 2) % 2); };
  const auto ptx_col = [&](int k) { return 8 * (k / 4) + 2 * thread + k % 2; };

  // d_k is element k of the accumulator tile's pairs in storage order.
  warpgroup::accumulator<WGMMA_N> accumulator;
  for_each_pair<decltype(accumulator)>([&](int, int bc, int q) {
    const int k = (bc * fragment::QUADRANTS + q) * fragment::PAIR;
    accumulator.pairs[0][bc][q] = {float(ptx_row(k) * WGMMA_N + ptx_col(k)), float(ptx_row(k + 1) * WGMMA_N + ptx_col(k + 1))};
  });
  warp::store(out + warpgroup::warp_row() * WGMMA_N, WGMMA_N, accumulator);
  for_each_pair<decltype(accumulator)>([&](int, int bc, int q) {
    const int k = (bc * fragment::QUADRANTS + q) * fragment::PAIR;
    fragment_out[ptx_row(k) * WGMMA_N + ptx_col(k)] = accumulator.pairs[0][bc][q].x;
    fragment_out[ptx_row(k + 1) * WGMMA_N + ptx_col(k + 1)] = accumulator.pairs[0][bc][q].y;
  });
}

// One m64n16k16 wgmma with A from registers, B (N x K, K-major) from shared memory without swizzle:
// d (64 x 16) = a (64 x 16) · btᵀ. Test-only: the library's wgmma wrappers live in ops/warpgroup.
constexpr int PROBE_N = BASE_TILE;
constexpr int PROBE_K = warpgroup::WGMMA_K;
constexpr int CORE_ROW_BYTES = fragment::CORE * int(sizeof(bf16));        // a core-matrix row: 8 elements
constexpr int CORE_MATRIX_BYTES = fragment::CORE * CORE_ROW_BYTES;         // 8 rows, contiguous
constexpr int K_NEIGHBOUR_BYTES = CORE_MATRIX_BYTES;                       // leading byte offset
constexpr int N_NEIGHBOUR_BYTES = 2 * CORE_MATRIX_BYTES;                   // stride byte offset
constexpr int DESCRIPTOR_ADDRESS_SHIFT = 4;                                  // fields drop 4 low bits
constexpr int DESCRIPTOR_LEADING_OFFSET_BIT = 16;
constexpr int DESCRIPTOR_STRIDE_OFFSET_BIT = 32;
constexpr uint32_t DESCRIPTOR_ADDRESS_MASK = (1u << 14) - 1;

__global__ void wgmma_register_a(const bf16* a, const bf16* bt, float* d) {
  __shared__ alignas(128) bf16 b_core_matrices[PROBE_N * PROBE_K];
  constexpr int core = fragment::CORE;
  for (int i = threadIdx.x; i < PROBE_N * PROBE_K; i += WARPGROUP_THREADS) {
    const int n = i / PROBE_K, k = i % PROBE_K;
    const int byte = (n / core) * N_NEIGHBOUR_BYTES + (k / core) * K_NEIGHBOUR_BYTES + (n % core) * CORE_ROW_BYTES +
                     (k % core) * int(sizeof(bf16));
    b_core_matrices[byte / int(sizeof(bf16))] = bt[i];
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();

  const uint32_t b_address = static_cast<uint32_t>(__cvta_generic_to_shared(b_core_matrices));
  const uint64_t descriptor =
      uint64_t((b_address >> DESCRIPTOR_ADDRESS_SHIFT) & DESCRIPTOR_ADDRESS_MASK) |
      uint64_t(K_NEIGHBOUR_BYTES >> DESCRIPTOR_ADDRESS_SHIFT) << DESCRIPTOR_LEADING_OFFSET_BIT |
      uint64_t(N_NEIGHBOUR_BYTES >> DESCRIPTOR_ADDRESS_SHIFT) << DESCRIPTOR_STRIDE_OFFSET_BIT;

  register_tile<bf16, BASE_TILE, PROBE_K> a_regs;
  warp::load(a_regs, a + warpgroup::warp_row() * PROBE_K, PROBE_K);
  uint32_t a_fragment[fragment::QUADRANTS];
  warpgroup::a_operand(a_fragment, a_regs, 0);
  warpgroup::accumulator<PROBE_N> acc;
  warp::zero(acc);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  asm volatile(
      "{\n"
      ".reg .pred accumulate;\n"
      "setp.ne.b32 accumulate, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, %12, accumulate, 1, 1, 0;\n"
      "}\n"
      : "+f"(acc.pairs[0][0][0].x), "+f"(acc.pairs[0][0][0].y), "+f"(acc.pairs[0][0][1].x), "+f"(acc.pairs[0][0][1].y),
        "+f"(acc.pairs[0][0][2].x), "+f"(acc.pairs[0][0][2].y), "+f"(acc.pairs[0][0][3].x), "+f"(acc.pairs[0][0][3].y)
      : "r"(a_fragment[0]), "r"(a_fragment[1]), "r"(a_fragment[2]), "r"(a_fragment[3]), "l"(descriptor),
        "r"(0)
      : "memory");
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  // The accumulator is read after the wait: tie its registers to it.
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  warpgroup::pin(acc);
  warp::store(d + warpgroup::warp_row() * PROBE_N, PROBE_N, acc);
}

// The same product through the library's wgmma wrapper (ops/warpgroup/wgmma.cuh) and shared tile:
// the register tiles' A operand and accumulator as the kernels will use them.
__global__ void wgmma_register_a_library(const bf16* a, const bf16* bt, float* d) {
  __shared__ shared_tile<bf16, PROBE_N, PROBE_K> b_smem;  // N x K: K-major
  for (int i = threadIdx.x; i < PROBE_N * PROBE_K; i += WARPGROUP_THREADS) b_smem.at(i / PROBE_K, i % PROBE_K) = bt[i];
  fence_async_shared();
  __syncthreads();

  register_tile<bf16, BASE_TILE, PROBE_K> a_regs;
  warp::load(a_regs, a + warpgroup::warp_row() * PROBE_K, PROBE_K);
  warpgroup::accumulator<PROBE_N> acc;
  warpgroup::fence();
  warpgroup::mma<warpgroup::operand_major::k>(acc, a_regs, b_smem, 0, false);
  warpgroup::commit();
  warpgroup::wait<0>(acc, a_regs);
  warp::store(d + warpgroup::warp_row() * PROBE_N, PROBE_N, acc);
}

// ---- prefix sums: warp::inclusive_scan over 32 * PER_LANE values, lane-major -------------------

// out = inclusive prefix sums of in (32 * PER_LANE floats); total[lane] = the total every lane got.
template <int PER_LANE>
__global__ void inclusive_scan_case(const float* in, float* out, float* total) {
  float values[PER_LANE];
  for (int k = 0; k < PER_LANE; ++k) values[k] = in[PER_LANE * lane_id() + k];
  total[lane_id()] = warp::inclusive_scan(values);
  for (int k = 0; k < PER_LANE; ++k) out[PER_LANE * lane_id() + k] = values[k];
}

// ---- complex tiles: d = op(a) op(b) + c, d = a ∘ op(b), fragment-order tables -------------------
// Complex matrices are two row-major planes (re, im), each as the real cases store them.

template <typename T, int ROWS_, int COLS_, register_layout LAYOUT = L::row>
__device__ void load_planes(complex_register_tile<T, ROWS_, COLS_, LAYOUT>& dst, const void* re, const void* im, int stride) {
  using G = std::conditional_t<std::is_same_v<T, float>, float, T>;
  warp::load(dst.re, static_cast<const G*>(re), stride);
  warp::load(dst.im, static_cast<const G*>(im), stride);
}

// a: COMPLEX_M x MMA_K, b: MMA_K x MMA_N, c and d: COMPLEX_M x MMA_N (fp32). One row block keeps
// the three complex tiles within the register file.
constexpr int COMPLEX_M = BASE_TILE;

template <typename T, bool CONJ_A, bool CONJ_B>
__global__ void complex_mma_product(const T* a_re, const T* a_im, const T* b_re, const T* b_im, const float* c_re,
                                    const float* c_im, float* d_re, float* d_im) {
  complex_register_tile<T, COMPLEX_M, MMA_K> a;
  complex_register_tile<T, MMA_K, MMA_N, L::col> b;
  complex_register_tile<float, COMPLEX_M, MMA_N> acc;
  load_planes(a, a_re, a_im, MMA_K);
  load_planes(b, b_re, b_im, MMA_N);
  load_planes(acc, c_re, c_im, MMA_N);
  warp::cmma_AB<CONJ_A, CONJ_B>(acc, a, b, acc);
  warp::store(d_re, MMA_N, acc.re);
  warp::store(d_im, MMA_N, acc.im);
}

// b is COMPLEX_SHARED_ROWS x COMPLEX_SHARED_COLS; the product reads its window at (BASE_TILE, BASE_TILE).
constexpr int COMPLEX_SHARED_ROWS = MMA_K + BASE_TILE;
constexpr int COMPLEX_SHARED_COLS = 4 * BASE_TILE;
static_assert(MMA_N + BASE_TILE <= COMPLEX_SHARED_COLS, "the window fits the shared tile");

template <typename T, bool CONJ_A, bool CONJ_B>
__global__ void complex_mma_shared_product(const T* a_re, const T* a_im, const T* b_re, const T* b_im,
                                           const float* c_re, const float* c_im, float* d_re, float* d_im) {
  using b_tile = complex_shared_tile<T, COMPLEX_SHARED_ROWS, COMPLEX_SHARED_COLS>;
  __shared__ b_tile b;
  for (int i = lane_id(); i < COMPLEX_SHARED_ROWS * COMPLEX_SHARED_COLS; i += WARP_THREADS) {
    b.re.at(i / COMPLEX_SHARED_COLS, i % COMPLEX_SHARED_COLS) = b_re[i];
    b.im.at(i / COMPLEX_SHARED_COLS, i % COMPLEX_SHARED_COLS) = b_im[i];
  }
  __syncwarp();
  complex_register_tile<T, COMPLEX_M, MMA_K> a;
  complex_register_tile<float, COMPLEX_M, MMA_N> acc;
  load_planes(a, a_re, a_im, MMA_K);
  load_planes(acc, c_re, c_im, MMA_N);
  warp::cmma_AB<CONJ_A, CONJ_B>(acc, a, b, acc, BASE_TILE, BASE_TILE);
  warp::store(d_re, MMA_N, acc.re);
  warp::store(d_im, MMA_N, acc.im);
}

// a, b, d: ROWS x COLS fp32.
template <bool CONJ_B>
__global__ void complex_product(const float* a_re, const float* a_im, const float* b_re, const float* b_im,
                                float* d_re, float* d_im) {
  complex_register_tile<float, ROWS, COLS> a, b;
  load_planes(a, a_re, a_im, COLS);
  load_planes(b, b_re, b_im, COLS);
  warp::cmul<CONJ_B>(a, a, b);
  warp::store(d_re, COLS, a.re);
  warp::store(d_im, COLS, a.im);
}

// src (ROWS x COLS) -> a fragment-order table at base tile (1, 2) of a table COLS / 16 + 3 base
// tiles wide -> dst; `table` (whose other entries the test poisons) shows what was written where.
constexpr int TABLE_COL_BLOCKS = COLS / BASE_TILE + 3;

template <typename T>
__global__ void fragments_round_trip(const T* src, T* table, T* dst) {
  register_tile<T, ROWS, COLS> tile, back;
  warp::load(tile, src, COLS);
  warp::store_fragments(table, TABLE_COL_BLOCKS, tile, 1, 2);
  __syncwarp();
  warp::load_fragments(back, table, TABLE_COL_BLOCKS, 1, 2);
  warp::store(dst, COLS, back);
}

// ---- the case table ------------------------------------------------------------------------------

using runner = cudaError_t (*)(void* const* args, cudaStream_t stream);

template <int THREADS, typename... P>
cudaError_t launch_kernel(void (*kernel)(P...), void* const* args, cudaStream_t stream) {
  return [&]<size_t... I>(std::index_sequence<I...>) {
    return pipeline::launch(kernel, 1, THREADS, 0, stream, static_cast<P>(args[I])...);
  }(std::index_sequence_for<P...>{});
}

template <auto KERNEL, int THREADS = WARP_THREADS>
cudaError_t launch(void* const* args, cudaStream_t stream) {
  return launch_kernel<THREADS>(KERNEL, args, stream);
}

struct test_case {
  const char* name;
  runner run;
};

constexpr test_case CASES[] = {
    {"global/bf16/bf16/row", launch<global_round_trip<bf16, bf16, L::row>>},
    {"global/bf16/bf16/col", launch<global_round_trip<bf16, bf16, L::col>>},
    {"global/half/half/row", launch<global_round_trip<half, half, L::row>>},
    {"global/half/half/col", launch<global_round_trip<half, half, L::col>>},
    {"global/float/float/row", launch<global_round_trip<float, float, L::row>>},
    {"global/float/float/col", launch<global_round_trip<float, float, L::col>>},
    {"global/bf16/float/row", launch<global_round_trip<bf16, float, L::row>>},
    {"global/bf16/float/col", launch<global_round_trip<bf16, float, L::col>>},

    {"shared/bf16/bf16/row/128", launch<shared_round_trip<bf16, bf16, L::row, swizzle_mode::bytes128>>},
    {"shared/bf16/bf16/col/128", launch<shared_round_trip<bf16, bf16, L::col, swizzle_mode::bytes128>>},
    {"shared/half/float/row/32", launch<shared_round_trip<half, float, L::row, swizzle_mode::bytes32>>},
    {"shared/half/float/col/32", launch<shared_round_trip<half, float, L::col, swizzle_mode::bytes32>>},
    {"shared/float/float/row/128", launch<shared_round_trip<float, float, L::row, swizzle_mode::bytes128>>},
    {"shared/float/float/col/128", launch<shared_round_trip<float, float, L::col, swizzle_mode::bytes128>>},
    {"shared/float/bf16/row/64", launch<shared_round_trip<float, bf16, L::row, swizzle_mode::bytes64>>},
    {"shared/float/bf16/col/64", launch<shared_round_trip<float, bf16, L::col, swizzle_mode::bytes64>>},

    {"mma/AB/bf16", launch<mma_product<bf16, false, false>>},
    {"mma/ABt/bf16", launch<mma_product<bf16, false, true>>},
    {"mma/AtB/bf16", launch<mma_product<bf16, true, false>>},
    {"mma/AtBt/bf16", launch<mma_product<bf16, true, true>>},
    {"mma/AB/half", launch<mma_product<half, false, false>>},
    {"mma/ABt/half", launch<mma_product<half, false, true>>},
    {"mma/AtB/half", launch<mma_product<half, true, false>>},
    {"mma/AtBt/half", launch<mma_product<half, true, true>>},

    {"suite/float/row", launch<elementwise_suite<float, L::row>>},
    {"suite/float/col", launch<elementwise_suite<float, L::col>>},
    {"suite/bf16/row", launch<elementwise_suite<bf16, L::row>>},
    {"suite/bf16/col", launch<elementwise_suite<bf16, L::col>>},

    {"scan/1", launch<inclusive_scan_case<1>>},
    {"scan/2", launch<inclusive_scan_case<2>>},
    {"scan/3", launch<inclusive_scan_case<3>>},

    {"complex/mma/bf16/ab", launch<complex_mma_product<bf16, false, false>>},
    {"complex/mma/bf16/conj_a", launch<complex_mma_product<bf16, true, false>>},
    {"complex/mma/bf16/conj_b", launch<complex_mma_product<bf16, false, true>>},
    {"complex/mma/bf16/conj_ab", launch<complex_mma_product<bf16, true, true>>},
    {"complex/mma/half/ab", launch<complex_mma_product<half, false, false>>},
    {"complex/mma/half/conj_a", launch<complex_mma_product<half, true, false>>},
    {"complex/mma_shared/bf16/ab", launch<complex_mma_shared_product<bf16, false, false>>},
    {"complex/mma_shared/bf16/conj_a", launch<complex_mma_shared_product<bf16, true, false>>},
    {"complex/mma_shared/half/conj_b", launch<complex_mma_shared_product<half, false, true>>},
    {"complex/mma_shared/half/conj_ab", launch<complex_mma_shared_product<half, true, true>>},
    {"complex/mul/b", launch<complex_product<false>>},
    {"complex/mul/conj_b", launch<complex_product<true>>},
    {"fragments/bf16", launch<fragments_round_trip<bf16>>},
    {"fragments/float", launch<fragments_round_trip<float>>},

    {"wgmma/accumulator_layout", launch<accumulator_layout, WARPGROUP_THREADS>},
    {"wgmma/register_a", launch<wgmma_register_a, WARPGROUP_THREADS>},
    {"wgmma/register_a_library", launch<wgmma_register_a_library, WARPGROUP_THREADS>},
};

}  // namespace

// Returns the cudaError_t of the launch, or -1 for an unknown case name.
extern "C" int run_case(const char* name, void* const* args, cudaStream_t stream) {
  for (const test_case& entry : CASES) {
    if (std::string_view(entry.name) == name) return entry.run(args, stream);
  }
  return -1;
}

// The suite's output counts, so the test can check its case lists against the kernel.
extern "C" void suite_case_counts(int* tile_cases, int* row_cases, int* col_cases) {
  *tile_cases = TILE_CASES;
  *row_cases = ROW_CASES;
  *col_cases = COL_CASES;
}
