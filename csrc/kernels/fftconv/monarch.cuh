// The Monarch stages (fftconv.cuh numbers them) as warp-level pieces, shared by the forward's
// convolution kernel (which also serves grad_u) and the backward's filter-gradient kernel:
//
//   load_pair         two sequences of one head -> the real and imaginary planes of an input tile
//   spectrum_rows     stages 1-3 of a 16-row strip: rows k1 of the pair's spectrum · 2/M1, in fp32
//   inverse_rows      stages 5-6 of a strip of a spectrum, into the exchange tile
//   inverse_columns   stage 7 of one output tile (16 rows n1 x output_cols columns n2), unscaled
//
// plus the table kernel's helpers and the launch of the spectrum pass (the table launch, then the
// convolution kernel with K or conj(K): fftconv_fwd.cu) that the backward reuses for grad_u.
// The stages take u's element type T; precision<T> (precision.cuh) says how its operands meet the
// tensor cores: as they are for bf16/fp16, split into bf16 hi + lo for fp32.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "fftconv.cuh"
#include "fftconv.h"
#include "precision.cuh"
#include "tk/tk.cuh"

namespace tk::fftconv {

using half_dtypes = one_of<element_type::bf16, element_type::fp16>;
using seq_lens = one_of<256, 512, 1024, 2048, 4096, 8192, 16384>;
// fp32 u: its split tiles take twice the shared memory; at N = 16384 the input and exchange tiles
// alone would need 384 KB (227 KB a block), so that N runs the reference.
using split_dtypes = one_of<element_type::fp32>;
using split_seq_lens = one_of<256, 512, 1024, 2048, 4096, 8192>;

// Whether the kernels take u of this dtype and (power-of-two) sequence length.
inline bool runs_on_kernels(element_type dtype, int64_t seq_len) {
  return half_dtypes::contains(dtype) ? seq_lens::contains(seq_len)
                                      : split_dtypes::contains(dtype) && split_seq_lens::contains(seq_len);
}

// The sequence lengths the kernels take for u of this dtype, for messages.
inline std::string kernel_seq_len_names(element_type dtype) {
  return split_dtypes::contains(dtype) ? split_seq_lens::names() : seq_lens::names();
}

constexpr int VECTOR_BYTES = 16;  // sequences move in 16-byte vectors

// W_size^index = exp(-2 pi i index / size), from the exact residue (double, then rounded once).
__device__ inline float2 unit_root(int64_t index, int64_t size) {
  double s, c;
  sincospi(2.0 * double(index % size) / double(size), &s, &c);
  return {float(c), float(-s)};
}

// Two sequences of one head, batches first and first + 1 (if < B): one complex pass.
struct pair_of_sequences {
  int head;
  int first;
};

// What the spectrum pass multiplies the pair's spectrum by: K (the convolution, the forward) or
// conj(K) (the correlation with the filter, grad_u).
enum class filter_spectrum { plain, conjugate };

// The spectrum pass on `p` (its u is the pass's input, its y the output, D the skip factor): the
// table launch with `use`, then the convolution kernel. Defined in fftconv_fwd.cu.
cudaError_t launch_spectrum_pass(const forward_problem& p, filter_spectrum use, cudaStream_t stream);

template <typename T, int N>
struct monarch_stages {
  using plan = monarch_plan<N>;
  using operand = typename precision<T>::operand;
  template <typename X> using carried = typename precision<T>::template carried<X>;
  static constexpr int threads = plan::warps * WARP_THREADS;
  static constexpr int elements_per_vector = VECTOR_BYTES / int(sizeof(T));  // of u in global memory
  // K of the F_M1 operand held at once (stages 1 and 7): the registers of K_CHUNK 16-bit columns,
  // so half the columns when split (at K = 64 the filter-gradient kernel's stage 7 spills at N = 8192).
  static constexpr int stage1_k = std::min(plan::stage1_k, K_CHUNK / precision<T>::parts);
  static constexpr int stage7_k = std::min(plan::stage7_k, K_CHUNK / precision<T>::parts);

  using input_tile = carried<complex_shared_tile<operand, plan::input_rows, plan::cols>>;  // a pair, rows n1 < M1/2
  using exchange_tile = carried<complex_shared_tile<operand, plan::rows, plan::cols>>;     // stage 6 -> stage 7
  using row_dft_tile = carried<complex_shared_tile<operand, plan::cols, plan::cols>>;      // F_M2

  using strip_acc = complex_register_tile<float, BASE_TILE, plan::cols>;
  using strip_operand = carried<complex_register_tile<operand, BASE_TILE, plan::cols>>;
  using output_acc = complex_register_tile<float, BASE_TILE, plan::output_cols>;
  using table_tile = complex_register_tile<float, BASE_TILE, BASE_TILE>;

  // The first row n1 and column n2 of output tile `task` (stage 7's unit of work).
  __device__ static int output_row0(int task) { return BASE_TILE * (task / plan::output_groups); }
  __device__ static int output_col0(int task) { return task % plan::output_groups * plan::output_cols; }

  __device__ static void fill_row_dft(row_dft_tile& f) {
    for (int i = threadIdx.x; i < plan::cols * plan::cols; i += threads) {
      const int r = i / plan::cols, c = i % plan::cols;
      set_entry(f, r, c, unit_root(int64_t(r) * c, plan::cols));
    }
  }

