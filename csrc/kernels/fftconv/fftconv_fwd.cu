// FFT convolution forward on tensor cores (the plan: fftconv.cuh; the stages: monarch.cuh). The
// backward's grad_u runs the same two kernels on grad_y with conj(K) (fftconv_bwd.cu).
//
//   prepare_kernel       one warp per base tile of a table: F_M1, the twiddles and every head's
//                        spectrum K or conj(K) (from rfft(k, 2N) by Hermitian symmetry), in fragment order
//   convolution_kernel   per pair of sequences: u -> shared memory; per strip, stages 1-6 in
//                        registers -> shared memory; per output tile, stage 7, + D u, -> y
#include <climits>

#include "monarch.cuh"

namespace tk::fftconv {
namespace {

constexpr int PREPARE_THREADS = 256;

// ------------------------------------------------------------------------------------ tables

template <typename T, int N>
struct prepare_params {
  tables<T, N> out;
  const float* spectrum;  // rfft(k, 2N), (re, im) pairs
  int64_t spectrum_head_stride;
  int heads;
  float spectrum_im_sign;  // -1 lays out conj(K) (filter_spectrum::conjugate)
};

// The base tile at (row0, col0) of a complex matrix whose entries value(row, col) returns (re, im):
// a complex register tile of one base tile, or its hi + lo split (precision.cuh).
template <typename Tile, typename F>
__device__ Tile base_tile_of(int row0, int col0, F&& value) {
  Tile tile;
  for_each_pair<register_tile<float, BASE_TILE, BASE_TILE>>([&](int, int, int q) {
    float2 re, im;
    const fragment::coord first = fragment::pair_element_coord<register_layout::row>(q, 0);
    const fragment::coord second = fragment::pair_element_coord<register_layout::row>(q, 1);
    const float2 a = value(row0 + first.row, col0 + first.col);
    const float2 b = value(row0 + second.row, col0 + second.col);
    re = {a.x, b.x};
    im = {a.y, b.y};
    set_quadrant(tile, q, re, im);
  });
  return tile;
}

using table_tile = complex_register_tile<float, BASE_TILE, BASE_TILE>;

template <typename T, int N>
__global__ void __launch_bounds__(PREPARE_THREADS) prepare_kernel(const __grid_constant__ prepare_params<T, N> p) {
  using plan = monarch_plan<N>;
  constexpr int64_t dft_tiles = int64_t(plan::strips) * plan::strips;
  constexpr int64_t matrix_tiles = int64_t(plan::strips) * plan::col_blocks;
  const int64_t job = (int64_t(blockIdx.x) * PREPARE_THREADS + threadIdx.x) / WARP_THREADS;
  if (job < dft_tiles) {
    const int r = int(job / plan::strips), c = int(job % plan::strips);
    using dft_tile = typename monarch_stages<T, N>::template carried<
        complex_register_tile<typename precision<T>::operand, BASE_TILE, BASE_TILE>>;
    const auto tile = base_tile_of<dft_tile>(BASE_TILE * r, BASE_TILE * c,
                                             [](int row, int col) { return unit_root(int64_t(row) * col, plan::rows); });
    warp::store_fragments(p.out.dft, plan::strips, tile, r, c);
    return;
  }
  const int64_t matrix_job = job - dft_tiles;
  const int64_t head_slot = matrix_job / matrix_tiles;  // 0: the twiddles, 1 + h: head h's spectrum
  if (head_slot > p.heads) return;
  const int s = int(matrix_job % matrix_tiles / plan::col_blocks), bc = int(matrix_job % plan::col_blocks);
  if (head_slot == 0) {
    const auto tile = base_tile_of<table_tile>(BASE_TILE * s, BASE_TILE * bc, [](int k1, int n2) {
      const float2 w = unit_root(int64_t(k1) * n2, plan::fft_size);
      return float2{w.x * plan::forward_scale, w.y * plan::forward_scale};
    });
    warp::store_fragments(p.out.twiddle_re, p.out.twiddle_im, plan::col_blocks, tile, s, bc);
    return;
  }
  const int head = int(head_slot - 1);
  const float* spectrum = p.spectrum + 2 * head * p.spectrum_head_stride;
  const auto tile = base_tile_of<table_tile>(BASE_TILE * s, BASE_TILE * bc, [&](int k1, int k2) {
    const int k = k1 + plan::rows * k2;
    // rfft keeps k <= N; a real filter's spectrum is Hermitian: K[M - k] = conj(K[k]).
    const bool mirrored = k > N;
    const int stored = mirrored ? plan::fft_size - k : k;
    const float re = spectrum[2 * stored], im = spectrum[2 * stored + 1] * p.spectrum_im_sign;
    return float2{re * plan::filter_scale, (mirrored ? -im : im) * plan::filter_scale};
  });
  warp::store_fragments(p.out.spectrum_re, p.out.spectrum_im, plan::col_blocks, tile, head * plan::strips + s, bc);
}

template <typename T, int N>
int64_t prepare_jobs(int64_t heads) {
  using plan = monarch_plan<N>;
  return int64_t(plan::strips) * plan::strips + (1 + heads) * plan::strips * plan::col_blocks;
}

// ------------------------------------------------------------------------------- convolution

template <typename T, int N>
struct convolution_kernel {
  using plan = monarch_plan<N>;
  using stages = monarch_stages<T, N>;
  static constexpr int threads = stages::threads;

