// Integers from the environment: the one parser the runtime's GRADSYNC_* numbers go through.
#pragma once

#include <cstdlib>

namespace gradsync {

// `name` as a whole decimal integer; `fallback` when it is unset, empty or not one.
inline long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (end && *end == '\0') ? x : fallback;
}

// The same for counts and sizes: `fallback` for a value <= 0 too.
inline long env_positive(const char* name, long fallback) {
  const long x = env_long(name, fallback);
  return x > 0 ? x : fallback;
}

}  // namespace gradsync
