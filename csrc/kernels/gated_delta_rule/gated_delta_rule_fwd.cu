// Gated delta rule forward (tk::gated_delta_rule): per (sequence, value head), with the state S
// (K x V) carried across the sequence in chunks of 64 positions (tk_ops/ops/gated_delta_rule.py: the
// chunked algorithm and its names). Two launches on one stream:
//
//   solve_kernel   one block per (chunk, value head), all at once: gamma = cumsum(g) within the chunk,
//                  A = strictly-lower(beta_i exp(gamma_i - gamma_j) k_i . k_j), its inverse
//                  T = (I + A)^-1 by 16 x 16 blocks, and X = [W | U0] = T [diag(beta exp(gamma)) K |
//                  diag(beta) V] on tensor cores, and the chunk's decayed causal scores
//                  P = D o Q K^T (D_ij = exp(gamma_i - gamma_j) for j <= i, else 0), written to the
//                  workspace (W, U0, P in q's dtype, gamma fp32). The first value head of each key
//                  head also writes the chunk's Q (normalised, times scale) and K (normalised) there, so
//                  that the scan only copies its operands.
//   scan_kernel    one block per (sequence, value head, SLICE columns of V), walking the chunks in
//                  order with the block's S slice in fp32 registers and a 16-bit copy in shared memory
//                  as the B operand of the products by S:
//                    V' = U0 - W S
//                    O  = diag(exp(gamma)) Q S + P V'
//                    S  = exp(gamma_last) S + K^T diag(exp(gamma_last - gamma)) V'
//
// q and k are normalised over K (use_qk_l2norm) and q scaled in fp32 as solve_kernel loads them, then
// rounded to q's dtype, as every mma operand (W, U0, P, V' and its decayed copy, S's copy) is; products
// accumulate in fp32 (mma.sync m16n8k16). Positions past a sequence's end load as zeros with
// g = beta = 0 (so their Q, K, W, U0 and P rows in the workspace are zeros and gamma stays flat): they
// leave S unchanged and their rows of O are not stored. The solve runs once per chunk and head, shared
// by the V slices (P too: no scan block computes Q K^T). Its inverse is
// fp32 to about 16 bits: T's 16 x 16 diagonal blocks by substitution in fp32 (a lane a column), the
// blocks below by block forward substitution, T_wc = -sum_{c <= m < w} (T_ww A_wm) T_mc, products on
// tensor cores from hi + lo bf16 parts of both operands (three mmas a product); T diag(factor) is then
// rounded to q's dtype once, as the A operand of X's product with K or V as they are (a CPU emulation
// on the tests' inputs: o's error 5-15% above a solve in fp32, within a half of the tolerances).
//
// Plan: a chunk's 64 positions are ROW_BLOCKS = 4 mma row blocks. solve_kernel: 4 warps, warp w owns
// row block w of P, A, T and X; it holds the chunk's keys and values, the gates and T in fp32, Q in T's
// space before T (52 KiB at K = 128: 4 blocks an SM, registers held to 128 for them), V's copy
// (cp.async) issued first to land while Q and K load and P and T are computed; each warp keeps its rows
// of T in registers for X, and shares them through shared memory with the warps below, a barrier after
// each block distance w - c but the last. scan_kernel: 8 warps, two a scheduler, warp w computing row
// block w % 4 in half w / 4 of the slice's columns and keeping those columns of S's rows
// [32 (w % 4), 32 (w % 4) + 32); one block per SM (with SLICE = 32 a Qwen3-Next layer, 32 value heads
// and K = V = 128, is 128 blocks per sequence, about one wave on 132 SMs at B = 1), so the latency of
// its loads is hidden by a pipeline, not by other blocks: a ring of STAGES shared buffers, each one
// chunk's Q, K, W (16 KiB each at K = 128), U0 / V' slice, P and gamma, filled by cp.async (16 bytes a
// thread, verbatim workspace tiles) STAGES - 1 chunks ahead of the chunk being computed; plus S's copy
// and V''s decayed copy. Each chunk step has two barriers: one after its operands land (which also
// tells that every warp is done with the previous chunk, so its stage may be refilled and S's and V''s
// copies were rewritten after their last reads), one after V' and its decayed copy are in shared memory.
#include <cstdint>

#include "gated_delta_rule_common.cuh"
#include "tk/tk.cuh"

