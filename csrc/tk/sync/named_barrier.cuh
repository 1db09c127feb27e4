// Named barriers (bar.sync / bar.arrive): synchronise a subset of the block's warps, e.g. one
// warpgroup, without stopping the others. Id 0 is __syncthreads(). A kernel names its ids in an
// enum class that starts at FIRST_NAMED_BARRIER and ends with `count`, and checks it with
// `static_assert(fits_named_barriers<Ids>())`; no bare number reaches bar.sync.
#pragma once

#include <type_traits>

#include "../common.cuh"

namespace tk {

constexpr int FIRST_NAMED_BARRIER = 1;
constexpr int HARDWARE_NAMED_BARRIERS = 16;

template <typename Id>
constexpr bool fits_named_barriers() {
  return std::is_enum_v<Id> && int(Id::count) <= HARDWARE_NAMED_BARRIERS;
}

// The id `index` places after `first` (per-warpgroup barriers declared as a run of ids).
template <typename Id>
__device__ __forceinline__ Id barrier_after(Id first, int index) {
  return Id(int(first) + index);
}

// Every participating thread (whole warps) blocks until `threads` threads have arrived.
template <typename Id>
__device__ __forceinline__ void barrier_sync(Id id, int threads) {
  static_assert(std::is_enum_v<Id>, "name barrier ids in an enum");
  asm volatile("bar.sync %0, %1;" ::"r"(int(id)), "r"(threads) : "memory");
}

// Count this warp's threads towards `threads` without waiting (the signalling side of a hand-off,
// e.g. a warpgroup ping-pong where one side only announces its turn is over).
template <typename Id>
__device__ __forceinline__ void barrier_arrive(Id id, int threads) {
  static_assert(std::is_enum_v<Id>, "name barrier ids in an enum");
  asm volatile("bar.arrive %0, %1;" ::"r"(int(id)), "r"(threads) : "memory");
}

}  // namespace tk
