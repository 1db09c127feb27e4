// Attention on the tile core: the tile plans and what the forward and backward kernels share.
//
// Every kernel is a plan plus hooks on the producer/consumer template (tk/pipeline): warpgroup 0 is
// the producer (one thread issues TMA), each consumer warpgroup owns 64 rows of a wgmma and
// computes from shared memory; two consumers, or three in the forward at D = 64.
//
//   forward   (attention_fwd.cu)  a block owns 128 query rows at D = 128, 192 (three consumers) at
//                                 D = 64 (resident Q; forward_plan); K/V blocks of 128 keys
//                                 stream through a ring whose K and V parts are released apart;
//                                 S = Q K^T (SS), online softmax in registers, O += P V (P from
//                                 registers, RS)
//   backward  (attention_bwd.cu)  1. per-row statistics: lse in base 2, delta = rowsum(dO * O) - dlse
//                                 2. dK, dV: a block owns 128 keys of one K/V head (resident K, V;
//                                    64 keys beyond D = 128) and streams the query tiles (64 rows
//                                    at D >= 128, 128 at D = 64: dkdv_plan) of every query head of
//                                    its group, so GQA sums stay in registers (no atomics,
//                                    deterministic)
//                                 3. dQ, by default in the same pass (up to D = 128): each step's dQ
//                                    partial is added into an fp32 accumulator by bulk reductions,
//                                    then converted; or (deterministic, and always beyond D = 128) a
//                                    block owns 128 query rows (64 beyond D = 128; resident Q, dO) and
//                                    streams K/V blocks, so dQ is summed in registers too
//                                 Beyond D = 128 both consumers share a block's 64 rows and split
//                                 each gradient's columns (column_split), exchanging their halves
//                                 of the scores through shared memory
//
// Scores live in the log2 domain: s2 = scale * log2(e) * q.k, p = exp2(s2 - max2), so exponentials
// are single ex2 instructions. The backward scales its scores with one multiply; the forward takes
// its row maxima over the raw q.k and folds the scale and the max subtraction into one FFMA.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "attention.h"
#include "kernels/common/heads_layout.cuh"
#include "tk/tk.cuh"