namespace tk::gdn {
namespace {

using kernel_dtypes = one_of<element_type::bf16, element_type::fp16>;
// K = V. 64 compiles without spills (scan_kernel 138 registers) but is not taken yet: no GPU test has run it.
using head_dims = one_of<128>;

constexpr int ROW_BLOCKS = CHUNK / BASE_TILE;  // mma row blocks of a chunk
constexpr int SLICE = 32;                 // value columns per scan block
constexpr int FEATURE_PIECE = 32;         // the K-extent of one step of a product over features
constexpr int VECTOR_BYTES = ROW_VECTOR_BYTES;  // one vector load, store or cp.async
constexpr int VECTOR_ELEMENTS = VECTOR_BYTES / 2;  // 16-bit elements in one vector
constexpr int64_t MAX_ROWS = INT32_MAX;   // T and every position index fit an int

constexpr int GATES_PER_LANE = CHUNK / WARP_THREADS;  // one warp scans a chunk's gates
static_assert(GATES_PER_LANE * WARP_THREADS == CHUNK, "a warp holds a chunk's gates, GATES_PER_LANE a lane");

// ------------------------------------------------------------------------------ sequences

struct sequence_span : sequence_rows {
  int64_t first_chunk;  // in the workspace
};

__device__ __forceinline__ sequence_span span_of(const forward_problem& p, int n) {
  const int64_t first_chunk = p.cu_seqlens == nullptr ? int64_t(n) * ceil_div(int(p.q.rows), CHUNK) : p.first_chunks[n];
  return {rows_of_sequence(p, n), first_chunk};
}

// The sequence that holds workspace chunk `chunk`: the last n with first_chunks[n] <= chunk (empty
// sequences share their successor's first chunk and are skipped).
__device__ __forceinline__ int sequence_of_chunk(const forward_problem& p, int64_t chunk) {
  if (p.cu_seqlens == nullptr) return int(chunk / ceil_div(int(p.q.rows), CHUNK));
  int low = 0, high = p.sequences;  // first_chunks[low] <= chunk < first_chunks[high]
  while (high - low > 1) {
    const int middle = (low + high) / 2;
    if (p.first_chunks[middle] <= chunk) {
      low = middle;
    } else {
      high = middle;
    }
  }
  return low;
}

// (t, head) of the (B, T, Hv) gates.
__device__ __forceinline__ int64_t gate_index(const forward_problem& p, int batch, int64_t row, int head) {
  return (batch * p.q.rows + row) * p.v.heads + head;
}

// ------------------------------------------------------------------------------ workspace

template <typename T, int D>
struct workspace_layout {
  float* gamma;  // (chunks, Hv, CHUNK)
  T* w;          // (chunks, Hv, CHUNK, D)
  T* u0;         // (chunks, Hv, CHUNK, D)
  T* queries;    // (chunks, Hk, CHUNK, D): normalised, times scale
  T* keys;       // (chunks, Hk, CHUNK, D): normalised
  T* scores;     // (chunks, Hv, CHUNK, CHUNK): P = D o Q K^T, the decayed causal scores

  __device__ explicit workspace_layout(const forward_problem& p) {
    const int64_t tiles = p.chunks * p.v.heads;
    const int64_t key_tiles = p.chunks * p.q.heads;
    gamma = static_cast<float*>(p.workspace);
    w = reinterpret_cast<T*>(gamma + tiles * CHUNK);
    u0 = w + tiles * CHUNK * D;
    queries = u0 + tiles * CHUNK * D;
    keys = queries + key_tiles * CHUNK * D;
    scores = keys + key_tiles * CHUNK * D;
  }
  // The index of a (chunk, value head) tile of gamma, W, U0 and of a (chunk, key head) tile of Q, K.
  __device__ static int64_t tile(const forward_problem& p, int64_t chunk, int head) {
    return chunk * p.v.heads + head;
  }
  __device__ static int64_t key_tile(const forward_problem& p, int64_t chunk, int key_head) {
    return chunk * p.q.heads + key_head;
  }
};

// ------------------------------------------------------------------------------ loads

// Rows [row0, row0 + valid) of one head of `view` as a CHUNK x D tile (zeros below), each row times
// `multiplier` and, when normalising, divided by its norm (in fp32, rounded once), handed 16 bytes at a
// time to store(row, col, piece). A row is D / 8 consecutive lanes of one warp, each one 16-byte load.
// Every load is issued before the first store: the compiler cannot tell a store from the rows' memory,
// so interleaved, each load would wait for the store before it.
template <typename T, int D, int THREADS, typename Store>
__device__ __forceinline__ void load_rows(const heads_view& view, int batch, int64_t head, int64_t row0, int valid,
                                          bool normalise, float multiplier, Store&& store) {
  constexpr int LANES_PER_ROW = D / VECTOR_ELEMENTS;
  constexpr int ROWS_PER_PASS = THREADS / LANES_PER_ROW;
  constexpr int PASSES = CHUNK / ROWS_PER_PASS;
  static_assert(WARP_THREADS % LANES_PER_ROW == 0, "a row's lanes lie in one warp");
  const int part = threadIdx.x % LANES_PER_ROW;
  const auto row_of_pass = [&](int pass) { return pass * ROWS_PER_PASS + int(threadIdx.x) / LANES_PER_ROW; };
  uint4 raw[PASSES];
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    const int row = row_of_pass(pass);
    raw[pass] = {0, 0, 0, 0};
    if (row < valid) {
      raw[pass] = *reinterpret_cast<const uint4*>(row_of<T>(view, batch, head, row0 + row) + part * VECTOR_ELEMENTS);
    }
  }
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    T* elements = reinterpret_cast<T*>(&raw[pass]);
    float values[VECTOR_ELEMENTS];
    float squares = 0.0f;
#pragma unroll
    for (int e = 0; e < VECTOR_ELEMENTS; ++e) {
      values[e] = float(elements[e]);
      squares = fmaf(values[e], values[e], squares);
    }
#pragma unroll
    for (int distance = LANES_PER_ROW / 2; distance > 0; distance /= 2) {
      squares += __shfl_xor_sync(ALL_LANES, squares, distance);
    }
    const float factor = normalise ? multiplier * rsqrtf(squares + L2NORM_EPS) : multiplier;
#pragma unroll
    for (int e = 0; e < VECTOR_ELEMENTS; ++e) elements[e] = T(values[e] * factor);
    store(row_of_pass(pass), part * VECTOR_ELEMENTS, raw[pass]);
  }
}

