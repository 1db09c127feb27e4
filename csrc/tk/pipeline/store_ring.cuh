// A ring of staging slots through which one warpgroup hands finished tiles to TMA stores, so that
// the next tile is written into shared memory while the copy engine still reads the previous ones.
// One store through the ring, by every thread of the warpgroup:
//
//   Tile& tile = staging[ring.slot()];                 the slot the store uses
//   ring.acquire(leader, slot_free);                    once the store that last used it has read it
//   ... write tile (stmatrix) ...; publish(written, WARPGROUP_THREADS);
//   if (leader) tma::store(map, tile, index);           the leader issues the slot's stores
//   ring.commit(leader);                                closes them as one bulk group; next slot
//
// and, before the block exits (the consumers' finish), drain(). acquire is wait_until_read() and
// the warpgroup barrier `slot_free`; a kernel whose barrier after the wait also serves other writes
// calls wait_until_read() alone. One store group may carry the slots of several staging arrays
// (each indexed by slot()), as long as it is committed once.
//
// Each slot is one bulk group, so "the store that last used this slot has read it" is "at most
// SLOTS - 1 groups still read shared memory". The ring's count lives in the warpgroup's registers
// (every thread keeps the same count); the slots live wherever the kernel keeps its shared memory,
// and the kernel indexes them itself. The verbs take no callbacks and no buffers: the kernel's
// writes, stores and shared-memory addressing stay in its own code, where the compiler sees them
// exactly as if written out by hand.
#pragma once

#include "../common.cuh"
#include "../ops/tma.cuh"
#include "../sync/named_barrier.cuh"

namespace tk::pipeline {

template <int SLOTS>
class tma_store_ring {
  static_assert(SLOTS >= 1, "a store ring has at least one slot");

 public:
  // The index, into the kernel's arrays of SLOTS staging buffers, of the buffer the next store uses.
  __device__ __forceinline__ int slot() const { return issued_ % SLOTS; }

  // The leader waits until the store that last used slot() has read it.
  __device__ __forceinline__ void wait_until_read(bool leader) const {
    if (leader) tma::wait_stores_read<SLOTS - 1>();
  }

  // wait_until_read, then the warpgroup barrier `slot_free`: every thread may write slot().
  template <typename Id>
  __device__ __forceinline__ void acquire(bool leader, Id slot_free) const {
    wait_until_read(leader);
    barrier_sync(slot_free, WARPGROUP_THREADS);
  }

  // After the leader has issued the slot's stores: it closes them as one bulk group, and every
  // thread moves on to the next slot.
  __device__ __forceinline__ void commit(bool leader) {
    if (leader) tma::commit_stores();
    ++issued_;
  }

  // The warpgroup leader waits until every store has read its slot, so the block may exit (or the
  // shared memory be reused).
  static __device__ __forceinline__ void drain() {
    if (is_warpgroup_leader()) tma::wait_stores_read<0>();
  }

 private:
  int issued_ = 0;  // stores issued so far; picks the slot
};

}  // namespace tk::pipeline
