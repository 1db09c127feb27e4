// Prefix sums over a warp's values, destination in place:
//
//   float v[2];                                   lane l holds entries 2 l and 2 l + 1 of 64
//   const float total = inclusive_scan(v);        v[k] = sum of entries 0 .. (its index), lane-major
//
// The warp holds PER_LANE * 32 consecutive entries, lane l the run [PER_LANE l, PER_LANE (l + 1)).
// Each lane first sums its own run, then the lanes' totals are scanned by 5 shuffle steps
// (Hillis-Steele) and each lane adds what the lanes before it hold. Every lane gets the total of all
// entries back. Sums run in float, in this order (the lane's run left to right, then the carries):
// a Mamba-2 chunk's cumulative log decays (kernels/mamba2_ssd) are written to shared memory from
// here and read back as register vectors of whatever layout a tile needs. All 32 lanes take part.
#pragma once

#include "../../common.cuh"

namespace tk::warp {

template <int PER_LANE>
__device__ __forceinline__ float inclusive_scan(float (&values)[PER_LANE]) {
  static_assert(PER_LANE >= 1, "a lane holds at least one entry");
  float running = 0.0f;
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) {
    running += values[k];
    values[k] = running;
  }
  const int lane = lane_id();
  float through_lane = running;  // this lane's run and every earlier lane's, once the steps are done
#pragma unroll
  for (int distance = 1; distance < WARP_THREADS; distance *= 2) {
    const float earlier = __shfl_up_sync(ALL_LANES, through_lane, distance);
    if (lane >= distance) through_lane += earlier;
  }
  float before_lane = __shfl_up_sync(ALL_LANES, through_lane, 1);
  if (lane == 0) before_lane = 0.0f;
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) values[k] += before_lane;
  return __shfl_sync(ALL_LANES, through_lane, WARP_THREADS - 1);
}

}  // namespace tk::warp