// Asynchronous copies (cp.async): 16 bytes a thread from global to shared memory, through L2 only (.cg:
// each tile is read once per block). A thread's copies complete in the groups it commits; wait<N>
// returns when at most N of its groups are still in flight, and a barrier after it shows every
// thread's landed copies to the block.
namespace async_copy {

__device__ __forceinline__ void vector(void* shared_dst, const void* global_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], %2;\n" ::"r"(shared_address(shared_dst)), "l"(global_src),
               "n"(VECTOR_BYTES)
               : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// A CHUNK x C tile from a row-major array (row stride in elements, a multiple of 8), the block's
// THREADS threads taking 16-byte pieces in turn; rows from valid_rows on are zeros (plain stores, which
// the same barrier as the copies shows to the block).
template <int THREADS, typename T, int C>
__device__ __forceinline__ void rows(shared_tile<T, CHUNK, C>& dst, const T* src, int row_stride,
                                     int valid_rows = CHUNK) {
  constexpr int VECTORS_PER_ROW = C / VECTOR_ELEMENTS;
  constexpr int PIECES_PER_THREAD = CHUNK * VECTORS_PER_ROW / THREADS;
  static_assert(CHUNK * VECTORS_PER_ROW % THREADS == 0, "every thread copies as many pieces");
#pragma unroll
  for (int piece = 0; piece < PIECES_PER_THREAD; ++piece) {
    const int index = piece * THREADS + int(threadIdx.x);
    const int row = index / VECTORS_PER_ROW, col = index % VECTORS_PER_ROW * VECTOR_ELEMENTS;
    if (row < valid_rows) {
      vector(&dst.at(row, col), src + int64_t(row) * row_stride + col);
    } else {
      *reinterpret_cast<uint4*>(&dst.at(row, col)) = {0, 0, 0, 0};
    }
  }
}

// N contiguous floats (16-byte aligned at both ends), one piece each for the block's first threads.
template <int THREADS, int N>
__device__ __forceinline__ void floats(float (&dst)[N], const float* src) {
  constexpr int FLOATS_PER_VECTOR = VECTOR_BYTES / int(sizeof(float));
  static_assert(N % FLOATS_PER_VECTOR == 0 && N / FLOATS_PER_VECTOR <= THREADS, "one piece a thread at most");
  if (threadIdx.x < N / FLOATS_PER_VECTOR) {
    vector(dst + threadIdx.x * FLOATS_PER_VECTOR, src + threadIdx.x * FLOATS_PER_VECTOR);
  }
}

}  // namespace async_copy

// The dynamic shared memory of a block as `Shared`, aligned for its swizzled tiles.
template <typename Shared>
__device__ __forceinline__ Shared& shared_as() {
  extern __shared__ unsigned char dynamic_shared[];
  const uintptr_t address = reinterpret_cast<uintptr_t>(dynamic_shared);
  return *reinterpret_cast<Shared*>(round_up(address, uintptr_t(alignof(Shared))));
}

template <typename Shared>
constexpr int shared_bytes = int(sizeof(Shared) + alignof(Shared));  // room to align the start

// ------------------------------------------------------------------------------ solve

// scores_ij *= exp(gamma_i - gamma_j) where j <= i, 0 above the diagonal (i: rows from row0, j: columns
// from col0).
template <register_tile_type Tile>
__device__ __forceinline__ void decay_causally(Tile& scores, int row0, int col0, const float (&gamma)[CHUNK]) {
  for_each_pair<Tile>([&](int br, int bc, int q) {
    float2& pair = scores.pairs[br][bc][q];
#pragma unroll
    for (int e = 0; e < fragment::PAIR; ++e) {
      const fragment::coord at = fragment::pair_element_coord<Tile::layout>(q, e);
      const int i = row0 + BASE_TILE * br + at.row, j = col0 + BASE_TILE * bc + at.col;
      float& score = e == 0 ? pair.x : pair.y;
      score = j <= i ? score * __expf(gamma[i] - gamma[j]) : 0.0f;
    }
  });
}

// A float tile as hi + lo bf16 parts (lo = the rounding error of hi): products of the parts recover
// about 16 significant bits where one bf16 rounding keeps 8, in bf16 for its fp32 exponent range (the
// inverse's entries span the decays' range, which fp16 would flush).
template <register_tile_type Float>
struct split_tile {
  using part = register_tile<bf16, Float::rows, Float::cols, Float::layout>;
  part hi, lo;

  split_tile() = default;
  __device__ explicit split_tile(const Float& x) {
    warp::copy(hi, x);
    Float rest;
    warp::copy(rest, hi);
    warp::sub(rest, x, rest);
    warp::copy(lo, rest);
  }
};

// d += a b (mma_AB) or a b^T (mma_ABt) from split operands: hi hi + hi lo + lo hi (lo lo is below fp32's
// rounding of the sum).
template <bool B_TRANSPOSED, register_tile_type D, typename A, typename B>
__device__ __forceinline__ void mma_split(D& d, const A& a, const B& b) {
  const auto product = [&](const auto& left, const auto& right) {
    if constexpr (B_TRANSPOSED) {
      warp::mma_ABt(d, left, right, d);
    } else {
      warp::mma_AB(d, left, right, d);
    }
  };
  product(a.lo, b.hi);
  product(a.hi, b.lo);
  product(a.hi, b.hi);
}

