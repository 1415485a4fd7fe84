#pragma once
// CI only.  Torch's CPU wheel ships the c10/cuda headers but not this file,
// which CMake generates when torch itself is built with CUDA; without it no
// CUDA source can be compiled against the CPU wheel.  Its content matches a
// shared-library CUDA build of torch.
#define C10_CUDA_BUILD_SHARED_LIBS