  // x's pair, row-major as the M1/2 x M2 top of the matrix; a missing second sequence is zero.
  __device__ static void load_pair(input_tile& in, const T* x, int64_t batch_stride, int64_t head_stride, int batch,
                                   pair_of_sequences pr) {
    constexpr int vectors = N / elements_per_vector;
    for (int i = threadIdx.x; i < 2 * vectors; i += threads) {
      const int part = i / vectors, n = (i % vectors) * elements_per_vector;
      const int b = pr.first + part;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (b < batch) v = *reinterpret_cast<const uint4*>(x + b * batch_stride + pr.head * head_stride + n);
      store_vector(in, part, n / plan::cols, n % plan::cols, v);
    }
  }

  // acc ∘= op(table) for the strip's base tiles (block_row, 0 .. col_blocks - 1) of a table.
  template <bool CONJ>
  __device__ static void multiply_by_table(strip_acc& acc, const float* re, const float* im, int block_row) {
    [&]<int... BC>(std::integer_sequence<int, BC...>) {
      ([&] {
        table_tile factor;
        warp::load_fragments(factor, re, im, plan::col_blocks, block_row, BC);
        auto block = warp::columns<BC * BASE_TILE, BASE_TILE>(acc);
        warp::cmul<CONJ>(block, block, factor);
        warp::set_columns<BC * BASE_TILE>(acc, block);
      }(), ...);
    }(std::make_integer_sequence<int, plan::col_blocks>{});
  }

  // Stages 1-3 of one strip: acc = ((F_M1[strip rows, :M1/2] · in) ∘ T · 2/M1) · F_M2; x holds the
  // 16-bit (or hi + lo) stage-2 result (the caller's strip, so that no second one is live).
  __device__ static void spectrum_rows(strip_acc& acc, strip_operand& x, const input_tile& in,
                                       const row_dft_tile& row_dft, const tables<T, N>& tab, int strip) {
    warp::zero(acc);
    for (int k0 = 0; k0 < plan::input_rows; k0 += stage1_k) {
      carried<complex_register_tile<operand, BASE_TILE, stage1_k>> dft;
      warp::load_fragments(dft, tab.dft, plan::strips, strip, k0 / BASE_TILE);
      warp::cmma_AB(acc, dft, in, acc, k0, 0);
    }
    multiply_by_table<false>(acc, tab.twiddle_re, tab.twiddle_im, strip);
    warp::copy(x, acc);
    warp::zero(acc);
    warp::cmma_AB(acc, x, row_dft, acc, 0, 0);
  }

  // Stages 5-6 of the strip x of a spectrum, into its rows of the exchange tile.
  __device__ static void inverse_rows(const strip_operand& x, exchange_tile& exchange, const row_dft_tile& row_dft,
                                      const tables<T, N>& tab, int strip) {
    strip_acc acc;
    warp::zero(acc);
    warp::cmma_AB<false, true>(acc, x, row_dft, acc, 0, 0);
    multiply_by_table<true>(acc, tab.twiddle_re, tab.twiddle_im, strip);
    warp::mul(acc, acc, plan::inverse_twiddle_scale);
    warp::store(exchange, acc, BASE_TILE * strip, 0);
  }

  // Stage 7 of output tile `task`: acc = conj(F_M1)[its rows, :] · exchange[:, its columns].
  __device__ static void inverse_columns(output_acc& acc, const exchange_tile& exchange, const tables<T, N>& tab,
                                         int task) {
    const int strip = output_row0(task) / BASE_TILE;
    warp::zero(acc);
    for (int k0 = 0; k0 < plan::rows; k0 += stage7_k) {
      carried<complex_register_tile<operand, BASE_TILE, stage7_k>> dft;
      warp::load_fragments(dft, tab.dft, plan::strips, strip, k0 / BASE_TILE);
      warp::cmma_AB<true, false>(acc, dft, exchange, acc, k0, output_col0(task));
    }
  }
};

// Whether rows of sequences at x (elements of element_bytes) with these (element) strides start on
// 16-byte boundaries.
inline bool rows_aligned(const void* x, int64_t batch_stride, int64_t head_stride, int64_t element_bytes) {
  const int64_t per_vector = VECTOR_BYTES / element_bytes;
  return reinterpret_cast<uintptr_t>(x) % VECTOR_BYTES == 0 && batch_stride % per_vector == 0 &&
         head_stride % per_vector == 0;
}

// A persistent grid for `work_items` independent items: at most the blocks that are resident at once.
template <typename Params>
cudaError_t launch_persistent(void (*entry)(Params), int threads, size_t shared_bytes, int64_t work_items,
                              cudaStream_t stream, const Params& p) {
  if (const cudaError_t err = pipeline::allow_shared_bytes(reinterpret_cast<const void*>(entry), shared_bytes);
      err != cudaSuccess) {
    return err;
  }
  int device = 0, blocks_per_sm = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (const cudaError_t err = pipeline::resident_blocks_per_sm(&blocks_per_sm, entry, threads, shared_bytes);
      err != cudaSuccess) {
    return err;
  }
  const int64_t grid = std::min<int64_t>(work_items, int64_t(pipeline::sm_count(device)) * std::max(blocks_per_sm, 1));
  return pipeline::launch(entry, dim3(unsigned(grid)), threads, shared_bytes, stream, p);
}

// f.template operator()<T, N>() for u's element type and a sequence length that runs_on_kernels.
template <typename F>
auto with_kernel(element_type dtype, int64_t seq_len, F&& f) {
  const auto run = [&]<element_type E, int N>() { return f.template operator()<element_t<E>, N>(); };
  if (split_dtypes::contains(dtype)) return dispatch<split_dtypes, split_seq_lens>(run, dtype, int(seq_len));
  return dispatch<half_dtypes, seq_lens>(run, dtype, int(seq_len));
}

}  // namespace tk::fftconv