namespace tk::attention {

using warpgroup::operand_major;

// What the kernels are instantiated for (with forward_head_dims and backward_head_dims, attention.h);
// unsupported_reason rejects everything else first.
using kernel_dtypes = one_of<element_type::bf16, element_type::fp16>;

constexpr float LOG2_E = 1.4426950408889634f;
constexpr float LN_2 = 0.6931471805599453f;
constexpr float NEG_INF = -INFINITY;

// Register splits (setmaxnreg counts per thread, multiples of 8) of a block of one producer and two
// or three consumer warpgroups; the register file is 64K registers, 512 per thread of a warpgroup.
// Each consumer warpgroup owns 64 rows of a wgmma.
//   two consumers    2 x 240 + 24 (the producer: one thread issuing TMA)
//   three consumers  3 x 160 + 24: 160 is the most three consumers can take (3 x 168 + 8 > 512);
//                    the producer keeps the 24 it needs in either split
// (tk::pipeline checks each split against the register file where a kernel is instantiated.)
template <int CONSUMERS, int CONSUMER_REGISTERS>
struct register_split {
  static constexpr int consumer_warpgroups = CONSUMERS;
  static constexpr int rows_per_consumer = warpgroup::WGMMA_M;
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = CONSUMER_REGISTERS;
};
using two_consumer_split = register_split<2, 240>;
using three_consumer_split = register_split<3, 160>;

// Every backward kernel, and the forward at D = 128: two consumer warpgroups. The stage counts (2 at
// D = 128, 3 at D = 64 in the forward and dK/dV kernels; 2 in dQ) are hand-picked and not swept
// (an open tuning knob).
using attention_plan = two_consumer_split;

// The forward's tiles per head dim. D = 128: 128 query rows (two consumers) x 128 keys. D = 64:
// 192 query rows (three consumers) x 128 keys, FlashAttention-3's hdim-64 tile: at D = 64
// a key block's tensor work per query row is half that of D = 128 while its softmax work is the
// same, so each block's fixed costs (its Q load and pipeline fill, the epilogue, the K/V traffic
// per query row) weigh more; a third consumer takes 1.5x the rows per task and per K/V load, and
// gives the issue-turn rotation a third warpgroup to hide the softmax behind. Per consumer thread,
// S (64 rows x 128 keys: 64 fp32) + O (64 x 64: 32 fp32) + P (64 x 128: 32 registers of packed
// pairs) = 128 live registers at the P V issue, within 160. The key block stays 128: a wider one
// (FA3's 192 keys, non-causal) makes that 176 and needs P V from shared memory (SS) instead.
template <int D>
using forward_split = std::conditional_t<D == 64, three_consumer_split, two_consumer_split>;

// Key blocks: 128 keys up to D = 128. Beyond, the output accumulator (64 x D fp32: 96 or 128
// registers a consumer thread at D = 192 or 256) leaves room for the scores and probabilities of 64
// keys (32 + 16 registers, against 64 + 32 for 128 keys), and a stage of 64 keys' K and V (48 or 64 KB)
// lets two stages fit beside Q (192 KB at D = 256). Stages: 2 where a third would not fit (D = 128:
// 3 x 64 KB + 32 KB of Q is over 227 KB), 3 at D = 64 and 96.
template <int D>
struct forward_plan : forward_split<D> {
  static constexpr int block_q = forward_split<D>::consumer_warpgroups * forward_split<D>::rows_per_consumer;
  static constexpr int block_kv = D <= 128 ? 128 : 64;
  static constexpr int stages = D >= 128 ? 2 : 3;
};
static_assert(KEY_BLOCK_ALIGNMENT % forward_plan<128>::block_kv == 0 && KEY_BLOCK_ALIGNMENT % forward_plan<256>::block_kv == 0);

// Beyond this head dim the backward's plans split the gradient columns between the consumers
// (column_split below): dK and dV (or dQ) of 64 rows x D fp32 in one consumer's registers are 64 D / 64
// registers a thread each, which fits beside the scores only up to D = 128.
constexpr int MAX_UNSPLIT_HEAD_DIM = 128;

// How a backward kernel at head dim D shares a step between its two consumers.
//   D <= 128  each consumer owns 64 rows of the block's gradient (dK/dV: its 64 keys; dQ: its 64
//             queries) and all D columns, and forms its own rows' scores: nothing is exchanged
//   D > 128   both consumers own the same 64 rows, consumer c the columns [c D / 2, (c + 1) D / 2)
//             of each gradient (64 x 128 fp32 at D = 256: 64 registers, as D = 128's whole rows), so
//             dK and dV (or dQ) fit; each forms half the step's score columns (S^T and dP^T of its
//             half of the queries, or S and dP of its half of the keys), writes its half of P^T and
//             dS^T (or dS) to shared memory, and the gradient products read them whole from there (SS)
//             after a barrier. FlashAttention-3's hdim-256 backward splits the same way (its dK^T, dV^T
//             by rows of D per warpgroup, P and dS through shared memory).
// The tiles that a gradient product reads at a column offset take the widest swizzle whose span
// divides half a row (64 B at D = 192: half a row is 96 columns, not a whole 128-byte panel), so that
// each consumer's columns start on a panel; at D <= 128 that is the default swizzle.
template <int D>
struct column_split {
  static constexpr bool splits = D > MAX_UNSPLIT_HEAD_DIM;
  static constexpr int parts = splits ? attention_plan::consumer_warpgroups : 1;
  static constexpr int cols = D / parts;  // gradient columns per consumer
  template <typename T>
  static constexpr swizzle_mode swizzle = widest_swizzle(cols * int(sizeof(T)));
};

// A backward tile of ROWS rows of head dim D, swizzled for column_split<D>.
template <typename T, int ROWS, int D>
using head_tile = shared_tile<T, ROWS, D, column_split<D>::template swizzle<T>>;

// The dK/dV kernel's step: block_q queries against the block's keys (64 per consumer, or 64 shared by
// both beyond D = 128: column_split). D = 128 and beyond: 64 queries (one wgmma N of S^T = K Q^T per
// consumer, or two halves of 32). D = 64: 128 queries, FlashAttention-3's
// hdim-64 tile (128 x 128, two MMA warpgroups, S^T / dP^T per warpgroup, dV and dK from
// registers): a step's tensor work per query is half that of D = 128 while its fixed costs (stage
// wait and release, schedule, descriptors, barriers, the dQ partial's staging and reduction) are the
// same, so doubling the queries per step halves their share. Per consumer thread S^T and dP^T are
// 64 fp32 each (64 keys x 128 queries), so lse2 and delta are held spread over the warp (4
// registers each) and shuffled to where they are used, as FA3 does, instead of 2 x 32 registers.
// Beyond D = 128 a stage of 64 queries' Q and dO is 48 or 64 KB: two stages beside K and V (32 KB at
// D = 256) and the shared P^T and dS^T of each stage (16 KB) take 225 KB at D = 256.
template <int D>
struct dkdv_plan : attention_plan {
  using split = column_split<D>;
  static constexpr int key_tiles = split::splits ? 1 : consumer_warpgroups;  // resident 64-key tiles
  static constexpr int block_kv = key_tiles * rows_per_consumer;
  static constexpr int block_q = D == 64 ? 128 : 64;  // wgmma N of S^T = K Q^T: 64 keys x block_q queries per consumer
  static constexpr int consumer_queries = block_q / split::parts;  // the S^T columns a consumer forms
  static constexpr int stages = D == 64 ? 3 : 2;
  // The one-pass kernel's stages: its dS^T exchange (4 x 16 KB at D = 64) and partial staging
  // (2 x 16 KB) leave room for two stages of 128 queries (33 KB each) at D = 64 (three: 232 KB > 227 KB).
  // Beyond D = 128 the partial staging (64 KB) has no room at all: those head dims take the recompute
  // method (one_pass in attention_bwd.cu).
  static constexpr int one_pass_stages = 2;
  static constexpr bool has_one_pass = !split::splits;
  static constexpr bool statistics_from_shared = block_q > warpgroup::WGMMA_M;
  // dV += P^T dO issued after dS^T is formed (FA3's order) rather than before the dP^T wait: at
  // block_q = 128 the packed P^T (32 registers) beside the fp32 S^T, dP^T, dK and dV (64 + 64 + 64)
  // spilled under the 240-register cap.
  static constexpr bool dv_after_scores = block_q > warpgroup::WGMMA_M;
  // Register budget at block_q = 128 (per consumer thread: S^T 64 + dP^T 64 + dK 32 + dV 32 fp32, and
  // the packed P^T and dS^T operands 32 + 32), each of which ptxas needs or it serialises every
  // wgmma (C7512) and spills:
  // - S^T and dP^T are overwritten (warpgroup::mma_overwrite): with mma(..., false) the previous
  //   step's values are an input of the first product, so both stayed live around the whole loop
  //   (128 registers beside dK, dV, P^T and dS^T: 256 > 240);
  // - dS^T is formed and P^T, dS^T packed pair by pair (each fp32 pair dies as its operands appear),
  //   and the one-pass kernel shares the packed dS^T (not a third fp32 copy);
  // - the mask is a per-key query floor (2 integers per thread, as the forward's key limit at
  //   D = 64) rather than the per-element rule, whose 64 predicates ptxas evaluated early and kept.
  static constexpr bool scores_overwritten = block_q > warpgroup::WGMMA_M;
  static constexpr bool mask_by_query_floor = block_q > warpgroup::WGMMA_M;
};

// The one-pass backward's dQ partial per step and consumer: 64 rows (one wgmma M) by part_cols
// columns, summed over all 128 keys of the block (the consumers exchange their dS^T through shared
// memory). D = 128: a step has 64 query rows and the consumers split dQ's columns (a 64 x 128 fp32
// partial would not fit beside dK and dV in the registers). D = 64: a step has 128 query rows and
// the consumers split them, consumer c taking rows [64 c, 64 c + 64) (FA3's hdim-64 split). Either
// way consumer c's partial is part c of the step, and the fp32 accumulator holds each 64-row block
// of dQ as its column parts one after the other, each in fragment order.
template <int D>
struct dq_partial_plan {
  static constexpr int rows = warpgroup::WGMMA_M;
  static constexpr int row_parts = dkdv_plan<D>::block_q / rows;
  static constexpr int column_parts = attention_plan::consumer_warpgroups / row_parts;
  static constexpr int part_cols = D / column_parts;
  static_assert(row_parts * column_parts == attention_plan::consumer_warpgroups, "one part per consumer");
};

// The recompute method's dQ kernel: a block owns 128 query rows (64 per consumer) and streams key blocks of
// 128; beyond D = 128 (column_split) it owns 64 rows, both consumers' (each forms S and dP of half of a
// stage's 64 keys), as a stage of 128 keys' K and V would be 128 KB there.
template <int D>
struct dq_plan : attention_plan {
  using split = column_split<D>;
  static constexpr int query_tiles = split::splits ? 1 : consumer_warpgroups;  // resident 64-row tiles
  static constexpr int block_q = query_tiles * rows_per_consumer;
  static constexpr int block_kv = split::splits ? rows_per_consumer : 128;
  static constexpr int consumer_keys = block_kv / split::parts;  // the S columns a consumer forms
  static constexpr int stages = 2;
};

// The smallest query block of the backward's kernels: the most blocks a grid has per sequence.
constexpr int MIN_BACKWARD_BLOCK_Q = dq_plan<256>::block_q;

// The backward's per-row statistics (STATISTICS_ROW_MULTIPLE, attention.h) are padded to whole query
// blocks of every backward kernel. The forward's lse is not padded ((B, Hq, Nq), rows >= Nq never
// stored), so its block_q (192 at D = 64) need not divide this.
static_assert(STATISTICS_ROW_MULTIPLE % dq_plan<128>::block_q == 0 && STATISTICS_ROW_MULTIPLE % dq_plan<64>::block_q == 0 &&
              STATISTICS_ROW_MULTIPLE % dq_plan<256>::block_q == 0 && STATISTICS_ROW_MULTIPLE % dkdv_plan<128>::block_q == 0 &&
              STATISTICS_ROW_MULTIPLE % dkdv_plan<64>::block_q == 0 && STATISTICS_ROW_MULTIPLE % dkdv_plan<256>::block_q == 0);

// ------------------------------------------------------------------------------------ masking

// Which keys a query sees: key j < Nk, and under the bottom-right causal mask j <= i + Nk - Nq.
struct visibility {
  int q_rows;
  int k_rows;
  bool causal;

