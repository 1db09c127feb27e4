#pragma once

#include "descriptor.cuh"
#include "epilogue.cuh"
#include "registers.cuh"
#include "wgmma.cuh"
