// A ring of pipeline stages between one producer thread and the consumer warps, behind four verbs:
//
//   producer:   full = ring.acquire(at, bytes, part)   wait until the part is free, announce its bytes;
//               tma::load(..., full)                   the loads complete the part
//   consumers:  ring.wait(at, part)                    wait until the part has landed
//               ring.release(at, part)                 this warp is done reading it
//
// `at` is a ring_position each side advances on its own along the same sequence of iterations. A
// stage's tiles may come in PARTS parts that are released separately (attention's consumers are
// done with K long before V), each part with its own pair of barriers: `full` completes on one
// arrival plus the part's transaction bytes, `empty` on one arrival per consumer warp.
#pragma once

#include "../common.cuh"
#include "../sync/mbarrier.cuh"

namespace tk::pipeline {

template <int STAGES>
struct ring_position {
  int stage = 0;
  uint32_t phase = 0;  // parity of the lap; flips each time the ring wraps

  __host__ __device__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }

  // The position one iteration back (the stage before, on the same lap unless this is stage 0).
  __host__ __device__ ring_position previous() const { return stage == 0 ? ring_position{STAGES - 1, phase ^ 1} : ring_position{stage - 1, phase}; }

  // The position `iterations` further on.
  __host__ __device__ ring_position advanced_by(int iterations) const {
    const int steps = stage + iterations;
    return {steps % STAGES, phase ^ uint32_t((steps / STAGES) & 1)};
  }
};

template <int STAGES, int PARTS = 1>
struct stage_ring {
  static_assert(STAGES >= 1 && PARTS >= 1, "a ring has at least one stage of one part");
  static constexpr int stages = STAGES;
  static constexpr int parts = PARTS;
  using position = ring_position<STAGES>;

  mbarrier full[STAGES][PARTS];
  mbarrier empty[STAGES][PARTS];

  // One thread, followed by fence_barrier_init() and a block-wide sync before first use.
  __device__ void init(int consumer_warps) {
    for (int s = 0; s < STAGES; ++s) {
      for (int p = 0; p < PARTS; ++p) {
        full[s][p].init(1);
        empty[s][p].init(consumer_warps);
      }
    }
  }

  __device__ mbarrier& acquire(position at, uint32_t bytes, int part = 0) {
    // A fresh barrier counts the phase before its first as complete: the first lap never waits.
    empty[at.stage][part].wait(at.phase ^ 1);
    full[at.stage][part].arrive_expect_tx(bytes);
    return full[at.stage][part];
  }

  __device__ void wait(position at, int part = 0) { full[at.stage][part].wait(at.phase); }

  // Every lane of the warp must be done with the part (a wgmma wait, or the __syncwarp here).
  __device__ void release(position at, int part = 0) {
    __syncwarp();
    if (lane_id() == 0) empty[at.stage][part].arrive();
  }
};

}  // namespace tk::pipeline
