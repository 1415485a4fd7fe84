// The one helper every op's dispatcher glue (csrc/dispatch/<op>_dispatch.cpp)
// shares: a typed handle for calling a torchops operator *through the
// dispatcher* (common/op_handle.h defines it; shared code uses it too).
//
// Autograd and autocast kernels call the op below them this way, never a
// kernel function directly: a call through the dispatcher picks the right
// device kernel, is recorded by autograd (so a backward built from ops is
// differentiable again), and is visible to torch.compile's tracer.  Each glue
// file declares the typed calls it needs next to their only users, keeping the
// handle in a function-local static so the schema is looked up once.
#pragma once

#include "common/op_handle.h"

namespace torchops::dispatch {

using torchops::typed_handle;

}  // namespace torchops::dispatch
