// The Monarch plan of the FFT convolution: the FFT of size M = 2N written as an M1 x M2 matrix.
//
// Index n = M2 n1 + n2 (n1 < M1, n2 < M2) lays a sequence out row-major; the DFT is then
//   X[k1 + M1 k2] = sum_n2 W_M2^(n2 k2) W_M^(n2 k1) sum_n1 W_M1^(n1 k1) x[M2 n1 + n2],
// i.e. three matrix steps on the M1 x M2 matrix A (F_s: the DFT matrix of size s, symmetric):
//   F_M1 · A (a column DFT), ∘ T (twiddles T[k1, n2] = W_M^(k1 n2)), · F_M2 (a row DFT),
// which leaves X[k1 + M1 k2] at (k1, k2). The inverse runs the same steps backwards with conjugate
// factors and lands in the natural order again, so nothing is ever transposed:
//
//   stage 1   F_M1[:, :M1/2] · A      u fills rows n1 < M1/2 only: the causal zero padding halves K
//   stage 2   ∘ T · 2/M1             stage 1 then averages, so no 16-bit rounding grows with M1
//   stage 3   · F_M2
//   stage 4   ∘ K / M2               K: the filter's spectrum in the same (k1, k2) order
//   stage 5   · conj(F_M2)
//   stage 6   ∘ conj(T) · 1/M2        (conj(T · 2/M1) times M1 / (2 M2))
//   stage 7   conj(F_M1)[:M1/2, :] · (the result) · M2/2     only rows n1 < M1/2 (t < N) are needed
//
// The scales multiply to 1/M, the inverse DFT's; they keep every value rounded to 16 bits (after
// stages 2, 4 and 6) within sqrt(2) max|u| sum|k| (fp16 cannot overflow before the output can),
// and stage 7 scales in fp32. For fp32 u each of those 16-bit roundings (and the input's, the DFT
// factors') is a split into bf16 hi + lo, and each product takes three mma.sync (precision.cuh):
// fp32-level results for twice the shared memory, which caps fp32 u at N = 8192.
//
// Two sequences of one head (batches 2j and 2j + 1) travel as the real and imaginary parts of one
// complex sequence: the filter is real, so the two convolutions come back in the real and
// imaginary parts, and a complex FFT serves two real ones.
//
// A block takes one such pair at a time (a persistent grid strides over them, a head's pairs
// adjacent so its spectrum is read from L2). Each warp owns 16-row strips of the M1 x M2 matrix
// and carries them through stages 1-6 in registers (complex mma.sync products, fp32 accumulators):
// stage 1 reads its strip of F_M1 from a table and the input from shared memory, stages 3 and 5
// read F_M2 from shared memory. Stage 7 mixes all rows, so the strips meet once in shared memory.
#pragma once

#include <cstdint>

#include "precision.cuh"
#include "tk/common.cuh"

namespace tk::fftconv {

constexpr int MAX_WARPS = 8;  // warps per block; a plan with more strips gives each warp several
constexpr int K_CHUNK = 64;   // K of the F_M1 operand held at once: 16 x 64 complex, 32 registers

template <int N>
struct monarch_plan {
  static constexpr int seq_len = N;
  static constexpr int fft_size = 2 * N;                                   // M
  static constexpr int cols = N == 256 ? 16 : N <= 1024 ? 32 : 64;         // M2
  static constexpr int rows = fft_size / cols;                             // M1
  static constexpr int input_rows = rows / 2;                              // where u lies
  static constexpr int strips = rows / BASE_TILE;                          // of stages 1-6
  static constexpr int col_blocks = cols / BASE_TILE;
  static constexpr int warps = strips < MAX_WARPS ? strips : MAX_WARPS;
  static constexpr int stage1_k = input_rows < K_CHUNK ? input_rows : K_CHUNK;
  static constexpr int stage7_k = rows < K_CHUNK ? rows : K_CHUNK;
  // Stage 7: the output's input_rows x cols, as 16-row strips cut into column groups so that
  // every warp gets work where there is enough of it.
  static constexpr int output_strips = input_rows / BASE_TILE;
  static constexpr int spread_cols = cols * output_strips / warps;
  static constexpr int output_cols = spread_cols < BASE_TILE ? BASE_TILE : spread_cols > cols ? cols : spread_cols;
  static constexpr int output_groups = cols / output_cols;
  static constexpr int output_tasks = output_strips * output_groups;

  static constexpr float forward_scale = 2.0f / rows;                       // stage 2, in the twiddle table
  static constexpr float filter_scale = 1.0f / cols;                        // stage 4, in the spectrum table
  static constexpr float inverse_twiddle_scale = float(rows) / (2 * cols);  // stage 6
  static constexpr float output_scale = cols / 2.0f;                        // stage 7

  // cols: the (16-byte) vectors of a 16-bit row, and the whole rows of stage 1's K chunks.
  static_assert(rows * cols == fft_size && rows >= 2 * BASE_TILE && cols % BASE_TILE == 0, "M1 x M2 tiles the FFT");
  static_assert(input_rows % stage1_k == 0 && rows % stage7_k == 0 && stage1_k % BASE_TILE == 0, "K chunks tile K");
  static_assert(strips % warps == 0 && cols % output_cols == 0 && output_cols % BASE_TILE == 0, "warps share work evenly");
};

// The tables the setup launch writes into the workspace (fragment order, ops/warp/fragments.cuh),
// each complex table as a real and an imaginary plane:
//   dft       F_M1 (M1 x M1, u's 16-bit type, or bf16 hi and lo planes for fp32 u: precision.cuh):
//             stage 1 reads strips of it, stage 7 strips of its conjugate
//   twiddle   T · 2/M1 (M1 x M2, fp32)
//   spectrum  K / M2 per head (H M1 x M2, fp32)
template <typename T, int N>
struct tables {
  using plan = monarch_plan<N>;
  using operand = typename precision<T>::operand;
  static constexpr int64_t dft_entries = int64_t(plan::rows) * plan::rows;
  static constexpr int64_t matrix_entries = plan::fft_size;

  typename precision<T>::template carried<complex_table<operand>> dft;
  float* twiddle_re;
  float* twiddle_im;
  float* spectrum_re;
  float* spectrum_im;

  __host__ __device__ static constexpr int64_t bytes(int64_t heads) {
    return 2 * precision<T>::parts * dft_entries * int64_t(sizeof(operand)) +
           2 * (1 + heads) * matrix_entries * int64_t(sizeof(float));
  }

  __host__ __device__ static tables at(void* workspace, int64_t heads) {
    tables t;
    operand* const planes_end = place(t.dft, static_cast<operand*>(workspace));
    t.twiddle_re = reinterpret_cast<float*>(planes_end);
    t.twiddle_im = t.twiddle_re + matrix_entries;
    t.spectrum_re = t.twiddle_im + matrix_entries;
    t.spectrum_im = t.spectrum_re + heads * matrix_entries;
    return t;
  }

 private:
  // A complex table's planes from `first` on; returns the end.
  __host__ __device__ static operand* place(complex_table<operand>& table, operand* first) {
    table.re = first;
    table.im = table.re + dft_entries;
    return table.im + dft_entries;
  }
  __host__ __device__ static operand* place(hi_lo<complex_table<operand>>& table, operand* first) {
    return place(table.lo, place(table.hi, first));
  }
};

}  // namespace tk::fftconv