  struct storage {
    typename stages::input_tile input;
    typename stages::exchange_tile exchange;
    typename stages::row_dft_tile row_dft;
  };

  struct params {
    const T* u;
    int64_t u_batch_stride, u_head_stride;
    T* y;
    const float* D;
    int batch, heads, pairs_per_head, pairs;
    tables<T, N> tab;
  };

  // Stages 1-4 of one 16-row strip (rows k1 of the spectrum): the strip's spectrum times the filter's.
  // Stages 1-4 and 5-6 are separate calls: within one body ptxas overlaps the end of a stage with
  // the start of the next (two strips of accumulators live at once) and spills; across the call
  // only x (the 16-bit strip, 128 bytes per lane through the stack) is handed over.
  __device__ __noinline__ static void spectrum_strip(typename stages::strip_operand& x, storage& s, const params& p,
                                                     int head, int strip) {
    typename stages::strip_acc acc;
    stages::spectrum_rows(acc, x, s.input, s.row_dft, p.tab, strip);
    stages::template multiply_by_table<false>(acc, p.tab.spectrum_re, p.tab.spectrum_im, head * plan::strips + strip);
    warp::copy(x, acc);
  }

  __device__ __noinline__ static void inverse_strip(const typename stages::strip_operand& x, storage& s, const params& p,
                                                    int strip) {
    stages::inverse_rows(x, s.exchange, s.row_dft, p.tab, strip);
  }

  // Stage 7 for one output tile, + D u, to y.
  __device__ static void output_tile(storage& s, const params& p, pair_of_sequences pr, int task) {
    typename stages::output_acc acc;
    stages::inverse_columns(acc, s.exchange, p.tab, task);
    warp::mul(acc, acc, plan::output_scale);
    const int row0 = stages::output_row0(task), col0 = stages::output_col0(task);
    if (p.D != nullptr) {
      const float d = p.D[pr.head];
      const auto add_skip = [&](typename stages::output_acc::plane& out, int part) {
        typename stages::output_acc::plane skip;
        skip_term(skip, s.input, part, row0, col0, d);
        warp::add(out, out, skip);
      };
      add_skip(acc.re, 0);
      add_skip(acc.im, 1);
    }
    const int64_t offset = int64_t(row0) * plan::cols + col0;
    const auto sequence = [&](int batch) { return p.y + (int64_t(batch) * p.heads + pr.head) * N + offset; };
    warp::store(sequence(pr.first), plan::cols, acc.re);
    if (pr.first + 1 < p.batch) warp::store(sequence(pr.first + 1), plan::cols, acc.im);
  }

