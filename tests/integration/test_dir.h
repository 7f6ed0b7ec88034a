// Scratch directories of the tests that start processes (Cluster, EtcdProcess, the TLS tests'
// certificates): under $TMPDIR where it is short enough for Unix socket paths (107 bytes), and
// kept when GRADSYNC_KEEP_TEST_DIR is set, so that scripts/asan-tests.sh can search every
// process's log in them for sanitizer reports afterwards. Header-only: unit tests use it too.
#pragma once

#include <stdlib.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

namespace gradsync::testing {

// A new directory "<base>/<prefix>-XXXXXX"; "" when mkdtemp failed (errno says why).
inline std::string make_test_dir(const std::string& prefix) {
  std::string base = "/tmp";
  if (const char* t = std::getenv("TMPDIR"); t && *t && std::strlen(t) < 60) base = t;
  std::string templ = base + "/" + prefix + "-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) return "";
  return templ;
}

// Removes `dir` and what is in it, unless GRADSYNC_KEEP_TEST_DIR is set.
inline void remove_test_dir(const std::string& dir) {
  if (dir.empty() || std::getenv("GRADSYNC_KEEP_TEST_DIR") != nullptr) return;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace gradsync::testing
