// FFT convolution backward on the forward's Monarch stages (fftconv.cuh, monarch.cuh). With G, U, K
// the spectra (size M = 2N) of grad_y, u (zero-padded) and the filter:
//
//   grad_u = IFFT(G ∘ conj(K))[:N] + D grad_y   the correlation with the filter: the forward's
//            convolution kernel on grad_y with the conjugate spectrum table (exact for t < N:
//            grad_y is zero past N and s < L <= N, so nothing wraps around)
//   grad_k = IFFT(sum_b G_b ∘ conj(U_b))[:L]     filter_gradient_kernel: the batch sum in frequency
//            space, one inverse per head
//   grad_D = sum_{b, t} grad_y u                 the same kernel, in fp32
//
// Two sequences per complex pass, as in the forward: with z_g = g_a + i g_b and z_u = u_a + i u_b
// (batches a, b of one head),
//   FFT(z_g) ∘ conj(FFT(z_u)) = (G_a conj U_a + G_b conj U_b) + i (G_b conj U_a - G_a conj U_b),
// and both brackets are spectra of real correlations: the real part of the inverse is the pair's
// share of grad_k, the imaginary part (cross terms) is dropped.
//
// filter_gradient_kernel: one head at a time per block (a persistent grid strides over the heads),
// so each head's sum has one owner and a fixed order: no atomics, the same bits every run. Per pair
// of the head: u and grad_y -> shared memory; per strip (owned by one warp for the whole head),
// stages 1-3 of both, the product, added in fp32 to the head's sum in the workspace (the spectrum
// planes, free once grad_u's pass has read them; each lane rereads only what it wrote). After the
// last pair: the sum scaled by a power of two that brings its largest entry into [0.5, 1) (the
// 16-bit rounding before the inverse then loses nothing to the size of grad_y and u), stages 5-6
// into the exchange tile (which reuses the inputs' bytes), stage 7 for the rows s < L, the real
// part scaled back in fp32 -> grad_k.
#include <cmath>

#include "monarch.cuh"

namespace tk::fftconv {
namespace {

template <typename T, int N>
struct filter_gradient_kernel {
  using plan = monarch_plan<N>;
  using stages = monarch_stages<T, N>;
  static constexpr int threads = stages::threads;
  // Stage 7's factor: the two forward scales 2/M1 of the product and the inverse's 1/M2 (stage 6)
  // leave 4/M1 times the inverse DFT.
  static constexpr float output_scale = plan::rows / 4.0f;

  struct pair_inputs {
    typename stages::input_tile u;
    typename stages::input_tile grad;
  };
  struct storage {
    union {  // the inputs until the head's last pair, then the inverse's exchange tile
      pair_inputs inputs;
      typename stages::exchange_tile exchange;
    };
    typename stages::row_dft_tile row_dft;
    float largest_partials[plan::warps];
    float dot_partials[plan::warps];
  };

  struct params {
    const T* grad;
    int64_t grad_batch_stride, grad_head_stride;
    const T* u;
    int64_t u_batch_stride, u_head_stride;
    float* grad_k;  // (H, N)
    float* grad_D;  // (H,) or null
    int batch, heads, pairs_per_head, filter_len;
    tables<T, N> tab;  // the spectrum planes hold the heads' sums
  };

  __device__ static void add_table(typename stages::strip_acc& acc, const float* re, const float* im, int block_row) {
    [&]<int... BC>(std::integer_sequence<int, BC...>) {
      ([&] {
        typename stages::table_tile earlier;
        warp::load_fragments(earlier, re, im, plan::col_blocks, block_row, BC);
        auto block = warp::columns<BC * BASE_TILE, BASE_TILE>(acc);
        warp::add(block.re, block.re, earlier.re);
        warp::add(block.im, block.im, earlier.im);
        warp::set_columns<BC * BASE_TILE>(acc, block);
      }(), ...);
    }(std::make_integer_sequence<int, plan::col_blocks>{});
  }

  // The largest |re|, |im| among this lane's entries (NaN is skipped: it reaches grad_k anyway).
  __device__ static float lane_largest(const typename stages::strip_acc& acc) {
    float largest = 0.0f;
    const auto scan = [&](const typename stages::strip_acc::plane& plane) {
      for_each_pair<typename stages::strip_acc::plane>([&](int br, int bc, int q) {
        const float2 v = plane.pairs[br][bc][q];
        largest = fmaxf(largest, fmaxf(fabsf(v.x), fabsf(v.y)));
      });
    };
    scan(acc.re);
    scan(acc.im);
    return largest;
  }

  // Stages 1-3 of one strip of an input tile, rounded to the operands' 16 bits (or split into hi +
  // lo). A call of its own, as in the forward: only that strip crosses it, so no two fp32 strips
  // are live at once.
  __device__ __noinline__ static void spectrum_strip(typename stages::strip_operand& x,
                                                     const typename stages::input_tile& in, storage& s,
                                                     const params& p, int strip) {
    typename stages::strip_acc acc;
    stages::spectrum_rows(acc, x, in, s.row_dft, p.tab, strip);
    warp::copy(x, acc);
  }

