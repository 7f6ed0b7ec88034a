// A real etcd for tests of the coordinator's --store (coordinator_store_test,
// coordinator_takeover_test): Debian's /usr/bin/etcd (etcd-server) on free loopback ports with
// a temporary data directory; killed (SIGKILL) and its directory removed by the destructor.
// Header-only: unit and integration tests include it.
#pragma once

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "test_dir.h"

namespace gradsync::testing {

// A port nobody listens on now (bind to 0, read it back, close).
inline int free_loopback_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

class EtcdProcess {
 public:
  static constexpr const char* kBinary = "/usr/bin/etcd";
  static bool installed() { return ::access(kBinary, X_OK) == 0; }

  // Starts etcd and waits up to `timeout` until it serves; error() says why not.
  explicit EtcdProcess(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    dir_ = make_test_dir("gradsync-etcd");
    if (dir_.empty()) {
      error_ = "mkdtemp gradsync-etcd-XXXXXX failed";
      return;
    }
    const int client_port = free_loopback_port();
    address_ = "127.0.0.1:" + std::to_string(client_port);
    const std::string client = "http://" + address_;
    const std::string peer = "http://127.0.0.1:" + std::to_string(free_loopback_port());
    const std::string log = dir_ + "/etcd.log", data = dir_ + "/data", cluster = "t=" + peer;
    pid_ = ::fork();
    if (pid_ == 0) {
      if (!std::freopen(log.c_str(), "w", stderr) || !std::freopen(log.c_str(), "a", stdout)) ::_exit(126);
      ::execl(kBinary, "etcd", "--name", "t", "--data-dir", data.c_str(), "--listen-client-urls", client.c_str(),
              "--advertise-client-urls", client.c_str(), "--listen-peer-urls", peer.c_str(),
              "--initial-advertise-peer-urls", peer.c_str(), "--initial-cluster", cluster.c_str(), nullptr);
      ::_exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (log_text().find("ready to serve client requests") == std::string::npos) {
      int status = 0;
      if (pid_ < 0 || ::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        error_ = "etcd exited at start:\n" + log_text();
        return;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        error_ = "etcd did not serve within the deadline:\n" + log_text();
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ~EtcdProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    remove_test_dir(dir_);
  }
  EtcdProcess(const EtcdProcess&) = delete;
  EtcdProcess& operator=(const EtcdProcess&) = delete;

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  const std::string& address() const { return address_; }  // "127.0.0.1:PORT" (client)
  const std::string& dir() const { return dir_; }           // a scratch directory for the test too
  std::string log_text() const {
    std::ifstream in(dir_ + "/etcd.log");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  pid_t pid_ = -1;
  std::string dir_, address_, error_;
};

}  // namespace gradsync::testing
