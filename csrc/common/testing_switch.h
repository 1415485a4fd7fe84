// Testing switches: environment variables, read at each call, that force
// one of an op's internal paths so that tests reach each on any input.  A
// value that names no path raises: a typo must not silently test the
// default one.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

namespace torchops {

// The index in `names` of `variable`'s value; names[0], the default, also
// when the variable is unset or empty.
inline int testing_switch(const char* op, const char* variable,
                          std::initializer_list<const char*> names) {
  const char* v = std::getenv(variable);
  if (v == nullptr || *v == '\0') {
    return 0;
  }
  int i = 0;
  std::string all;
  for (const char* name : names) {
    if (std::strcmp(v, name) == 0) {
      return i;
    }
    all += (i++ == 0 ? "" : ", ");
    all += name;
  }
  TORCH_CHECK(false, "torchops.", op, ": ", variable, "='", v, "' is not one of ", all,
              " (a testing switch; unset it for normal use)");
}

}  // namespace torchops