  __host__ __device__ int diagonal() const { return k_rows - q_rows; }
  __device__ bool visible(int query, int key) const { return key < k_rows && (!causal || key <= query + diagonal()); }
  // The same rule as a prefix: query sees exactly the keys below key_limit(query) (no overflow: both
  // lengths are at most 2^30).
  __device__ int key_limit(int query) const { return causal ? min(k_rows, query + diagonal() + 1) : k_rows; }
  // The same rule per key: key is seen by exactly the queries from query_floor(key) on (none when
  // key >= Nk; no overflow, as above).
  __device__ int query_floor(int key) const {
    return key >= k_rows ? INT_MAX : causal ? key - diagonal() : INT_MIN;
  }
  // Whether some (query, key) of the rectangle [q0, ...) x [k0, k0 + k_count) is hidden from query q0
  // onwards: a key past Nk, or (causal) a key past q0's diagonal.
  __device__ bool needs_mask(int q0, int k0, int k_count) const {
    return k0 + k_count > k_rows || (causal && k0 + k_count - 1 > q0 + diagonal());
  }
  // Key blocks of `block_kv` keys that queries [q0, q0 + q_count) see (clipped to Nq): a prefix.
  __host__ __device__ int key_blocks(int q0, int q_count, int block_kv) const {
    const int all = ceil_div(k_rows, block_kv);
    if (!causal) return all;
    const int last_key = min(q0 + q_count, q_rows) - 1 + diagonal();
    return last_key < 0 ? 0 : min(all, last_key / block_kv + 1);
  }
  // Of those, the leading blocks every query from q0 on sees whole (no mask needed); the rest
  // cross the diagonal or the key tail.
  __device__ int unmasked_key_blocks(int q0, int block_kv) const {
    const int whole = k_rows / block_kv;
    if (!causal) return whole;
    const int first_row_keys = q0 + diagonal() + 1;  // keys query q0 sees
    return first_row_keys <= 0 ? 0 : min(whole, first_row_keys / block_kv);
  }
  // The first query tile of `block_q` rows that sees any key of [k0, ...).
  __device__ int first_query_tile(int k0, int block_q) const { return causal ? max(0, k0 - diagonal()) / block_q : 0; }
};

// Which keys a query sees under a window (the forward's options: attention.h): key j with
// key_floor(i) <= j < key_limit(i), where
//   key_floor(i) = max(0, i + Nk - Nq - left),  key_limit(i) = min(Nk, i + Nk - Nq + right + 1).
// Causal is right = 0; an unbounded edge is stored as one that reaches every key (left = Nk,
// right = Nq: the same keys for every query i < Nq). Both bounds rise by at most one per query, so
// the keys a run of queries sees are one range, and the keys all of them see whole are another.
// visibility (above) is the case left unbounded, which the plain forward and backward keep.
struct key_window {
  int q_rows;
  int k_rows;
  int left;   // 0 <= left <= Nk
  int right;  // 0 <= right <= Nq

