// The tile core: everything a kernel file includes.
#pragma once

#include "common.cuh"
#include "dispatch.h"
#include "ops/tma.cuh"
#include "ops/warp/warp.cuh"
#include "ops/warpgroup/warpgroup.cuh"
#include "pipeline/block.cuh"
#include "pipeline/producer_consumer.cuh"
#include "pipeline/stage_ring.cuh"
#include "pipeline/store_ring.cuh"
#include "pipeline/tile_scheduler.cuh"
#include "sync/sync.cuh"
#include "types/complex_tile.cuh"
#include "types/global_layout.cuh"
#include "types/register_tile.cuh"
#include "types/register_vector.cuh"
#include "types/shared_tile.cuh"