template <typename T, int D>
struct solve_kernel {
  static constexpr int BLOCKS = ROW_BLOCKS;  // 16-position blocks of a chunk; warp w owns block w
  static constexpr int THREADS = BLOCKS * WARP_THREADS;
  // Padding of the inverse's fp32 rows: 8 floats make a warp's row-pair accesses (8 rows x 8 columns)
  // fall in 32 distinct banks.
  static constexpr int INVERSE_STRIDE = CHUNK + 8;
  static constexpr int SOLVED_PIECE = 32;  // columns of W or U0 a warp accumulates at once
  static constexpr int SCORES_PIECE = 32;  // columns of P a warp accumulates at once
  static constexpr int BLOCKS_PER_SM = 4;  // as its shared memory allows; registers held to it (128)
  using block_tile = register_tile<float, BASE_TILE, BASE_TILE>;
  using split_block = split_tile<block_tile>;
  using split_block_col = split_tile<register_tile<float, BASE_TILE, BASE_TILE, register_layout::col>>;
  using inverse_rows = register_tile<float, BASE_TILE, CHUNK>;  // a warp's 16 rows of T
  static_assert(D % SOLVED_PIECE == 0, "whole pieces");

  struct shared {
    shared_tile<T, CHUNK, D> keys;
    shared_tile<T, CHUNK, D> values;  // V, copied asynchronously while the rest is computed
    float gamma[CHUNK];
    float beta[CHUNK];
    float beta_decayed[CHUNK];  // beta exp(gamma): W's column factors of T
    union {
      shared_tile<T, CHUNK, D> queries;  // Q (normalised, times scale) for P, first
      // then A's diagonal blocks, each replaced by its inverse, then the blocks of T below the diagonal
      float inverse[CHUNK][INVERSE_STRIDE];
    };
  };

  // Block (row, col) of the inverse in shared memory, as a pointer for warp::load and warp::store.
  __device__ static float* inverse_block(shared& s, int row, int col) {
    return &s.inverse[BASE_TILE * row][BASE_TILE * col];
  }

  // beta_i exp(gamma_i - gamma_j) times the dot products `dots` of rows i and columns j from i0, j0 (j < i):
  // a 16 x 16 block of A (transposed when i runs along the columns), zero on and above the diagonal.
  template <bool TRANSPOSED>
  __device__ static void scale_to_solve_matrix(block_tile& dots, int i0, int j0, const shared& s) {
    for_each_pair<block_tile>([&](int, int, int q) {
      float2& pair = dots.pairs[0][0][q];
#pragma unroll
      for (int e = 0; e < fragment::PAIR; ++e) {
        const fragment::coord at = fragment::pair_element_coord<block_tile::layout>(q, e);
        const int i = i0 + (TRANSPOSED ? at.col : at.row), j = j0 + (TRANSPOSED ? at.row : at.col);
        float& dot = e == 0 ? pair.x : pair.y;
        dot = j < i ? dot * s.beta[i] * __expf(s.gamma[i] - s.gamma[j]) : 0.0f;
      }
    });
  }

  // The 16 x 16 block c of 16-bit tile `tile` (c constant once unrolled).
  template <register_tile_type Tile>
  __device__ static register_tile<typename Tile::element, BASE_TILE, BASE_TILE> block_of(const Tile& tile, int c) {
    register_tile<typename Tile::element, BASE_TILE, BASE_TILE> block;
#pragma unroll
    for (int q = 0; q < fragment::QUADRANTS; ++q) block.pairs[0][0][q] = tile.pairs[0][c][q];
    return block;
  }