  // Clamps the edges as above; query + Nk - Nq +- edge stays in int when Nq + Nk <= MAX_WINDOWED_ROWS
  // (unsupported_reason), for the padded rows past Nq of a last query block too.
  // (On the device too: a packed sequence's window is made from its lengths in the kernel.)
  __host__ __device__ static key_window of(int64_t q_rows, int64_t k_rows, bool causal, int64_t left, int64_t right) {
    const int64_t reach_left = left < 0 || left > k_rows ? k_rows : left;
    const int64_t reach_right = causal ? 0 : right < 0 || right > q_rows ? q_rows : right;
    return {int(q_rows), int(k_rows), int(reach_left), int(reach_right)};
  }

  __host__ __device__ int diagonal() const { return k_rows - q_rows; }
  __device__ int key_floor(int query) const { return max(0, query + diagonal() - left); }
  __device__ int key_limit(int query) const { return min(k_rows, query + diagonal() + right + 1); }

  // The key blocks of `block_kv` keys that queries [q0, q0 + q_count) (clipped to Nq) see:
  // first_key_block(q0) and the key_blocks(...) after it (0 when no query sees a key).
  __device__ int first_key_block(int q0, int block_kv) const { return key_floor(q0) / block_kv; }
  __device__ int key_blocks(int q0, int q_count, int block_kv) const {
    const int limit = key_limit(min(q0 + q_count, q_rows) - 1);
    return limit <= 0 ? 0 : ceil_div(limit, block_kv) - first_key_block(q0, block_kv);
  }
  // Of the key blocks, [first, end) are seen whole by every query of [q0, q0 + q_count) below Nq
  // (first >= end when there are none): the blocks that need no mask.
  struct block_range {
    int first, end;
  };
  __device__ block_range whole_key_blocks(int q0, int q_count, int block_kv) const {
    const int last_query = max(q0, min(q0 + q_count, q_rows) - 1);
    return {ceil_div(key_floor(last_query), block_kv), max(0, key_limit(q0)) / block_kv};
  }
  // Whether every query of [q0, q0 + q_count) below Nq sees every key of [k0, k0 + k_count): the tile
  // needs no mask (the bounds rise with the query, so the last query's floor and the first's limit decide).
  __device__ bool sees_whole(int q0, int q_count, int k0, int k_count) const {
    const int last_query = max(q0, min(q0 + q_count, q_rows) - 1);
    return key_floor(last_query) <= k0 && k0 + k_count <= key_limit(q0);
  }

