// Register reallocation between warpgroups (setmaxnreg). A warp-specialised kernel launches with
// an even split, then producers give registers back and consumers take them. Only effective when
// the kernel has a register cap at entry: __launch_bounds__(threads, 1).
#pragma once

#include "../../common.cuh"

namespace tk::warpgroup {

constexpr int REGISTER_FILE = 65536;  // 32-bit registers per SM

template <int REGISTERS>
constexpr bool valid_register_count() {
  return REGISTERS % 8 == 0 && REGISTERS >= 24 && REGISTERS <= 256;
}

// All four warps of the warpgroup execute this.
template <int REGISTERS>
__device__ __forceinline__ void increase_registers() {
  static_assert(valid_register_count<REGISTERS>(), "setmaxnreg takes a multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGISTERS));
}

template <int REGISTERS>
__device__ __forceinline__ void decrease_registers() {
  static_assert(valid_register_count<REGISTERS>(), "setmaxnreg takes a multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGISTERS));
}

}  // namespace tk::warpgroup