  // Barriers: each pair's input and exchange tiles are rewritten only after every warp is done
  // with the last pair's (the first barrier; it also publishes F_M2), read only once all warps
  // wrote them (the second and third).
  __device__ static void run(const params& p) {
    storage& s = pipeline::block_storage<storage>();
    stages::fill_row_dft(s.row_dft);
    for (int index = blockIdx.x; index < p.pairs; index += gridDim.x) {
      const pair_of_sequences pr{index / p.pairs_per_head, 2 * (index % p.pairs_per_head)};
      __syncthreads();
      stages::load_pair(s.input, p.u, p.u_batch_stride, p.u_head_stride, p.batch, pr);
      __syncthreads();
      for (int strip = warp_id(); strip < plan::strips; strip += plan::warps) {
        typename stages::strip_operand x;
        spectrum_strip(x, s, p, pr.head, strip);
        inverse_strip(x, s, p, strip);
      }
      __syncthreads();
      for (int task = warp_id(); task < plan::output_tasks; task += plan::warps) output_tile(s, p, pr, task);
    }
  }
};

template <typename K>
__global__ void __launch_bounds__(K::threads, 1) convolution_entry(const __grid_constant__ typename K::params p) {
  K::run(p);
}

// ------------------------------------------------------------------------------------- host

template <typename T, int N>
cudaError_t run(const forward_problem& pr, filter_spectrum use, cudaStream_t stream) {
  using K = convolution_kernel<T, N>;
  const tables<T, N> tab = tables<T, N>::at(pr.workspace, pr.heads);

  const float im_sign = use == filter_spectrum::conjugate ? -1.0f : 1.0f;
  const prepare_params<T, N> prep{tab, pr.spectrum, pr.spectrum_head_stride, int(pr.heads), im_sign};
  const int64_t prepare_blocks = ceil_div<int64_t>(prepare_jobs<T, N>(pr.heads) * WARP_THREADS, PREPARE_THREADS);
  if (const cudaError_t err = pipeline::launch(prepare_kernel<T, N>, dim3(unsigned(prepare_blocks)), PREPARE_THREADS, 0,
                                               stream, prep);
      err != cudaSuccess) {
    return err;
  }

  typename K::params p;
  p.u = static_cast<const T*>(pr.u);
  p.u_batch_stride = pr.u_batch_stride;
  p.u_head_stride = pr.u_head_stride;
  p.y = static_cast<T*>(pr.y);
  p.D = pr.D;
  p.batch = int(pr.batch);
  p.heads = int(pr.heads);
  p.pairs_per_head = int(ceil_div<int64_t>(pr.batch, 2));
  p.pairs = p.pairs_per_head * p.heads;
  p.tab = tab;
  return launch_persistent(convolution_entry<K>, K::threads, pipeline::shared_bytes<typename K::storage>, p.pairs,
                           stream, p);
}

}  // namespace

int64_t workspace_bytes(int64_t seq_len, int64_t heads, element_type dtype) {
  if (!runs_on_kernels(dtype, seq_len)) return 0;
  return with_kernel(dtype, seq_len, [&]<typename T, int N>() { return tables<T, N>::bytes(heads); });
}

std::string unsupported_reason(const forward_problem& p) {
  if (!half_dtypes::contains(p.dtype) && !split_dtypes::contains(p.dtype)) return "the kernels take bf16, fp16 and fp32 u";
  if (!runs_on_kernels(p.dtype, p.seq_len)) {
    return "the sequence length must be one of " + kernel_seq_len_names(p.dtype) + " for this dtype";
  }
  if (p.batch < 1 || p.heads < 1) return "B and H must be at least 1";
  if (ceil_div<int64_t>(p.batch, 2) * p.heads > INT_MAX || p.batch * p.heads * p.seq_len > INT64_MAX / 2) {
    return "B * H is too large for the kernel's indices";
  }
  if (!rows_aligned(p.u, p.u_batch_stride, p.u_head_stride, element_bytes(p.dtype))) {
    return "u's rows must start on 16-byte boundaries (its address and batch/head strides)";
  }
  if (reinterpret_cast<uintptr_t>(p.y) % VECTOR_BYTES != 0 || reinterpret_cast<uintptr_t>(p.workspace) % VECTOR_BYTES != 0) {
    return "y and the workspace must be 16-byte aligned";
  }
  return {};
}

cudaError_t launch_spectrum_pass(const forward_problem& p, filter_spectrum use, cudaStream_t stream) {
  return with_kernel(p.dtype, p.seq_len, [&]<typename T, int N>() { return run<T, N>(p, use, stream); });
}

cudaError_t launch(const forward_problem& p, cudaStream_t stream) {
  return launch_spectrum_pass(p, filter_spectrum::plain, stream);
}

}  // namespace tk::fftconv