  // The same rule per key (the backward's dK/dV rows): key j < Nk is seen by the queries
  // [query_floor(j), query_end(j)); both rise by one per key, so the queries a run of keys is seen by
  // are one range.
  __device__ int query_floor(int key) const { return key - diagonal() - right; }
  __device__ int query_end(int key) const { return key - diagonal() + left + 1; }
  // The query blocks of `block_q` rows that see any key of [k0, k0 + k_count) (clipped to Nk and Nq):
  // first_query_block(k0) and the query_blocks(...) after it (0 when no query sees them).
  __device__ int first_query_block(int k0, int block_q) const { return max(0, query_floor(k0)) / block_q; }
  __device__ int query_blocks(int k0, int k_count, int block_q) const {
    const int begin = max(0, query_floor(k0));
    const int end = min(q_rows, query_end(min(k0 + k_count, k_rows) - 1));
    return end <= begin ? 0 : ceil_div(end, block_q) - begin / block_q;
  }
};

// The most Nq + Nk the kernels with a window (or the forward's other options) take: key_window's bounds
// stay in int.
constexpr int64_t MAX_WINDOWED_ROWS = int64_t(1) << 30;

// ------------------------------------------------------------------------ sequences, dense or packed

// Where a call's sequences lie in the kernels' (B, H, N, D) tensor maps. Dense: sequence b is batch b,
// rows [0, N). Packed (attention_varlen): the maps are (1, H, total, D) views of the packed tensors,
// and sequence b is rows [cu_seqlens[b], cu_seqlens[b + 1]) of their batch 0. The kernels read
// cu_seqlens themselves (no host sync, CUDA-graph capturable) and clamp what they read to the packed
// rows and the longest length the grid was sized for, so no content of cu_seqlens makes them read or
// write outside the tensors.
struct sequence_rows {
  int map_batch;         // the maps' batch coordinate
  int q_start, k_start;  // the sequence's first row in the maps' row coordinate
  int q_rows, k_rows;    // its lengths
  int statistics_row0;   // packed backward: its first row in each head's statistics (else 0)
};

struct sequence_layout {
  const int* cu_seqlens_q = nullptr;  // (sequences + 1,) int32, or none: dense
  const int* cu_seqlens_k = nullptr;
  int q_rows = 0, k_rows = 0;          // dense: each sequence's lengths; packed: the packed tensors' rows
  int max_q_rows = 0, max_k_rows = 0;  // the longest sequence's lengths (the grid's blocks per sequence)
  const int* seqused_k = nullptr;      // packed: the keys each sequence uses of its span, or none (all)
  // Packed backward: the sequences' first rows in each head's statistics_rows rows of statistics (each
  // sequence's rows rounded up to STATISTICS_ROW_MULTIPLE), or none.
  const int* statistics_start = nullptr;
  int statistics_rows = 0;
  // Paged keys and values (packed_sequences, attention.h): k_rows then counts the logical caches' positions.
  const int* page_table = nullptr;
  int pages_per_row = 0, page_rows = 0, pages = 0;

