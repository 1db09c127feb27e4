#pragma once

#include "descriptor.cuh"
#include "epilogue.cuh"
#include "register_fragments.cuh"
#include "registers.cuh"
#include "wgmma.cuh"