  // Block c of a warp's rows of T = `block`, for c known only at run time: a loop over constant indices
  // keeps the rows in registers (an index at run time would put them in local memory).
  __device__ static void set_block(inverse_rows& rows, int c, const block_tile& block) {
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b) {
      if (b != c) continue;
#pragma unroll
      for (int q = 0; q < fragment::QUADRANTS; ++q) rows.pairs[0][b][q] = block.pairs[0][0][q];
    }
  }

  // (I + A_ww)^-1 for the warp's diagonal block, in place of A_ww: lane l solves column l % 16 by
  // substitution in fp32 (lanes 16-31 repeat lanes 0-15 and store nothing).
  __device__ static void invert_diagonal_block(shared& s) {
    float* block = inverse_block(s, warp_id(), warp_id());
    const int column = lane_id() % BASE_TILE;
    float x[BASE_TILE];
#pragma unroll
    for (int i = 0; i < BASE_TILE; ++i) {
      float sum = i == column ? 1.0f : 0.0f;
#pragma unroll
      for (int j = 0; j < i; ++j) sum = fmaf(-block[i * INVERSE_STRIDE + j], x[j], sum);
      x[i] = sum;
    }
    __syncwarp();  // every lane has read A_ww before it is overwritten
    if (lane_id() < BASE_TILE) {
#pragma unroll
      for (int i = 0; i < BASE_TILE; ++i) block[i * INVERSE_STRIDE + column] = x[i];
    }
  }

  // Rows [16w, 16w + 16) of X = T diag(factor) B (B: the keys or the values tile) into `dst` (row stride D).
  __device__ static void solved_rows(T* dst, const inverse_rows& t_rows, const float* factor,
                                     const shared_tile<T, CHUNK, D>& b) {
    per_col_vector<inverse_rows, float> column_factor;
    warp::load(column_factor, factor);
    inverse_rows scaled;
    warp::mul_col(scaled, t_rows, column_factor);
    register_tile<T, BASE_TILE, CHUNK> left;  // T's only rounding: the product's A operand
    warp::copy(left, scaled);
#pragma unroll
    for (int n0 = 0; n0 < D; n0 += SOLVED_PIECE) {
      register_tile<float, BASE_TILE, SOLVED_PIECE> acc;
      warp::zero(acc);
#pragma unroll
      for (int c = 0; c < BLOCKS; ++c) {
        if (c > warp_id()) continue;  // T is zero right of the diagonal block
        register_tile<T, BASE_TILE, SOLVED_PIECE, register_layout::col> rhs;
        warp::load(rhs, b, BASE_TILE * c, n0);
        warp::mma_AB(acc, block_of(left, c), rhs, acc);
      }
      warp::store(dst + n0, D, acc);
    }
  }

  // Rows [16w, 16w + 16) of P = D o Q K^T, the scan's decayed causal scores, into `dst` (row stride
  // CHUNK), SCORES_PIECE columns at a time; pieces right of the warp's diagonal block are zeros.
  __device__ static void decayed_scores(T* dst, const shared& s) {
    const int warp_row0 = BASE_TILE * warp_id();
#pragma unroll
    for (int n0 = 0; n0 < CHUNK; n0 += SCORES_PIECE) {
      register_tile<float, BASE_TILE, SCORES_PIECE> scores;
      warp::zero(scores);
      if (n0 < warp_row0 + BASE_TILE) {
        // Not unrolled: four pieces' operands at once would pass the registers of BLOCKS_PER_SM blocks.
#pragma unroll 1
        for (int f0 = 0; f0 < D; f0 += FEATURE_PIECE) {
          register_tile<T, BASE_TILE, FEATURE_PIECE> q;
          register_tile<T, SCORES_PIECE, FEATURE_PIECE> k;
          warp::load(q, s.queries, warp_row0, f0);
          warp::load(k, s.keys, n0, f0);
          warp::mma_ABt(scores, q, k, scores);
        }
        decay_causally(scores, warp_row0, n0, s.gamma);
      }
      warp::store(dst + n0, CHUNK, scores);
    }
  }

  __device__ static void run(const forward_problem& p) {
    shared& s = shared_as<shared>();
    const int64_t chunk = blockIdx.x;
    const int head = blockIdx.y;
    const int group = int(p.v.heads / p.q.heads);
    const sequence_span seq = span_of(p, sequence_of_chunk(p, chunk));
    const int64_t row0 = seq.start + (chunk - seq.first_chunk) * CHUNK;
    const int valid = min(CHUNK, int(seq.start + seq.length - row0));
    const workspace_layout<T, D> out(p);
    const int key_head = head / group;
    // One value head of each key head writes the key head's Q and K tiles for the scan.
    const bool writes_key_head = head % group == 0;
    const int64_t key_tile_offset = workspace_layout<T, D>::key_tile(p, chunk, key_head) * CHUNK * D;
    const auto piece_at = [](T* tile, int row, int col) { return reinterpret_cast<uint4*>(tile + row * D + col); };

    // V first: its copies fly while Q and K are loaded and P and T are computed.
    async_copy::rows<THREADS>(s.values, row_of<T>(p.v, seq.batch, head, row0), int(p.v.row_stride), valid);
    async_copy::commit();
    load_rows<T, D, THREADS>(p.q, seq.batch, key_head, row0, valid, p.l2norm, p.scale, [&](int row, int col, uint4 piece) {
      *reinterpret_cast<uint4*>(&s.queries.at(row, col)) = piece;
      if (writes_key_head) *piece_at(out.queries + key_tile_offset, row, col) = piece;
    });
    load_rows<T, D, THREADS>(p.k, seq.batch, key_head, row0, valid, p.l2norm, 1.0f, [&](int row, int col, uint4 piece) {
      *reinterpret_cast<uint4*>(&s.keys.at(row, col)) = piece;
      if (writes_key_head) *piece_at(out.keys + key_tile_offset, row, col) = piece;
    });
    if (warp_id() == 0) {
      float g[GATES_PER_LANE], beta[GATES_PER_LANE];
#pragma unroll
      for (int e = 0; e < GATES_PER_LANE; ++e) {
        const int row = GATES_PER_LANE * lane_id() + e;
        const bool inside = row < valid;
        g[e] = inside ? p.g[gate_index(p, seq.batch, row0 + row, head)] : 0.0f;
        beta[e] = inside ? p.beta[gate_index(p, seq.batch, row0 + row, head)] : 0.0f;
      }
      warp::inclusive_scan(g);
#pragma unroll
      for (int e = 0; e < GATES_PER_LANE; ++e) {
        const int row = GATES_PER_LANE * lane_id() + e;
        s.gamma[row] = g[e];
        s.beta[row] = beta[e];
        s.beta_decayed[row] = beta[e] * __expf(g[e]);
      }
    }
    __syncthreads();  // Q, K and the gates are in shared memory

    const int64_t scores_row0 = workspace_layout<T, D>::tile(p, chunk, head) * CHUNK + BASE_TILE * warp_id();
    decayed_scores(out.scores + scores_row0 * CHUNK, s);
    __syncthreads();  // every warp has read Q, whose space the inverse takes

    // T = (I + A)^-1 by blocks of 16 (A_wc: block row w, column c): with T_ww = (I + A_ww)^-1, block
    // forward substitution gives T_wc = -T_ww sum_{c <= m < w} A_wm T_mc for c < w. Warp w computes
    // its row's A_ww, then T_ww A_wm for m < w, then T_wc in order of distance w - c, each
    // distance after a barrier (it reads the T_mc of smaller distances that other warps wrote). The
    // off-diagonal products run on tensor cores from hi + lo bf16 parts, at about fp32 accuracy.
    const int w = warp_id();
    const int warp_row0 = BASE_TILE * w;
    split_block a_blocks[BLOCKS - 1];  // A_wm for m < w (as A_wm^T, mma_ABt's N x K operand), then T_ww A_wm
    {
      register_tile<T, BASE_TILE, D> rows;
      warp::load(rows, s.keys, warp_row0, 0);
#pragma unroll
      for (int m = 0; m < BLOCKS - 1; ++m) {
        if (m >= w) continue;
        register_tile<T, BASE_TILE, D> keys;
        warp::load(keys, s.keys, BASE_TILE * m, 0);
        block_tile dots;  // k_m k_w^T
        warp::zero(dots);
        warp::mma_ABt(dots, keys, rows, dots);
        scale_to_solve_matrix<true>(dots, warp_row0, BASE_TILE * m, s);
        a_blocks[m] = split_block(dots);
      }
      block_tile dots;
      warp::zero(dots);
      warp::mma_ABt(dots, rows, rows, dots);
      scale_to_solve_matrix<false>(dots, warp_row0, warp_row0, s);
      warp::store(inverse_block(s, w, w), INVERSE_STRIDE, dots);
    }
    __syncwarp();  // the lanes' A_ww stores are visible to the warp
    invert_diagonal_block(s);
    // The values' copies, issued first, have had the keys' loads and A to land.
    async_copy::wait<0>();
    __syncthreads();  // every T_mm is in shared memory (and V)

    inverse_rows t_rows;
    warp::zero(t_rows);
    {
      block_tile diagonal;
      warp::load(diagonal, inverse_block(s, w, w), INVERSE_STRIDE);
      set_block(t_rows, w, diagonal);
      const split_block diagonal_parts(diagonal);
#pragma unroll
      for (int m = 0; m < BLOCKS - 1; ++m) {
        if (m >= w) continue;
        block_tile product;
        warp::zero(product);
        mma_split<true>(product, diagonal_parts, a_blocks[m]);
        a_blocks[m] = split_block(product);
      }
    }
#pragma unroll
    for (int distance = 1; distance < BLOCKS; ++distance) {
      const int c = w - distance;
      if (c >= 0) {
        block_tile sum;
        warp::zero(sum);
#pragma unroll
        for (int m = 0; m < BLOCKS - 1; ++m) {
          if (m < c || m >= w) continue;
          register_tile<float, BASE_TILE, BASE_TILE, register_layout::col> below;  // T_mc
          warp::load(below, inverse_block(s, m, c), INVERSE_STRIDE);
          mma_split<false>(sum, a_blocks[m], split_block_col(below));
        }
        warp::neg(sum, sum);
        set_block(t_rows, c, sum);
        warp::store(inverse_block(s, w, c), INVERSE_STRIDE, sum);
      }
      // T_wc is read at distances above this one; after the last, T stays in the warps' registers.
      if (distance < BLOCKS - 1) __syncthreads();
    }

    // X = [W | U0] = T [diag(beta exp(gamma)) K | diag(beta) V], the warp's rows.
    const int64_t tile = workspace_layout<T, D>::tile(p, chunk, head);
    const int64_t rows_offset = (tile * CHUNK + warp_row0) * D;
    solved_rows(out.w + rows_offset, t_rows, s.beta_decayed, s.keys);
    solved_rows(out.u0 + rows_offset, t_rows, s.beta, s.values);
    if (threadIdx.x < CHUNK) out.gamma[tile * CHUNK + threadIdx.x] = s.gamma[threadIdx.x];
  }
};