  // The head's sum, strip rows (+)= spectrum(grad_y pair) ∘ conj(spectrum(u pair)) in fp32; returns
  // the lane's largest entry of the new sum.
  __device__ __noinline__ static float accumulate_strip(storage& s, const params& p, int head, int strip, bool first) {
    typename stages::strip_operand u_spectrum, grad_spectrum;
    spectrum_strip(u_spectrum, s.inputs.u, s, p, strip);
    spectrum_strip(grad_spectrum, s.inputs.grad, s, p, strip);
    typename stages::strip_acc acc;
    warp::cmul<true>(acc, grad_spectrum, u_spectrum);
    const int block_row = head * plan::strips + strip;
    if (!first) add_table(acc, p.tab.spectrum_re, p.tab.spectrum_im, block_row);
    warp::store_fragments(p.tab.spectrum_re, p.tab.spectrum_im, plan::col_blocks, acc, block_row, 0);
    return lane_largest(acc);
  }

  // Stages 5-6 of the head's sum (times `normalize`), into the exchange tile.
  __device__ __noinline__ static void inverse_strip(storage& s, const params& p, int head, int strip, float normalize) {
    typename stages::strip_acc acc;
    warp::load_fragments(acc, p.tab.spectrum_re, p.tab.spectrum_im, plan::col_blocks, head * plan::strips + strip, 0);
    warp::mul(acc, acc, normalize);
    typename stages::strip_operand x;
    warp::copy(x, acc);
    stages::inverse_rows(x, s.exchange, s.row_dft, p.tab, strip);
  }

  // Stage 7 of one output tile, its real part -> grad_k[head, n1 M2 + n2].
  __device__ static void output_tile(storage& s, const params& p, int head, int task, float scale) {
    typename stages::output_acc acc;
    stages::inverse_columns(acc, s.exchange, p.tab, task);
    warp::mul(acc.re, acc.re, scale);
    const int64_t offset = int64_t(stages::output_row0(task)) * plan::cols + stages::output_col0(task);
    warp::store(p.grad_k + int64_t(head) * N + offset, plan::cols, acc.re);
  }

  // This thread's share of sum grad_y u over the pair in shared memory, 16-byte vectors of 16-bit
  // operands at a time (hi + lo for fp32: 2^-17 of each value, within fp32's sum of N terms); a
  // missing second sequence is zero in both.
  __device__ static float pair_dot(const storage& s) {
    constexpr int values_per_vector = VECTOR_BYTES / int(sizeof(typename stages::operand));
    constexpr int vectors = N / values_per_vector;
    float dot = 0.0f;
    for (int i = threadIdx.x; i < 2 * vectors; i += threads) {
      const int part = i / vectors, n = (i % vectors) * values_per_vector;
      const int row = n / plan::cols, col = n % plan::cols;
      const auto u_vector = load_vector(s.inputs.u, part, row, col);
      const auto grad_vector = load_vector(s.inputs.grad, part, row, col);
#pragma unroll
      for (int j = 0; j < values_per_vector / 2; ++j) {
        using operand = typename stages::operand;
        const float2 a = vector_pair<operand>(u_vector, j), b = vector_pair<operand>(grad_vector, j);
        dot += a.x * b.x + a.y * b.y;
      }
    }
    return dot;
  }

  // op over one value per thread, combined in a fixed order; every thread gets the result.
  template <typename Op>
  __device__ static float across_block(float value, float (&partials)[plan::warps]) {
    value = warp::across_warp<Op>(value);
    if (lane_id() == 0) partials[warp_id()] = value;
    __syncthreads();
    float total = partials[0];
    for (int w = 1; w < plan::warps; ++w) total = Op::apply(total, partials[w]);
    return total;
  }

  // The exponent e of a power of two that brings `largest` into [0.5, 1): 0 for 0, Inf or NaN.
  __device__ static int normalizing_exponent(float largest) {
    if (!(largest > 0.0f) || !isfinite(largest)) return 0;
    int exponent = 0;
    frexpf(largest, &exponent);
    return exponent;
  }

