// The warp-level tile core: everything a single warp does with register tiles and vectors.
#pragma once

#include "broadcast.cuh"
#include "complex.cuh"
#include "fragments.cuh"
#include "global_memory.cuh"
#include "layout.cuh"
#include "lines.cuh"
#include "maps.cuh"
#include "masks.cuh"
#include "mma.cuh"
#include "reductions.cuh"
#include "scan.cuh"
#include "shared_memory.cuh"
#include "split.cuh"