  __host__ __device__ bool packed() const { return cu_seqlens_q != nullptr; }

  __device__ sequence_rows of(int sequence) const {
    if (!packed()) return {sequence, 0, 0, q_rows, k_rows};
    const auto bounds = [sequence](const int* cu_seqlens, int total, int longest, int& start) {
      start = min(max(__ldg(cu_seqlens + sequence), 0), total);
      const int stop = min(max(__ldg(cu_seqlens + sequence + 1), start), total);
      return min(stop - start, longest);
    };
    sequence_rows r{0, 0, 0, 0, 0, 0};
    r.q_rows = bounds(cu_seqlens_q, q_rows, max_q_rows, r.q_start);
    r.k_rows = bounds(cu_seqlens_k, k_rows, max_k_rows, r.k_start);
    if (seqused_k != nullptr) r.k_rows = min(r.k_rows, max(__ldg(seqused_k + sequence), 0));
    if (statistics_start != nullptr) {
      // Lengths that break the rules could overrun the statistics: such a sequence gets no query rows.
      r.statistics_row0 = min(max(__ldg(statistics_start + sequence), 0), statistics_rows);
      if (r.statistics_row0 + round_up(r.q_rows, STATISTICS_ROW_MULTIPLE) > statistics_rows) r.q_rows = 0;
    }
    return r;
  }

  // Packed backward: the sequence whose statistics hold row `row` of a head (the last one starting at or
  // before it; a binary search over statistics_start, `sequences` + 1 entries).
  __device__ int sequence_of_statistics_row(int row, int sequences) const {
    int low = 0, high = sequences - 1;
    while (low < high) {
      const int middle = (low + high + 1) / 2;
      if (__ldg(statistics_start + middle) <= row) {
        low = middle;
      } else {
        high = middle - 1;
      }
    }
    return low;
  }

  // The maps' row of the task's key `key` (from the sequence's first): its packed row, or with pages the
  // row of the page that holds that position of its logical cache (a table entry outside the pool is
  // clamped into it). A key block from a multiple of KEY_BLOCK_ALIGNMENT lies in one page.
  __device__ int key_row(const sequence_rows& r, int key) const {
    const int row = r.k_start + key;
    if (page_table == nullptr) return row;
    const int capacity = pages_per_row * page_rows;
    const int within = row % capacity;
    const int page = __ldg(page_table + int64_t(row / capacity) * pages_per_row + within / page_rows);
    return min(max(page, 0), pages - 1) * page_rows + within % page_rows;
  }
};

// A task of the kernels with options: a block of one head of one sequence (batch: the sequence), and
// where that sequence lies, read once per task by the task order.
struct sequence_block : pipeline::head_block {
  sequence_rows rows;
};

// head_block_order over every sequence's blocks up to the longest's; a block past its own sequence's
// end is a task with no work.
struct sequence_block_order {
  pipeline::head_block_order blocks;
  sequence_layout sequences;

  __host__ __device__ int count() const { return blocks.count(); }
  __device__ sequence_block at(int index) const {
    const pipeline::head_block task = blocks.at(index);
    return {task, sequences.of(task.batch)};
  }
};

// The tasks of a kernel variant: with the options, sequence_blocks (dense or packed); the plain variants
// keep the dense batch's head_blocks.
template <bool WITH_OPTIONS>
using task_order_for = std::conditional_t<WITH_OPTIONS, sequence_block_order, pipeline::head_block_order>;
template <bool WITH_OPTIONS>
using task_for = std::conditional_t<WITH_OPTIONS, sequence_block, pipeline::head_block>;

// Where a task's sequence lies in the maps: a sequence_block's own rows, or batch b of a dense batch whose
// sequences are q_rows x k_rows each.
__device__ __forceinline__ sequence_rows sequence_rows_of(const sequence_block& t, int, int) { return t.rows; }
__device__ __forceinline__ sequence_rows sequence_rows_of(const pipeline::head_block& t, int q_rows, int k_rows) {
  return {t.batch, 0, 0, q_rows, k_rows, 0};
}

// ------------------------------------------------------------------------------------ softcap

// The softcapped score before its factor: tanh(tanh_scale * s), tanh_scale = scale / softcap. MUFU's
// tanh (tanh.approx, one instruction a score, as FlashAttention-3's softcap) is off by about 2^-11
// on t (|t| <= 1), so the capped score softcap * t by about softcap * 2^-11 (natural-log units).
// The kernels take softcap * log2(e) as the factor of t: the capped score in log2 units.
struct capped_score {
  __device__ static float apply(float s, float tanh_scale) {
    float t;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(s * tanh_scale));
    return t;
  }
};