// ------------------------------------------------------------------------------ scan

template <typename T, int D>
struct scan_kernel {
  // Warp w computes positions [16 r, 16 r + 16) of a chunk (r = w % ROW_BLOCKS) in the columns
  // [WARP_COLUMNS g, WARP_COLUMNS (g + 1)) of the block's slice (g = w / ROW_BLOCKS), and keeps rows
  // [STATE_ROWS r, STATE_ROWS (r + 1)) of S in those columns: two warps a scheduler.
  static constexpr int COLUMN_GROUPS = 2;
  static constexpr int THREADS = ROW_BLOCKS * COLUMN_GROUPS * WARP_THREADS;
  static constexpr int WARP_COLUMNS = SLICE / COLUMN_GROUPS;
  static constexpr int STATE_ROWS = D / ROW_BLOCKS;
  static constexpr int SLICES = D / SLICE;       // scan blocks per (sequence, head), adjacent in x
  // Chunks whose operands are in shared memory at once: the one computed and STAGES - 1 in flight. Two
  // stages already hold the block to one per SM (the scan's grid is about one wave anyway), so the third
  // costs nothing and lets a chunk's loads take up to two chunk steps.
  static constexpr int STAGES = 3;
  static constexpr int BLOCKS_PER_SM = 1;  // its stages fill an SM's shared memory
  using chunk_tile = shared_tile<T, CHUNK, D>;
  using slice_tile = shared_tile<T, CHUNK, SLICE>;
  using state_copy_tile = shared_tile<T, D, SLICE>;
  using warp_rows = register_tile<float, BASE_TILE, WARP_COLUMNS>;  // a warp's 16 positions of its columns
  using state_rows = register_tile<float, STATE_ROWS, WARP_COLUMNS>;
  static_assert(D % FEATURE_PIECE == 0 && STATE_ROWS % BASE_TILE == 0, "whole pieces and base tiles");
  static_assert(WARP_COLUMNS % BASE_TILE == 0, "whole base tiles");
  static_assert(STAGES >= 2, "a stage is refilled while another is computed");

  struct chunk_operands {
    chunk_tile queries, keys, w;
    slice_tile values;                    // U0, then V' = U0 - W S
    shared_tile<T, CHUNK, CHUNK> scores;  // P = D o Q K^T (the solve's)
    alignas(VECTOR_BYTES) float gamma[CHUNK];
  };

