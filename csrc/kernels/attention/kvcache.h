// A KV-cache call (tk::attention_with_kvcache) around the forward kernel's packed variant: the work
// before it (append the new keys and values, lay the queries out as packed sequences) and, for the decode
// form, the work after it (combine the split-KV chunks by their lse). Plain C++ (no torch):
// csrc/torch/attention.cpp calls them. Each is one launch, and none reads anything on the host, so a
// decode step is three launches (prepare, attention, combine) that a CUDA graph captures (four with a tail).
//
// The packed sequences (attention.h, packed_sequences) of a call, L_b = cache_seqlens[b] + Nnew its keys:
//   per query head  sequence b: rows [b Nq, (b + 1) Nq) of q (B Nq, Hq, D), against the first L_b positions
//                   of cache row b (span [b C, (b + 1) C), C the capacity)
//   decode          the chunks of every cache row, row by row: row b's keys are the prefix every query sees,
//                   P_b = min(max(L_b - tail, 0), C) positions, cut into n_b chunks of c_b positions (a
//                   multiple of KEY_BLOCK_ALIGNMENT; the last one ends at P_b; an empty row has none), about
//                   P_b / chunk of them, where the chunk length comes from every row's length: the smallest
//                   (a multiple of KEY_BLOCK_ALIGNMENT, at least the sum of the P_b / target_chunks) with
//                   which the rows make at most target_chunks chunks (kvcache.cu, decode_chunk_of), chosen on
//                   the device by the prepare, which reads cache_seqlens. Sequence chunk_offsets[b] + s,
//                   s < n_b: the Nq queries x G = Hq / Hkv query heads of each KV head as Nq G rows (q_rows
//                   below; K/V read once per KV head) against positions [s c_b, s c_b + c_b) of cache row b,
//                   its keys the first min(c_b, P_b - s c_b). The sequences after the last chunk (up to
//                   `sequences`, the host's bound) are empty: no query rows, no keys. Not balanced (more
//                   rows than the prepare's passes take): sequence b is row b, one chunk of P_b keys.
//                   With a causal mask and Nq > 1 query i sees the first L_b - Nq + 1 + i keys, which no mask
//                   over packed rows (g, i) expresses, so the last tail = Nq - 1 keys are a second call:
//                   sequence b's Nq rows per query head, causal, against those keys gathered into k_tail,
//                   v_tail; the combine joins its result as one more chunk
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/heads_view.h"
#include "tk/element_type.h"

namespace tk::attention {

struct kvcache_call {
  element_type dtype;
  int64_t batch, q_heads, kv_heads;
  int64_t q_len;              // Nq
  int64_t capacity;           // positions of a sequence's cache: Nmax, or pages_per_row x page_rows
  const int* cache_seqlens;   // (batch,) int32: the positions cached before this call
  // The append (new_len = 0: none): k, v as (B, Hkv, Nnew, D / Dv) views, written at positions
  // cache_seqlens[b] + n (clamped into the sequence's capacity) of the cache rows: k_cache, v_cache as
  // (1, Hkv, cache rows, D / Dv) views; with a page table, position p of sequence b is row p % page_rows of
  // page page_table[b][p / page_rows] (clamped into the pool).
  int64_t new_len = 0;
  heads_view k, v, k_cache, v_cache;
  const int* page_table = nullptr;  // (batch, pages_per_row) int32, or none: dense (row b holds sequence b)
  int64_t pages_per_row = 0, page_rows = 0, pages = 0;
  // The packed sequences: batch, or (decode form) decode_split::sequences, the most chunks any lengths make.
  int64_t sequences = 0;
  // The decode form: about target_chunks chunks over all rows where balanced (decode_split); q (B, Nq, Hq, D)
  // as a heads view (batch B, heads Hq, rows Nq) gathered into q_rows (sequences Nq G rows, Hkv, D)
  // contiguous, row (j Nq + i) G + g of chunk j of row b holding query i of b's head kv G + g.
  bool decode = false, balanced = false;
  int64_t target_chunks = 0;
  heads_view q;
  void* q_rows = nullptr;
  // The tail (decode form, causal, Nq > 1; tail = 0: none): sequence b's last min(tail, L_b) keys and values
  // gathered into k_tail, v_tail (B tail, Hkv, D / Dv) contiguous, from the appended k, v where they are new
  // (the append of this launch is not read back), and the tail call's metadata (batch + 1, batch + 1, batch).
  int64_t tail = 0;
  void* k_tail = nullptr;
  void* v_tail = nullptr;
  int* tail_cu_seqlens_q = nullptr;
  int* tail_cu_seqlens_k = nullptr;
  int* tail_seqused_k = nullptr;
  // The packed sequences' metadata, written here: cu_seqlens_q and cu_seqlens_k (sequences + 1 each) and
  // seqused_k (sequences); for the decode form chunk_offsets (batch + 1): row b's chunks are the sequences
  // [chunk_offsets[b], chunk_offsets[b + 1]).
  int* cu_seqlens_q;
  int* cu_seqlens_k;
  int* seqused_k;
  int* chunk_offsets = nullptr;
};

// The decode form's split-KV for batch x kv_heads (sequence, KV head) rows on `sms` SMs: the prepare cuts the
// rows' keys into about target_chunks chunks (DECODE_TASKS_PER_SM tasks per SM) by their actual lengths
// (balanced, up to DECODE_BALANCED_MAX_ROWS rows; beyond, each row is one chunk); `sequences` bounds the
// chunks any lengths make (the grid's and the workspaces' size).
struct decode_split {
  bool balanced;
  int64_t target_chunks, sequences;
};
decode_split decode_split_for(int64_t batch, int64_t kv_heads, int64_t capacity, int sms);

// The appended keys and values in the caches, the decode form's query rows and tail, and the metadata.
cudaError_t launch_prepare(const kvcache_call& call, cudaStream_t stream);

// The decode form's result from its chunks: out_rows (sequences Nq G rows, Hkv, Dv) contiguous in the call's
// dtype and lse_rows (Hkv, sequences Nq G) fp32, the forward's packed outputs, row b's chunks the sequences
// [chunk_offsets[b], chunk_offsets[b + 1]) (the prepare's), and the tail's (B Nq rows, Hq, Dv) and (Hq, B Nq)
// where there is one. lse = log(sum over chunks of exp(lse_s) (+ exp(sink))), out = sum over chunks of
// exp(lse_s - lse) out_s, summed in fp32 (a row that sees nothing: out 0, lse -inf, or its sink); out
// (B, Nq, Hq, Dv) and lse (B, Hq, Nq) contiguous.
struct kvcache_combine {
  element_type dtype;
  int64_t batch, q_len, q_heads, kv_heads, value_dim, sequences;
  const int* chunk_offsets;
  const void* out_rows;
  const float* lse_rows;
  const void* tail_out = nullptr;
  const float* tail_lse = nullptr;
  const float* sinks = nullptr;  // (Hq,) fp32, or none
  void* out;
  float* lse;
};

cudaError_t launch_combine(const kvcache_combine& c, cudaStream_t stream);

}  // namespace tk::attention
