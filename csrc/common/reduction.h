// The `reduction` argument of the loss ops ("none", "mean" or "sum", as in
// torch.nn.functional), parsed once for every loss and device.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <string>

namespace torchops {

enum class Reduction { None, Mean, Sum };

inline Reduction parse_reduction(const char* op, c10::string_view r) {
  if (r == "none") {
    return Reduction::None;
  }
  if (r == "mean") {
    return Reduction::Mean;
  }
  TORCH_CHECK(
      r == "sum", "torchops.", op, ": expected 'reduction' to be 'none', "
      "'mean' or 'sum', but got '", std::string(r), "'");
  return Reduction::Sum;
}

}  // namespace torchops