// The backward's slope of the capped score, 1 - t^2 (d softcap tanh(u) / du = softcap (1 - t^2)),
// with t recovered from the probability p = exp2(c t - lse2) rather than kept beside it (the dK/dV
// step has no registers for a second tile): t = (log2 p + lse2) / c. Clamped to [-1, 1], so that
// p = 0 (a hidden key, an underflow, a padding row with lse2 = +inf, where log2 p + lse2 is -inf or
// NaN) gives slope 0, finite, and dS = p (...) stays 0.
struct softcap_slope {
  __device__ static float apply(float p, float lse2, float inverse_c) {
    const float t = fminf(fmaxf((__log2f(p) + lse2) * inverse_c, -1.0f), 1.0f);
    return fmaf(-t, t, 1.0f);
  }
};
// What dS = P (dP - delta) takes of P under a softcap: P times the slope.
struct probability_times_slope {
  __device__ static float apply(float p, float lse2, float inverse_c) {
    return p * softcap_slope::apply(p, lse2, inverse_c);
  }
};

// -------------------------------------------------------------- resident tiles and epilogues

// Each consumer's rows of a (batch, head) of the map, from row0 on, into its own tile: the resident
// tiles of every attention kernel (Q; K and V; Q and dO).
template <typename Tile, int CONSUMERS>
__device__ __forceinline__ void load_consumer_rows(Tile (&tiles)[CONSUMERS], const CUtensorMap& map, mbarrier& full,
                                                   int batch, int head, int row0) {
  for (int c = 0; c < CONSUMERS; ++c) {
    const int index[4] = {batch, head, row0 + c * Tile::rows, 0};
    tma::load(tiles[c], map, full, index);
  }
}

// One output of a consumer's epilogue: its accumulator, the shared tile that stages it, and the
// tensor map it is stored through.
template <typename Tile, typename Accumulator>
struct tile_output {
  const CUtensorMap& map;
  Tile& staging;
  const Accumulator& acc;
};

template <typename Tile, typename Accumulator>
__device__ __forceinline__ tile_output<Tile, Accumulator> staged(const CUtensorMap& map, Tile& staging,
                                                                 const Accumulator& acc) {
  return {map, staging, acc};
}

// The end of a consumer's task: each accumulator through stmatrix into its staging tile (no wgmma
// reads those any more), then one thread TMA-stores them all at `index` and waits until the copies
// have read shared memory (the next task's resident load, or the block's exit, reuses it).
template <typename Id, typename... Outputs>
__device__ __forceinline__ void store_outputs(Id written, const int (&index)[4], const Outputs&... outputs) {
  (warpgroup::store<0>(outputs.staging, outputs.acc), ...);
  publish(written, WARPGROUP_THREADS);  // the stmatrix writes must be visible to the copy engine
  if (is_warpgroup_leader()) {
    (tma::store(outputs.map, outputs.staging, index), ...);
    tma::commit_stores();
    tma::wait_stores_read<0>();
  }
}

// The end of a consumer's task in a packed sequence (its rows from `start` in the packed (total, heads,
// head_dim) tensor, `length` of them): the rows past the sequence's end belong to the next one, and a TMA
// store would clip only at the tensor's end, so each warp stores its own rows of the accumulator below the
// end from registers, from the sequence's row `row` on, into the columns from col0 on.
template <typename T, typename Accumulator>
__device__ __forceinline__ void store_packed_rows(void* packed, int heads, int head, int start, int length, int row,
                                                  const Accumulator& acc, int head_dim = Accumulator::cols,
                                                  int col0 = 0) {
  const int row_stride = heads * head_dim;
  const int warp_row = row + warpgroup::warp_row();
  warp::store(static_cast<T*>(packed) + int64_t(start + warp_row) * row_stride + head * head_dim + col0, row_stride,
              acc, length - warp_row);
}

// --------------------------------------------------------------------------- host: layouts

inline int64_t padded_statistics_rows(int64_t q_rows) { return round_up<int64_t>(q_rows, STATISTICS_ROW_MULTIPLE); }

// Task counts and sequence lengths must fit the kernels' int indices and TMA's 32-bit coordinates.
constexpr int64_t MAX_GRID_TASKS = (int64_t(1) << 31) - 1;
constexpr int64_t MAX_SEQUENCE = int64_t(1) << 30;

