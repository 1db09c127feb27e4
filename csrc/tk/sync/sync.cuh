#pragma once

#include "fence.cuh"
#include "mbarrier.cuh"
#include "named_barrier.cuh"
#include "publish.cuh"
#include "turn_rotation.cuh"
