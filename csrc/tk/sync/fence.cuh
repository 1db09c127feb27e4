// Fences between the generic proxy (ordinary loads/stores, stmatrix) and the async proxy (TMA,
// wgmma operands in shared memory).
#pragma once

#include "../common.cuh"

namespace tk {

// Every thread that wrote shared memory with ordinary stores runs this before the barrier after
// which TMA (or wgmma) reads that memory.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

}  // namespace tk