  struct shared {
    chunk_operands stages[STAGES];   // chunk c in stages[c % STAGES]
    state_copy_tile state_copy;      // S rounded to T: the B operand of W S and Q S
    slice_tile values_to_end;        // diag(exp(gamma_last - gamma)) V' rounded to T: S's update's B operand
  };

  // by_w, by_q = rows [row0, row0 + 16) of W and of Q times S's columns [col0, col0 + WARP_COLUMNS)
  // (its 16-bit copy), each piece of S loaded once.
  __device__ static void times_state(warp_rows& by_w, warp_rows& by_q, const chunk_operands& operands, int row0,
                                     int col0, const state_copy_tile& state) {
    warp::zero(by_w);
    warp::zero(by_q);
#pragma unroll
    for (int f0 = 0; f0 < D; f0 += FEATURE_PIECE) {
      register_tile<T, FEATURE_PIECE, WARP_COLUMNS, register_layout::col> b;
      warp::load(b, state, f0, col0);
      register_tile<T, BASE_TILE, FEATURE_PIECE> a;
      warp::load(a, operands.w, row0, f0);
      warp::mma_AB(by_w, a, b, by_w);
      warp::load(a, operands.queries, row0, f0);
      warp::mma_AB(by_q, a, b, by_q);
    }
  }

  // `rows` rounded to T into `tile` at (row0, col0).
  __device__ static void store_rounded(slice_tile& tile, const warp_rows& rows, int row0, int col0) {
    register_tile<T, BASE_TILE, WARP_COLUMNS> rounded;
    warp::copy(rounded, rows);
    warp::store(tile, rounded, row0, col0);
  }

  __device__ static void run(const forward_problem& p) {
    shared& s = shared_as<shared>();
    const int column0 = int(blockIdx.x) % SLICES * SLICE;
    const int head = blockIdx.y;
    const int n = int(blockIdx.x) / SLICES;
    const int key_head = head / int(p.v.heads / p.q.heads);
    const sequence_span seq = span_of(p, n);
    const workspace_layout<T, D> in(p);
    const int row_block = warp_id() % ROW_BLOCKS;
    const int warp_row0 = BASE_TILE * row_block;
    const int warp_col0 = WARP_COLUMNS * (warp_id() / ROW_BLOCKS);  // in the slice
    const int state_row0 = STATE_ROWS * row_block;
    const int64_t state_offset =
        (int64_t(n) * p.v.heads + head) * D * D + int64_t(state_row0) * D + column0 + warp_col0;
    const int chunks = ceil_div(seq.length, CHUNK);

    // Issues the copies of chunk c's operands into its stage (the workspace tiles hold zeros past the end).
    const auto start_loading = [&](int c) {
      chunk_operands& stage = s.stages[c % STAGES];
      const int64_t tile = workspace_layout<T, D>::tile(p, seq.first_chunk + c, head) * CHUNK;
      const int64_t key_tile = workspace_layout<T, D>::key_tile(p, seq.first_chunk + c, key_head) * CHUNK;
      async_copy::rows<THREADS>(stage.queries, in.queries + key_tile * D, D);
      async_copy::rows<THREADS>(stage.keys, in.keys + key_tile * D, D);
      async_copy::rows<THREADS>(stage.w, in.w + tile * D, D);
      async_copy::rows<THREADS>(stage.values, in.u0 + tile * D + column0, D);
      async_copy::rows<THREADS>(stage.scores, in.scores + tile * CHUNK, CHUNK);
      async_copy::floats<THREADS>(stage.gamma, in.gamma + tile);
    };
    // One commit per chunk step, empty past the last chunk, so that "chunk c has landed" is always
    // wait<STAGES - 2>: only the groups of chunks c + 1 .. c + STAGES - 2 may still be in flight.
    for (int c = 0; c < STAGES - 1; ++c) {
      if (c < chunks) start_loading(c);
      async_copy::commit();
    }

    state_rows state;
    if (p.initial_state != nullptr) {
      warp::load(state, p.initial_state + state_offset, D);
    } else {
      warp::zero(state);
    }
    for (int c = 0; c < chunks; ++c) {
      chunk_operands& operands = s.stages[c % STAGES];
      {  // S's copy for this chunk; the previous chunk read it before its V' barrier, which all passed
        register_tile<T, STATE_ROWS, WARP_COLUMNS> copy;
        warp::copy(copy, state);
        warp::store(s.state_copy, copy, state_row0, warp_col0);
      }
      async_copy::wait<STAGES - 2>();
      __syncthreads();  // chunk c's operands and S's copy are visible; every warp is done with chunk c - 1

      // Chunk c - 1's stage is free: refill it STAGES - 1 chunks ahead.
      if (c + STAGES - 1 < chunks) start_loading(c + STAGES - 1);
      async_copy::commit();
      const int64_t row0 = seq.start + int64_t(c) * CHUNK;
      const int valid = min(CHUNK, seq.length - c * CHUNK);
      per_row_vector<warp_rows, float> gamma;
      warp::load(gamma, operands.gamma + warp_row0);
      const float gamma_last = operands.gamma[CHUNK - 1];

      // V' = U0 - W S for the warp's positions and columns into the values tile, and scaled by
      // exp(gamma_last - gamma) for S's update (the previous chunk's readers passed the barrier above);
      // Q S.
      warp_rows updates, out;
      times_state(updates, out, operands, warp_row0, warp_col0, s.state_copy);
      {
        register_tile<T, BASE_TILE, WARP_COLUMNS> u0;
        warp::load(u0, operands.values, warp_row0, warp_col0);
        warp_rows u0_fp32;
        warp::copy(u0_fp32, u0);
        warp::sub(updates, u0_fp32, updates);
        store_rounded(operands.values, updates, warp_row0, warp_col0);
        per_row_vector<warp_rows, float> to_end;
        warp::sub(to_end, gamma_last, gamma);
        warp::exp(to_end, to_end);
        warp::mul_row(updates, updates, to_end);
        store_rounded(s.values_to_end, updates, warp_row0, warp_col0);
      }

      // O = diag(exp(gamma)) Q S + P V'.
      warp::exp(gamma, gamma);
      warp::mul_row(out, out, gamma);
      __syncthreads();  // every warp's rows of V' and of its scaled copy are in shared memory

      register_tile<T, BASE_TILE, CHUNK> probabilities;
      warp::load(probabilities, operands.scores, warp_row0, 0);
      register_tile<T, CHUNK, WARP_COLUMNS, register_layout::col> updates_all;
      warp::load(updates_all, operands.values, 0, warp_col0);
      warp::mma_AB(out, probabilities, updates_all, out);
      const int64_t out_row = (seq.batch * p.q.rows + row0 + warp_row0) * p.v.heads + head;
      warp::store(static_cast<T*>(p.o) + out_row * D + column0 + warp_col0, int(p.v.heads * D), out,
                  valid - warp_row0);

      // S = exp(gamma_last) S + K^T diag(exp(gamma_last - gamma)) V', the warp's rows and columns of S.
      register_tile<T, CHUNK, STATE_ROWS, register_layout::col> keys;
      warp::load(keys, operands.keys, 0, state_row0);
      warp::load(updates_all, s.values_to_end, 0, warp_col0);
      warp::mul(state, state, __expf(gamma_last));
      warp::mma_AtB(state, keys, updates_all, state);
      // No barrier: the next chunk's first one orders this chunk's reads before any rewrite.
    }
    warp::store(p.final_state + state_offset, D, state);
  }
};

