// Publishing shared memory to the async proxy: what a group of threads wrote with ordinary stores
// (st.shared, stmatrix) becomes readable by the wgmma or TMA store any of them issues after the
// group's barrier. Every writer fences its own writes, then all meet at the named barrier: a fence
// alone orders only its own thread's writes, and a barrier alone leaves them in the generic proxy.
#pragma once

#include "../common.cuh"
#include "fence.cuh"
#include "named_barrier.cuh"

namespace tk {

// Every thread of the `threads` that meet at `written` calls it, after its last write.
template <typename Id>
__device__ __forceinline__ void publish(Id written, int threads) {
  fence_async_shared();
  barrier_sync(written, threads);
}

}  // namespace tk
