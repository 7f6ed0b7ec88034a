// The launcher's event loop: children, their output, their exits and the launcher's own
// signals, all through one poll() on pipes and a signalfd.
#pragma once

#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "common/fd.h"
#include "launcher/process.h"

namespace gradsync::launcher {

class LineForwarder;

struct ChildExit {
  int child = -1;  // index returned by Supervisor::start()
  int status = 0;  // waitpid status
};

class Supervisor {
 public:
  Supervisor();
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Routes SIGCHLD, SIGINT, SIGTERM and SIGHUP to a signalfd. Call before start().
  Status init();

  // Starts `cmd`. Each line it writes to stdout goes to `out_fd`, each stderr line to `err_fd`,
  // both behind `prefix`. Returns the child's index.
  Result<int> start(const std::string& name, Command cmd, const std::string& prefix, int out_fd,
                    int err_fd);

  // One round of waiting: returns after output, a signal or a child exit, or at
  // `deadline` (and at most every 100 ms, so callers can look at the clock).
  void step(Deadline deadline);

  std::vector<ChildExit> take_exits();
  // The last SIGINT/SIGTERM/SIGHUP the launcher received since the previous call, or 0.
  int take_signal();

  // Signals the child's whole process group, if the child has not been reaped yet.
  void kill_group(int child, int sig);
  bool alive(int child) const { return children_[child].alive; }
  bool output_open(int child) const;
  int status(int child) const { return children_[child].status; }
  const std::string& name(int child) const { return children_[child].name; }

 private:
  struct Child {
    std::string name;
    pid_t pid = -1;
    bool alive = true;
    int status = 0;
  };
  struct Stream;

  void read_signals();
  void reap();
  // Reads up to `max_reads` chunks; false once the stream reached EOF or failed.
  bool pump(Stream& s, int max_reads);
  void close_stream(Stream& s);

  Fd signal_fd_;
  sigset_t old_mask_{};
  bool initialized_ = false;
  std::vector<Child> children_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::vector<ChildExit> exits_;
  int pending_signal_ = 0;
};

}  // namespace gradsync::launcher
