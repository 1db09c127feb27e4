// mbarriers: the shared-memory barriers that TMA copies complete on and that pipeline stages use
// to pass buffers between producer and consumers.
//
// A barrier counts arrivals and (with expect-tx) bytes still to land; when both reach zero its
// phase completes and flips parity. Waiters name the parity of the phase they wait for, so a
// ring of barriers needs one phase bit per lap, not a counter per stage.
#pragma once

#include "../common.cuh"

namespace tk {

struct mbarrier {
  uint64_t state;

  // One thread initialises; the init must be fenced (fence_barrier_init) and the block synchronised
  // before any other thread or the copy engine touches the barrier.
  __device__ void init(uint32_t expected_arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(&state)), "r"(expected_arrivals)
                 : "memory");
  }

  __device__ void arrive() {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(&state)) : "memory");
  }

  // Arrive and announce `bytes` that asynchronous copies will still deliver in this phase.
  __device__ void arrive_expect_tx(uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(&state)), "r"(bytes)
                 : "memory");
  }

  // True once the phase of parity `phase` has completed (a fresh barrier counts parity 1 as done).
  __device__ bool test(uint32_t phase) {
    uint32_t done;
    asm volatile(
        "{\n"
        " .reg .pred complete;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        " selp.u32 %0, 1, 0, complete;\n"
        "}\n"
        : "=r"(done)
        : "r"(shared_address(&state)), "r"(phase)
        : "memory");
    return done != 0;
  }

  __device__ void wait(uint32_t phase) {
    while (!test(phase)) {
    }
  }
};

// Makes barrier initialisation visible to the other threads and to the copy engine.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

}  // namespace tk
