// wgmma: the warpgroup's asynchronous tensor-core product D (64 x N, fp32) (+)= A (64 x 16) * B (16 x N).
//
// A comes from shared memory (descriptor) or from registers (each warp's 16 rows of a 16-bit
// row-layout register tile); B always from shared memory. The accumulator is each warp's 16 rows as
// a float row-layout register tile, so every tile verb (row_max, exp2, sub_row, masks, ...) applies
// to a wgmma result as it stands. Each operand in shared memory may be K-major or MN-major
// (the instruction's transpose bits), which is how transposed views reach the tensor cores with
// no copy. Issue order: fence() once the accumulator registers were touched by other code, then
// the products, commit(), and wait<n>() before the accumulator is read again.
//
// The instruction names its N and lists all N/2 accumulator registers, so the inline-assembly
// strings are generated below from digit-structured operand lists, one specialisation per N.
#pragma once

#include <type_traits>

#include "../../common.cuh"
#include "../../types/register_tile.cuh"
#include "descriptor.cuh"

namespace tk::warpgroup {

constexpr int WGMMA_M = WARPGROUP_WARPS * BASE_TILE;  // rows of one wgmma: BASE_TILE per warp
constexpr int WGMMA_K = BASE_TILE;                    // K of one bf16/half wgmma
constexpr int WGMMA_MAX_N = 256;

// ------------------------------------------------------------------------------ accumulator

// The fp32 accumulator of a warpgroup's 64 x N product, as each warp holds it: its 16 rows
// (warpgroup rows [16 w, 16 w + 16), see warp_row) as a register tile. Register d_k of the PTX ISA's
// wgmma fragment is element k of the tile's pairs in storage order (register_fragments.cuh proves it).
template <int N>
using accumulator = register_tile<float, BASE_TILE, N>;

// This warp's first row in the warpgroup's tile.
__device__ __forceinline__ int warp_row() { return BASE_TILE * warp_in_warpgroup(); }

namespace detail {

// Register d_I of the wgmma fragment: element I of the accumulator tile's pairs in storage order.
template <int I, int N>
__device__ __forceinline__ float& accumulator_register(accumulator<N>& acc) {
  constexpr int pair = I / fragment::PAIR;
  auto& p = acc.pairs[0][pair / fragment::QUADRANTS][pair % fragment::QUADRANTS];
  if constexpr (I % fragment::PAIR == 0) {
    return p.x;
  } else {
    return p.y;
  }
}

}  // namespace detail

// ------------------------------------------------------------------ operand lists for the asm
// TK_SEQ_<R>(FIRST, NEXT) expands FIRST(0) NEXT(1) ... NEXT(R - 1); TK_DECADE(NEXT, t) covers
// t0..t9 by token pasting, so no list is written out by hand.
#define TK_DECADE(NEXT, t) NEXT(t##0) NEXT(t##1) NEXT(t##2) NEXT(t##3) NEXT(t##4) NEXT(t##5) NEXT(t##6) NEXT(t##7) NEXT(t##8) NEXT(t##9)
#define TK_FIRST_DECADE(FIRST, NEXT) FIRST(0) NEXT(1) NEXT(2) NEXT(3) NEXT(4) NEXT(5) NEXT(6) NEXT(7) NEXT(8) NEXT(9)
#define TK_SEQ_4(FIRST, NEXT) FIRST(0) NEXT(1) NEXT(2) NEXT(3)
// TK_OCTET(NEXT, t): t0..t7 (the last 8 of a 48-register list).
#define TK_OCTET(NEXT, t) NEXT(t##0) NEXT(t##1) NEXT(t##2) NEXT(t##3) NEXT(t##4) NEXT(t##5) NEXT(t##6) NEXT(t##7)
#define TK_SEQ_8(FIRST, NEXT) TK_SEQ_4(FIRST, NEXT) NEXT(4) NEXT(5) NEXT(6) NEXT(7)
#define TK_SEQ_16(FIRST, NEXT) TK_FIRST_DECADE(FIRST, NEXT) NEXT(10) NEXT(11) NEXT(12) NEXT(13) NEXT(14) NEXT(15)
#define TK_SEQ_32(FIRST, NEXT) TK_FIRST_DECADE(FIRST, NEXT) TK_DECADE(NEXT, 1) TK_DECADE(NEXT, 2) NEXT(30) NEXT(31)
#define TK_SEQ_48(FIRST, NEXT) \
  TK_FIRST_DECADE(FIRST, NEXT) TK_DECADE(NEXT, 1) TK_DECADE(NEXT, 2) TK_DECADE(NEXT, 3) TK_OCTET(NEXT, 4)
#define TK_SEQ_64(FIRST, NEXT)                                                                                  \
  TK_FIRST_DECADE(FIRST, NEXT) TK_DECADE(NEXT, 1) TK_DECADE(NEXT, 2) TK_DECADE(NEXT, 3) TK_DECADE(NEXT, 4)     \
  TK_DECADE(NEXT, 5) NEXT(60) NEXT(61) NEXT(62) NEXT(63)
#define TK_SEQ_96(FIRST, NEXT)                                                                                  \
  TK_FIRST_DECADE(FIRST, NEXT) TK_DECADE(NEXT, 1) TK_DECADE(NEXT, 2) TK_DECADE(NEXT, 3) TK_DECADE(NEXT, 4)     \
  TK_DECADE(NEXT, 5) TK_DECADE(NEXT, 6) TK_DECADE(NEXT, 7) TK_DECADE(NEXT, 8) NEXT(90) NEXT(91) NEXT(92)       \
  NEXT(93) NEXT(94) NEXT(95)
#define TK_SEQ_128(FIRST, NEXT)                                                                                 \
  TK_FIRST_DECADE(FIRST, NEXT) TK_DECADE(NEXT, 1) TK_DECADE(NEXT, 2) TK_DECADE(NEXT, 3) TK_DECADE(NEXT, 4)     \
  TK_DECADE(NEXT, 5) TK_DECADE(NEXT, 6) TK_DECADE(NEXT, 7) TK_DECADE(NEXT, 8) TK_DECADE(NEXT, 9)               \
  TK_DECADE(NEXT, 10) TK_DECADE(NEXT, 11) NEXT(120) NEXT(121) NEXT(122) NEXT(123) NEXT(124) NEXT(125)          \
  NEXT(126) NEXT(127)

#define TK_REG_FIRST(i) "%" #i
#define TK_REG_NEXT(i) ", %" #i
#define TK_ACC_FIRST(i) "+f"(detail::accumulator_register<i>(d))
#define TK_ACC_NEXT(i) , "+f"(detail::accumulator_register<i>(d))
#define TK_OUT_FIRST(i) "=f"(detail::accumulator_register<i>(d))
#define TK_OUT_NEXT(i) , "=f"(detail::accumulator_register<i>(d))

// A and B from shared memory. Operands after the R accumulators: a, b, accumulate, trans-a, trans-b.
#define TK_WGMMA_SS_ASM(N, SEQ, PTX_TYPE, A, B, ACC, TA, TB)                                               \
  asm volatile("{\n .reg .pred accumulate;\n setp.ne.b32 accumulate, %" ACC ", 0;\n"                          \
               " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " {" SEQ(TK_REG_FIRST,   \
               TK_REG_NEXT) "}, %" A ", %" B ", accumulate, 1, 1, %" TA ", %" TB ";\n}\n"                        \
               : SEQ(TK_ACC_FIRST, TK_ACC_NEXT)                                                                  \
               : "l"(a), "l"(b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B))

// The same with the accumulator written only (scale-d 0): its old values are no input, so they need
// not stay live up to the product (a register accumulator rebuilt every loop step).
#define TK_WGMMA_SS_OVERWRITE_ASM(N, SEQ, PTX_TYPE, A, B, TA, TB)                                            \
  asm volatile(" wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " {" SEQ(TK_REG_FIRST, \
               TK_REG_NEXT) "}, %" A ", %" B ", 0, 1, 1, %" TA ", %" TB ";\n"                                    \
               : SEQ(TK_OUT_FIRST, TK_OUT_NEXT)                                                                  \
               : "l"(a), "l"(b), "n"(TRANS_A), "n"(TRANS_B))

// A from registers (4 x b32), B from shared memory. Operands after the accumulators:
// a0..a3, b, accumulate, trans-b.
#define TK_WGMMA_RS_ASM(N, SEQ, PTX_TYPE, A0, A1, A2, A3, B, ACC, TB)                                       \
  asm volatile("{\n .reg .pred accumulate;\n setp.ne.b32 accumulate, %" ACC ", 0;\n"                          \
               " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " {" SEQ(TK_REG_FIRST,   \
               TK_REG_NEXT) "}, {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" B ", accumulate, 1, 1, %" TB ";\n}\n"    \
               : SEQ(TK_ACC_FIRST, TK_ACC_NEXT)                                                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TRANS_B))

template <int N> struct wgmma_instruction;

// One specialisation per N; i0.. are the operand numbers that follow the N/2 accumulators.
#define TK_DEFINE_WGMMA(N, SEQ, i0, i1, i2, i3, i4, i5, i6)                                                  \
  template <> struct wgmma_instruction<N> {                                                                   \
    template <typename T, int TRANS_A, int TRANS_B>                                                           \
    __device__ static void ss(accumulator<N>& d, uint64_t a, uint64_t b, int accumulate) {                             \
      if constexpr (std::is_same_v<T, bf16>) {                                                                \
        TK_WGMMA_SS_ASM(N, SEQ, "bf16", i0, i1, i2, i3, i4);                                                  \
      } else {                                                                                                \
        static_assert(std::is_same_v<T, half>, "wgmma operands are bf16 or fp16 here");                      \
        TK_WGMMA_SS_ASM(N, SEQ, "f16", i0, i1, i2, i3, i4);                                                   \
      }                                                                                                       \
    }                                                                                                         \
    template <typename T, int TRANS_A, int TRANS_B>                                                           \
    __device__ static void ss_overwrite(accumulator<N>& d, uint64_t a, uint64_t b) {                           \
      if constexpr (std::is_same_v<T, bf16>) {                                                                \
        TK_WGMMA_SS_OVERWRITE_ASM(N, SEQ, "bf16", i0, i1, i2, i3);                                            \
      } else {                                                                                                \
        static_assert(std::is_same_v<T, half>, "wgmma operands are bf16 or fp16 here");                      \
        TK_WGMMA_SS_OVERWRITE_ASM(N, SEQ, "f16", i0, i1, i2, i3);                                             \
      }                                                                                                       \
    }                                                                                                         \
    template <typename T, int TRANS_B>                                                                        \
    __device__ static void rs(accumulator<N>& d, const uint32_t (&a)[4], uint64_t b, int accumulate) {                 \
      if constexpr (std::is_same_v<T, bf16>) {                                                                \
        TK_WGMMA_RS_ASM(N, SEQ, "bf16", i0, i1, i2, i3, i4, i5, i6);                                          \
      } else {                                                                                                \
        static_assert(std::is_same_v<T, half>, "wgmma operands are bf16 or fp16 here");                      \
        TK_WGMMA_RS_ASM(N, SEQ, "f16", i0, i1, i2, i3, i4, i5, i6);                                           \
      }                                                                                                       \
    }                                                                                                         \
  };

TK_DEFINE_WGMMA(8, TK_SEQ_4, "4", "5", "6", "7", "8", "9", "10")
TK_DEFINE_WGMMA(16, TK_SEQ_8, "8", "9", "10", "11", "12", "13", "14")
TK_DEFINE_WGMMA(32, TK_SEQ_16, "16", "17", "18", "19", "20", "21", "22")
TK_DEFINE_WGMMA(64, TK_SEQ_32, "32", "33", "34", "35", "36", "37", "38")
TK_DEFINE_WGMMA(96, TK_SEQ_48, "48", "49", "50", "51", "52", "53", "54")
TK_DEFINE_WGMMA(128, TK_SEQ_64, "64", "65", "66", "67", "68", "69", "70")
TK_DEFINE_WGMMA(192, TK_SEQ_96, "96", "97", "98", "99", "100", "101", "102")
TK_DEFINE_WGMMA(256, TK_SEQ_128, "128", "129", "130", "131", "132", "133", "134")

#undef TK_DEFINE_WGMMA
#undef TK_WGMMA_RS_ASM
#undef TK_WGMMA_SS_ASM
#undef TK_WGMMA_SS_OVERWRITE_ASM
#undef TK_OUT_NEXT
#undef TK_OUT_FIRST
#undef TK_ACC_NEXT
#undef TK_ACC_FIRST
#undef TK_REG_NEXT
#undef TK_REG_FIRST
#undef TK_SEQ_128
#undef TK_SEQ_48
#undef TK_OCTET
#undef TK_SEQ_96
#undef TK_SEQ_64
#undef TK_SEQ_32
#undef TK_SEQ_16
#undef TK_SEQ_8
#undef TK_SEQ_4
#undef TK_FIRST_DECADE
#undef TK_DECADE

// Keep the compiler from moving reads or writes of a register tile across an asynchronous wgmma
// boundary: an accumulator changes behind its back between issue and wait, and a register A operand
// must keep its registers until the product that reads them is done.
template <register_tile_type Tile>
__device__ __forceinline__ void pin(Tile& tile) {
  for_each_pair<Tile>([&](int br, int bc, int q) {
    auto& pair = tile.pairs[br][bc][q];
    if constexpr (std::is_same_v<typename Tile::element, float>) {
      asm volatile("" : "+f"(pair.x), "+f"(pair.y)::"memory");
    } else {
      uint32_t bits = pair_bits(pair);
      asm volatile("" : "+r"(bits)::"memory");
      pair = pair_from_bits<typename Tile::pair_type>(bits);
    }
  });
}

// Every tile of an array (a ring of register operands, a state kept as slabs).
template <register_tile_type Tile, int COUNT>
__device__ __forceinline__ void pin(Tile (&tiles)[COUNT]) {
#pragma unroll
  for (int i = 0; i < COUNT; ++i) pin(tiles[i]);
}

// ---------------------------------------------------------------------------- issue and wait

// Orders earlier register and shared-memory accesses before the next wgmma reads them.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

// Closes the group of wgmmas issued since the last commit.
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

// Waits until at most PENDING committed groups are still running.
template <int PENDING>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// ... then pins each argument: a register tile or an array of them.
template <int PENDING, typename... Tiles>
__device__ __forceinline__ void wait(Tiles&... tiles) {
  wait<PENDING>();
  (pin(tiles), ...);
}

// What a product of two shared tiles needs to know of them, checked once: one element type, the same
// K extent (a multiple of wgmma's 16), and which operand is stored MN-major (transposed).
template <operand_major A_MAJOR, operand_major B_MAJOR, typename TileA, typename TileB>
struct shared_operands {
  using element = typename TileA::element;
  static_assert(std::is_same_v<element, typename TileB::element>, "A and B must have one element type");
  static constexpr int k = k_extent<A_MAJOR, TileA>();
  static_assert(k == k_extent<B_MAJOR, TileB>(), "A and B tiles must cover the same K");
  static_assert(k % 16 == 0, "wgmma steps through K 16 at a time");
  static constexpr int trans_a = A_MAJOR == operand_major::mn ? 1 : 0;
  static constexpr int trans_b = B_MAJOR == operand_major::mn ? 1 : 0;
};

// acc (+)= A[a_mn0 : a_mn0 + 64, :] * B[:, b_mn0 : b_mn0 + N] over the whole K extent of the two
// tiles (in steps of 16); `accumulate` false overwrites acc with the product. Issues only: the
// caller commits and waits.
template <operand_major A_MAJOR, operand_major B_MAJOR, int N, typename TileA, typename TileB>
__device__ __forceinline__ void mma(accumulator<N>& acc, const TileA& a, int a_mn0, const TileB& b, int b_mn0,
                                    bool accumulate) {
  using ops = shared_operands<A_MAJOR, B_MAJOR, TileA, TileB>;
  using T = typename ops::element;
  constexpr int k = ops::k, trans_a = ops::trans_a, trans_b = ops::trans_b;
#pragma unroll
  for (int k0 = 0; k0 < k; k0 += 16) {
    const uint64_t a_desc = describe<A_MAJOR>(a, a_mn0, k0).bits;
    const uint64_t b_desc = describe<B_MAJOR>(b, b_mn0, k0).bits;
    wgmma_instruction<N>::template ss<T, trans_a, trans_b>(acc, a_desc, b_desc,
                                                           (accumulate || k0 > 0) ? 1 : 0);
  }
}

// acc = A[a_mn0 : a_mn0 + 64, :] * B[:, b_mn0 : b_mn0 + N], as mma with `accumulate` false, except
// that acc's previous values are not an input of the first product (write-only asm operands). For an
// accumulator that a loop rebuilds every step: with mma, its last values stay live around the loop
// up to the next step's first product (its registers can be used for nothing else meanwhile).
template <operand_major A_MAJOR, operand_major B_MAJOR, int N, typename TileA, typename TileB>
__device__ __forceinline__ void mma_overwrite(accumulator<N>& acc, const TileA& a, int a_mn0, const TileB& b, int b_mn0) {
  using ops = shared_operands<A_MAJOR, B_MAJOR, TileA, TileB>;
  using T = typename ops::element;
  constexpr int k = ops::k, trans_a = ops::trans_a, trans_b = ops::trans_b;
  wgmma_instruction<N>::template ss_overwrite<T, trans_a, trans_b>(acc, describe<A_MAJOR>(a, a_mn0, 0).bits,
                                                                   describe<B_MAJOR>(b, b_mn0, 0).bits);
#pragma unroll
  for (int k0 = 16; k0 < k; k0 += 16) {
    wgmma_instruction<N>::template ss<T, trans_a, trans_b>(acc, describe<A_MAJOR>(a, a_mn0, k0).bits,
                                                           describe<B_MAJOR>(b, b_mn0, k0).bits, 1);
  }
}

// acc (+)= A * B[k0 : k0 + 16, b_mn0 : b_mn0 + N] with A (64 x 16) from registers: one k16 step,
// its 4 registers in PTX order (register_fragments.cuh makes them from a register tile).
template <operand_major B_MAJOR, int N, typename TileB>
__device__ __forceinline__ void mma(accumulator<N>& acc, const uint32_t (&a)[4], const TileB& b, int b_mn0, int k0,
                                    bool accumulate) {
  using T = typename TileB::element;
  constexpr int trans_b = B_MAJOR == operand_major::mn ? 1 : 0;
  const uint64_t b_desc = describe<B_MAJOR>(b, b_mn0, k0).bits;
  wgmma_instruction<N>::template rs<T, trans_b>(acc, a, b_desc, accumulate ? 1 : 0);
}

}  // namespace tk::warpgroup
