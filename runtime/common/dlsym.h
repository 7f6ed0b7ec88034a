// Resolving a function table from a dlopen'ed library (libibverbs, libnvidia-ml): each symbol
// into its typed entry, the names of the missing ones collected for one error message.
#pragma once

#include <dlfcn.h>

#include <string>

namespace gradsync {

// out = dlsym(handle, symbol); when it is not there, appends the name to `missing` ("a, b").
template <typename Fn>
bool resolve_symbol(void* handle, const char* symbol, Fn& out, std::string& missing) {
  out = reinterpret_cast<Fn>(dlsym(handle, symbol));
  if (out == nullptr) missing += missing.empty() ? symbol : std::string(", ") + symbol;
  return out != nullptr;
}

}  // namespace gradsync
