#include "common/socket_path.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace gradsync {
namespace {

constexpr const char* kSystemDir = "/run/gradsync";
constexpr const char* kSocketName = "gradsyncd.sock";

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

std::vector<std::string> daemon_socket_candidates() {
  std::vector<std::string> out = {std::string(kSystemDir) + "/" + kSocketName};
  if (const std::string xdg = env("XDG_RUNTIME_DIR"); !xdg.empty()) out.push_back(xdg + "/gradsync/" + kSocketName);
  out.push_back("/tmp/gradsync-" + std::to_string(::getuid()) + "/" + kSocketName);
  return out;
}

std::string client_daemon_socket() {
  if (const std::string set = env("GRADSYNC_DAEMON"); !set.empty()) return set;
  const auto candidates = daemon_socket_candidates();
  for (const auto& c : candidates) {
    if (exists(c)) return c;
  }
  return candidates.front();
}

std::string server_daemon_socket() {
  if (const std::string set = env("GRADSYNC_DAEMON"); !set.empty()) return set;
  const auto candidates = daemon_socket_candidates();
  if (::geteuid() == 0 || ::access(kSystemDir, W_OK) == 0) return candidates.front();
  return candidates[1];
}

Status prepare_socket_dir(const std::string& socket_path) {
  const size_t slash = socket_path.rfind('/');
  if (slash == std::string::npos || slash == 0) return {};
  const std::string dir = socket_path.substr(0, slash);
  if (::mkdir(dir.c_str(), 0750) != 0 && errno != EEXIST) {
    return {Code::kUnavailable, "cannot create the socket directory " + dir + ": " + std::strerror(errno)};
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    return {Code::kUnavailable, "cannot stat the socket directory " + dir + ": " + std::strerror(errno)};
  }
  const bool mine = st.st_uid == ::geteuid() || st.st_uid == 0;
  const bool others_write = (st.st_mode & S_IWOTH) != 0 && (st.st_mode & S_ISVTX) == 0;
  if (!S_ISDIR(st.st_mode) || !mine || others_write) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", unsigned(st.st_mode & 07777));
    return {Code::kPermissionDenied,
            "refusing the socket directory " + dir + " (" + (S_ISDIR(st.st_mode) ? "" : "not a directory, ") +
                "owner uid " + std::to_string(st.st_uid) + ", mode " + mode +
                "): another user could replace the socket there; remove it or pass --socket"};
  }
  return {};
}

}  // namespace gradsync