template <typename Kernel>
__global__ void __launch_bounds__(Kernel::THREADS, Kernel::BLOCKS_PER_SM)
    kernel_entry(const __grid_constant__ forward_problem p) {
  __builtin_assume(threadIdx.x < Kernel::THREADS);  // folds the bounds of the helpers' per-thread pieces
  Kernel::run(p);
}

template <typename Kernel>
cudaError_t launch_kernel(dim3 grid, const forward_problem& p, cudaStream_t stream) {
  constexpr int bytes = shared_bytes<typename Kernel::shared>;
  static_assert(bytes <= pipeline::MAX_SHARED_BYTES_PER_BLOCK, "the block's shared memory exceeds an sm_90 block's");
  if (cudaError_t e = cudaFuncSetAttribute(kernel_entry<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      e != cudaSuccess) {
    return e;
  }
  kernel_entry<Kernel><<<grid, Kernel::THREADS, bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t run(const forward_problem& p, cudaStream_t stream) {
  const unsigned heads = unsigned(p.v.heads);
  if (p.chunks > 0) {
    if (cudaError_t e = launch_kernel<solve_kernel<T, D>>(dim3(unsigned(p.chunks), heads), p, stream); e != cudaSuccess) {
      return e;
    }
  }
  // Sequences along x (up to 2^31 - 1 blocks), not z (65535): B or N can be larger than that.
  const int64_t blocks = int64_t(scan_kernel<T, D>::SLICES) * p.sequences;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  return launch_kernel<scan_kernel<T, D>>(dim3(unsigned(blocks), heads), p, stream);
}

}  // namespace

int64_t workspace_bytes(int64_t chunks, int64_t key_heads, int64_t value_heads, int64_t key_dim, int64_t value_dim) {
  const int64_t positions = chunks * value_heads * CHUNK;  // of gamma, W, U0 and P
  const int64_t key_positions = chunks * key_heads * CHUNK;  // of Q and K
  constexpr int64_t QUERY_AND_KEY = 2;  // the rows of Q and K each key position has
  return positions * (int64_t(sizeof(float)) + (key_dim + value_dim + CHUNK) * ELEMENT_BYTES) +
         key_positions * QUERY_AND_KEY * key_dim * ELEMENT_BYTES;
}

std::string unsupported_reason(const forward_problem& p) {
  if (!kernel_dtypes::contains(p.dtype)) return "the kernels take bf16 and fp16";
  if (!head_dims::contains(p.q.dim) || p.v.dim != p.q.dim) return "the kernels take K = V in " + head_dims::names();
  if (p.q.heads <= 0 || p.v.heads % p.q.heads != 0) return "Hv must be a multiple of Hk";
  if (p.q.rows > MAX_ROWS || p.q.batch * p.q.rows * p.v.heads > MAX_ROWS) return "B T Hv must fit an int";
  // q and k load 16 bytes a lane, v is copied 16 bytes at a time (cp.async).
  if (!aligned_rows(p.q) || !aligned_rows(p.k) || !aligned_rows(p.v)) {
    return "q, k and v rows must be 16-byte aligned (strides multiples of 8)";
  }
  // The scan loads S a pair of fp32 a lane (warp::load of a row-layout float tile).
  if (reinterpret_cast<uintptr_t>(p.initial_state) % sizeof(float2) != 0) return "initial_state must be 8-byte aligned";
  return "";
}

cudaError_t launch(const forward_problem& p, cudaStream_t stream) {
  if (p.sequences == 0) return cudaSuccess;
  return tk::dispatch<kernel_dtypes, head_dims>(
      [&]<element_type E, int D>() { return run<element_t<E>, D>(p, stream); }, p.dtype, int(p.q.dim));
}

}  // namespace tk::gdn
