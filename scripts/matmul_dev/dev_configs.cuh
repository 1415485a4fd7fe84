// The tuning hooks of the path a harness build holds (capi.cu, one path per
// build, named by -DPATH_NAME): candidate configs and pinned choices that
// the library never builds.  Each path's file defines, in namespace
// torchops::cuda::gemm::dev, supports / workspace_bytes / run (the path's
// entry points with the harness's overrides) and its config table
// (cfg_count, cfg_name, cfg_dtypes: the check.py dtype keys a config
// serves, "" all; cfg_env: the env var that picks one at each call).
#pragma once

#define DEV_CAT2(a, b) a##b
#define DEV_CAT(a, b) DEV_CAT2(a, b)

#define DEV_PATH_sm80 1
#define DEV_PATH_simt 2
#define DEV_PATH_decode 3
#define DEV_PATH_sm90 4
#define DEV_PATH_sm90_3xtf32 5
#define DEV_PATH_ID DEV_CAT(DEV_PATH_, PATH_NAME)

#if DEV_PATH_ID == DEV_PATH_sm80
#include "dev_sm80.cuh"
#elif DEV_PATH_ID == DEV_PATH_simt
#include "dev_simt.cuh"
#elif DEV_PATH_ID == DEV_PATH_decode
#include "dev_decode.cuh"
#elif DEV_PATH_ID == DEV_PATH_sm90 || DEV_PATH_ID == DEV_PATH_sm90_3xtf32
#include "dev_sm90.cuh"
#else
#error "dev_configs.cuh: PATH_NAME is not a path with harness hooks"
#endif