  // Barriers: a pair's inputs are rewritten only once every warp is done with the last pair's (or
  // the last head's exchange tile), read once all threads wrote them; the exchange tile is written
  // once every warp is done with the inputs, read once all warps wrote it. The partials of
  // across_block are rewritten a head later, after those barriers.
  __device__ static void run(const params& p) {
    storage& s = pipeline::block_storage<storage>();
    stages::fill_row_dft(s.row_dft);
    for (int head = blockIdx.x; head < p.heads; head += gridDim.x) {
      float dot = 0.0f, largest = 0.0f;
      for (int pair = 0; pair < p.pairs_per_head; ++pair) {
        const pair_of_sequences pr{head, 2 * pair};
        __syncthreads();
        stages::load_pair(s.inputs.u, p.u, p.u_batch_stride, p.u_head_stride, p.batch, pr);
        stages::load_pair(s.inputs.grad, p.grad, p.grad_batch_stride, p.grad_head_stride, p.batch, pr);
        __syncthreads();
        if (p.grad_D != nullptr) dot += pair_dot(s);
        const bool last = pair == p.pairs_per_head - 1;
        for (int strip = warp_id(); strip < plan::strips; strip += plan::warps) {
          const float strip_largest = accumulate_strip(s, p, head, strip, pair == 0);
          if (last) largest = fmaxf(largest, strip_largest);
        }
      }
      __syncthreads();
      const int exponent = normalizing_exponent(across_block<op::max>(largest, s.largest_partials));
      for (int strip = warp_id(); strip < plan::strips; strip += plan::warps) {
        inverse_strip(s, p, head, strip, ldexpf(1.0f, -exponent));
      }
      __syncthreads();
      const float scale = ldexpf(output_scale, exponent);
      for (int task = warp_id(); task < plan::output_tasks; task += plan::warps) {
        if (stages::output_row0(task) * plan::cols < p.filter_len) output_tile(s, p, head, task, scale);
      }
      if (p.grad_D != nullptr) {
        const float total = across_block<op::add>(dot, s.dot_partials);
        if (threadIdx.x == 0) p.grad_D[head] = total;
      }
    }
  }
};

template <typename K>
__global__ void __launch_bounds__(K::threads, 1) filter_gradient_entry(const __grid_constant__ typename K::params p) {
  K::run(p);
}

// ------------------------------------------------------------------------------------- host

template <typename T, int N>
cudaError_t run_filter_gradient(const backward_problem& pr, cudaStream_t stream) {
  using K = filter_gradient_kernel<T, N>;
  typename K::params p;
  p.grad = static_cast<const T*>(pr.grad);
  p.grad_batch_stride = pr.grad_batch_stride;
  p.grad_head_stride = pr.grad_head_stride;
  p.u = static_cast<const T*>(pr.u);
  p.u_batch_stride = pr.u_batch_stride;
  p.u_head_stride = pr.u_head_stride;
  p.grad_k = pr.grad_k;
  p.grad_D = pr.D != nullptr ? pr.grad_D : nullptr;
  p.batch = int(pr.batch);
  p.heads = int(pr.heads);
  p.pairs_per_head = int(ceil_div<int64_t>(pr.batch, 2));
  p.filter_len = int(pr.filter_len);
  p.tab = tables<T, N>::at(pr.workspace, pr.heads);
  return launch_persistent(filter_gradient_entry<K>, K::threads, pipeline::shared_bytes<typename K::storage>, p.heads,
                           stream, p);
}

// grad_u's pass: the forward's kernel on grad_y (with conj(K), launch_spectrum_pass's `use`).
forward_problem correlation_pass(const backward_problem& p) {
  forward_problem c{};
  c.dtype = p.dtype;
  c.u = p.grad;
  c.batch = p.batch;
  c.heads = p.heads;
  c.seq_len = p.seq_len;
  c.u_batch_stride = p.grad_batch_stride;
  c.u_head_stride = p.grad_head_stride;
  c.spectrum = p.spectrum;
  c.spectrum_head_stride = p.spectrum_head_stride;
  c.D = p.D;
  c.y = p.grad_u;
  c.workspace = p.workspace;
  return c;
}

}  // namespace

std::string unsupported_reason(const backward_problem& p) {
  if (!half_dtypes::contains(p.dtype) && !split_dtypes::contains(p.dtype)) {
    return "the kernels take bf16, fp16 and fp32 u and grad";
  }
  if (!rows_aligned(p.grad, p.grad_batch_stride, p.grad_head_stride, element_bytes(p.dtype))) {
    return "grad's rows must start on 16-byte boundaries (its address and batch/head strides)";
  }
  if (std::string reason = unsupported_reason(correlation_pass(p)); !reason.empty()) return reason;
  if (!rows_aligned(p.u, p.u_batch_stride, p.u_head_stride, element_bytes(p.dtype))) {
    return "u's rows must start on 16-byte boundaries (its address and batch/head strides)";
  }
  if (p.filter_len < 1 || p.filter_len > p.seq_len) return "the filter length must be in [1, N]";
  if (reinterpret_cast<uintptr_t>(p.grad_k) % VECTOR_BYTES != 0) return "grad_k must be 16-byte aligned";
  if (p.D != nullptr && p.grad_D == nullptr) return "grad_D is needed when D is given";
  return {};
}

// grad_u's pass reads the spectrum table that the filter-gradient kernel then overwrites with the
// heads' sums: stream order keeps them apart.
cudaError_t launch(const backward_problem& p, cudaStream_t stream) {
  if (const cudaError_t err = launch_spectrum_pass(correlation_pass(p), filter_spectrum::conjugate, stream);
      err != cudaSuccess) {
    return err;
  }
  return with_kernel(p.dtype, p.seq_len, [&]<typename T, int N>() { return run_filter_gradient<T, N>(p, stream); });
}

}  // namespace tk::fftconv
