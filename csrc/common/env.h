// Reading TORCHOPS_* environment variables: every read in the library goes
// through these functions, with a variable of common/env_registry.h, which is
// generated from the registry (torchops/envs.py), so C++ allows exactly the
// values Python and the README do.
//
// Unset and empty mean the default.  Any other value must be allowed, or the
// read raises a RuntimeError naming the op, the variable and the values it
// allows: a typo must never silently select the default.
//
// Each read is a getenv (about 15 ns, no lock, unlike c10::utils::get_env)
// where the caller makes it, so a test can flip a switch in-process between
// calls.
#pragma once

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/env_registry.h"

namespace torchops::env {

namespace detail {

// The value, or nullptr when unset or empty.
inline const char* value_of(const EnvVar& var) {
  const char* v = std::getenv(var.name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

inline std::string allowed(const EnvVar& var) {
  std::string text;
  if (var.kind == EnvKind::kFlag || var.kind == EnvKind::kChoice) {
    text = "one of ";
    for (int i = 0; i < var.count; ++i) {
      text += (i == 0 ? "" : ", ");
      text += var.values[i];
    }
    return text;
  }
  text = var.kind == EnvKind::kInt ? "an integer"
                                   : std::to_string(var.count) + " comma-separated integers";
  if (var.minimum != INT64_MIN) {
    text += " >= " + std::to_string(var.minimum);
  }
  return text;
}

[[noreturn]] inline void reject(const char* op, const EnvVar& var, const char* value) {
  TORCH_CHECK(false, "torchops", op ? "." : "", op ? op : "", ": ", var.name, "='", value,
              "' is not ", allowed(var),
              var.testing ? " (a testing switch; unset it for normal use)" : "");
}

// An integer >= var.minimum from [begin, end), or nullopt.
inline std::optional<int64_t> parse_int(const EnvVar& var, const char* begin, const char* end) {
  if (begin == end || std::memchr("0123456789-", *begin, 11) == nullptr) {
    return std::nullopt;
  }
  char* stop = nullptr;
  errno = 0;
  const long long v = std::strtoll(begin, &stop, 10);
  if (stop != end || errno == ERANGE || v < var.minimum) {
    return std::nullopt;
  }
  return static_cast<int64_t>(v);
}

}  // namespace detail

// The index of the value in var.values (0, the default, when unset).
inline int choice(const char* op, const EnvVar& var) {
  TORCH_INTERNAL_ASSERT(var.kind == EnvKind::kChoice, var.name, " is not a choice");
  const char* v = detail::value_of(var);
  if (v == nullptr) {
    return 0;
  }
  for (int i = 0; i < var.count; ++i) {
    if (std::strcmp(v, var.values[i]) == 0) {
      return i;
    }
  }
  detail::reject(op, var, v);
}

// Whether var's value at `index` is `value`: a caller that casts choice()
// to an enum of its own static_asserts the order of the enum's values.
constexpr bool value_at(const EnvVar& var, int index, std::string_view value) {
  return index < var.count && std::string_view(var.values[index]) == value;
}

// "1": true, "0": false, unset: nullopt (the caller's automatic choice).
inline std::optional<bool> flag(const char* op, const EnvVar& var) {
  TORCH_INTERNAL_ASSERT(var.kind == EnvKind::kFlag, var.name, " is not a flag");
  const char* v = detail::value_of(var);
  if (v == nullptr) {
    return std::nullopt;
  }
  if (std::strcmp(v, "0") != 0 && std::strcmp(v, "1") != 0) {
    detail::reject(op, var, v);
  }
  return v[0] == '1';
}

inline std::optional<int64_t> integer(const char* op, const EnvVar& var) {
  TORCH_INTERNAL_ASSERT(var.kind == EnvKind::kInt, var.name, " is not an integer");
  const char* v = detail::value_of(var);
  if (v == nullptr) {
    return std::nullopt;
  }
  const std::optional<int64_t> i = detail::parse_int(var, v, v + std::strlen(v));
  if (!i) {
    detail::reject(op, var, v);
  }
  return i;
}

// var.count comma-separated integers.
inline std::optional<std::vector<int64_t>> integers(const char* op, const EnvVar& var) {
  TORCH_INTERNAL_ASSERT(var.kind == EnvKind::kInts, var.name, " is not a list of integers");
  const char* v = detail::value_of(var);
  if (v == nullptr) {
    return std::nullopt;
  }
  std::vector<int64_t> out;
  const char* begin = v;
  while (true) {
    const char* comma = std::strchr(begin, ',');
    const char* end = comma != nullptr ? comma : begin + std::strlen(begin);
    const std::optional<int64_t> i = detail::parse_int(var, begin, end);
    if (!i) {
      detail::reject(op, var, v);
    }
    out.push_back(*i);
    if (comma == nullptr) {
      break;
    }
    begin = comma + 1;
  }
  if (static_cast<int>(out.size()) != var.count) {
    detail::reject(op, var, v);
  }
  return out;
}

}  // namespace torchops::env