// Shape rules shared by both directions; layout rules are checked per kernel with its tiles.
template <typename HeadDims>
std::string shape_reason(const heads_view& q, const heads_view& k, const heads_view& v) {
  if (!HeadDims::contains(q.dim)) return "the head dim must be one of " + HeadDims::names();
  if (k.dim != q.dim || v.dim != q.dim) return "q, k and v must share the head dim";
  if (q.batch != k.batch || v.batch != k.batch || v.heads != k.heads || v.rows != k.rows) return "k and v must match";
  if (k.heads < 1 || q.heads % k.heads != 0) return "Hq must be a multiple of Hkv";
  if (q.batch < 1 || q.rows < 1 || k.rows < 1) return "every size must be at least 1";
  if (q.rows > MAX_SEQUENCE || k.rows > MAX_SEQUENCE) return "sequence lengths must fit TMA coordinates";
  const int64_t blocks = ceil_div<int64_t>(std::max(q.rows, k.rows), MIN_BACKWARD_BLOCK_Q);
  if (q.batch * q.heads * blocks > MAX_GRID_TASKS) return "B * Hq * (row blocks) must fit one grid";
  return {};
}

// The rows of each head's statistics in a packed backward: every sequence's query rows rounded up to whole
// STATISTICS_ROW_MULTIPLE blocks, at most total_q + (sequences) x (MULTIPLE - 1) (known on the host without
// reading the lengths), rather than sequences x the longest's (which many short sequences beside one long
// one would make many times the packed rows).
inline int64_t packed_statistics_rows(const packed_sequences& packed, int64_t q_rows) {
  return round_up<int64_t>(q_rows + packed.count * (STATISTICS_ROW_MULTIPLE - 1), STATISTICS_ROW_MULTIPLE);
}

// The kernels' sequence layout of a problem whose q and k views have q_rows and k_rows rows (with pages,
// k_rows is the pool's; the layout counts the logical caches' positions).
inline sequence_layout sequence_layout_of(const packed_sequences& packed, int64_t q_rows, int64_t k_rows) {
  if (!packed.given()) return {nullptr, nullptr, int(q_rows), int(k_rows), int(q_rows), int(k_rows)};
  const int64_t key_positions =
      packed.page_table != nullptr ? packed.table_rows * packed.pages_per_row * packed.page_rows : k_rows;
  return {packed.cu_seqlens_q,
          packed.cu_seqlens_k,
          int(q_rows),
          int(key_positions),
          int(std::min(packed.max_seqlen_q, q_rows)),
          int(std::min(packed.max_seqlen_k, key_positions)),
          packed.seqused_k,
          packed.statistics_start,
          packed.statistics_start != nullptr ? int(packed_statistics_rows(packed, q_rows)) : 0,
          packed.page_table,
          int(packed.pages_per_row),
          int(packed.page_rows),
          int(packed.pages)};
}

// The kernels' view of an output or gradient of `like`'s shape: (B, H, N, X) contiguous, or packed
// (total, H, X) contiguous as a (1, H, total, X) view.
inline heads_view output_view(const void* data, const heads_view& like, bool packed) {
  if (!packed) return contiguous_view(data, like.batch, like.heads, like.rows, like.dim);
  return {data, 1, like.heads, like.rows, like.dim, like.rows * like.heads * like.dim, like.dim, like.heads * like.dim};
}

// Packed sequences' own rules: the grid of (sequence, head, block) tasks fits, and the longest lengths
// are at least 1.
inline std::string packed_reason(const packed_sequences& packed, int64_t q_heads, int64_t block_q) {
  if (!packed.given()) return {};
  if (packed.cu_seqlens_k == nullptr || packed.count < 1) return "packed sequences need both cu_seqlens";
  if (packed.max_seqlen_q < 1 || packed.max_seqlen_k < 1) return "max_seqlen must be at least 1";
  if (packed.count * q_heads * ceil_div<int64_t>(packed.max_seqlen_q, block_q) > MAX_GRID_TASKS) {
    return "sequences * Hq * (row blocks) must fit one grid";
  }
  return {};
}

// The head dims a direction's kernels are instantiated for.
template <typename Problem>
using head_dims_of = std::conditional_t<std::is_same_v<Problem, forward_problem>, forward_head_dims, backward_head_dims>;

// Runs f.template operator()<T, D>() for the problem's element type and head dim.
template <typename Problem, typename F>
auto dispatch(const Problem& p, F&& f) {
  return tk::dispatch<kernel_dtypes, head_dims_of<Problem>>(
      [&]<element_type E, int D>() { return f.template operator()<element_t<E>, D>(); }, p.dtype, int(p.q.dim));
}

}  // namespace tk::attention
