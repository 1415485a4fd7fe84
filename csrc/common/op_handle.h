// A typed handle for calling a torchops operator *through the dispatcher*:
// the call picks the right device kernel, is recorded by autograd (so a
// backward built from ops is differentiable again), and is visible to
// torch.compile's tracer.  It lives in the shared layer because shared code
// calls ops too (common/library_matmul.h); the dispatcher glue re-exports it
// (dispatch/handle.h).  Keep the handle in a function-local static so the
// schema is looked up once.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace torchops {

template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_handle(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, "")
      .template typed<Signature>();
}

}  // namespace torchops
