// Warpgroups taking turns: MEMBERS warpgroups run a critical section (e.g. issuing their wgmmas, so
// that one's tensor-core work overlaps the others' softmax) one at a time, in the fixed cycle
// 0, 1, ..., MEMBERS - 1, 0, ... Member m's turn is one named barrier, the m-th of MEMBERS
// consecutive ids from `first`: the member before it arrives there when it passes the turn on,
// and m syncs there to take it. So a turn barrier always joins two warpgroups, the one passing and
// the one taking, whatever MEMBERS is.
//
//   turns.grant_first()     member 0 passes the very first turn to itself (once, before its first wait)
//   turns.wait()            block until this member's turn
//   turns.pass()            hand the turn to the next member, without waiting
//   turns.pass(true)        the same, on every member's last turn of the rotation: the last member
//                           keeps it, so every barrier phase opened is also completed
//
// Every member must take the same number of turns, so that the cycle stays aligned.
#pragma once

#include "../common.cuh"
#include "named_barrier.cuh"

namespace tk {

template <typename Id, int MEMBERS>
struct turn_rotation {
  static_assert(MEMBERS >= 1, "a rotation has at least one member");
  static constexpr int threads = 2 * WARPGROUP_THREADS;  // the passing and the taking warpgroup

  Id first;    // member 0's turn barrier; member m's is barrier_after(first, m)
  int member;  // this warpgroup's place in the cycle

  __device__ __forceinline__ void grant_first() const {
    if (member == 0) barrier_arrive(first, threads);
  }
  __device__ __forceinline__ void wait() const { barrier_sync(barrier_after(first, member), threads); }
  __device__ __forceinline__ void pass(bool last_turn = false) const {
    if (last_turn && member == MEMBERS - 1) return;
    barrier_arrive(barrier_after(first, (member + 1) % MEMBERS), threads);
  }
};

}  // namespace tk
