#include "launcher/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "common/log.h"

namespace gradsync::launcher {

using namespace std::chrono_literals;

namespace {

constexpr auto kMaxPollWait = 100ms;      // the loop looks at the clock at least this often
constexpr auto kDrainAfterExit = 1000ms;  // output of a reaped child still held by a helper
constexpr size_t kReadChunkBytes = 64 * 1024;
constexpr size_t kMaxLineBytes = 1 << 20;  // a longer "line" is forwarded in pieces
constexpr int kReadsPerRound = 4;          // per stream and poll round: a chatty rank cannot
                                           // starve the others (poll is level-triggered)
constexpr int kReadsAtExit = 64;           // bounded, in case an escaped helper keeps writing

// Writes everything; rank output must not be lost to EINTR or a non-blocking stdout.
void write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w > 0) {
      data += w;
      n -= static_cast<size_t>(w);
    } else if (w < 0 && errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, -1);
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else {
      return;  // EPIPE and friends: whoever read our output is gone; drop it
    }
  }
}

}  // namespace

// Splits a child's byte stream into lines and writes each as "prefix line\n" in one write(),
// so lines of different ranks never interleave mid-line.
class LineForwarder {
 public:
  LineForwarder(std::string prefix, int out_fd) : prefix_(std::move(prefix)), fd_(out_fd) {}

  void feed(const char* data, size_t n) {
    buf_.append(data, n);
    std::string out;
    size_t start = 0;
    for (size_t nl; (nl = buf_.find('\n', start)) != std::string::npos; start = nl + 1) {
      out += prefix_;
      out.append(buf_, start, nl + 1 - start);
    }
    buf_.erase(0, start);
    if (buf_.size() >= kMaxLineBytes) {
      out += prefix_ + buf_ + "\n";
      buf_.clear();
    }
    if (!out.empty()) write_all(fd_, out.data(), out.size());
  }

  // At EOF: a last line without '\n' is still a line.
  void flush() {
    if (buf_.empty()) return;
    const std::string out = prefix_ + buf_ + "\n";
    buf_.clear();
    write_all(fd_, out.data(), out.size());
  }

 private:
  std::string prefix_;
  int fd_;
  std::string buf_;
};

struct Supervisor::Stream {
  int child = -1;
  Fd fd;
  LineForwarder forwarder;
  Deadline close_by = Deadline::max();
};

Supervisor::Supervisor() = default;

Supervisor::~Supervisor() {
  for (auto& s : streams_) close_stream(*s);
  if (initialized_) sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
}

Status Supervisor::init() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
  if (sigprocmask(SIG_BLOCK, &set, &old_mask_) != 0) {
    return Status(Code::kInternal, std::string("sigprocmask: ") + strerror(errno));
  }
  initialized_ = true;
  signal_fd_.reset(signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
  if (!signal_fd_.valid()) {
    return Status(Code::kInternal, std::string("signalfd: ") + strerror(errno));
  }
  return Status::Ok();
}

Result<int> Supervisor::start(const std::string& name, Command cmd, const std::string& prefix,
                              int out_fd, int err_fd) {
  auto spawned = spawn(cmd, old_mask_);
  if (!spawned.ok()) return spawned.status();
  const int index = static_cast<int>(children_.size());
  children_.push_back(Child{name, spawned->pid});
  log::get("launcher")->debug("started {} (pid {}): {}", name, spawned->pid, cmd.path);
  for (auto [fd, target] : {std::pair{&spawned->out, out_fd}, std::pair{&spawned->err, err_fd}}) {
    if (!fd->valid()) continue;
    fcntl(fd->get(), F_SETFL, fcntl(fd->get(), F_GETFL) | O_NONBLOCK);
    streams_.push_back(
        std::make_unique<Stream>(Stream{index, std::move(*fd), LineForwarder(prefix, target)}));
  }
  return index;
}

void Supervisor::step(Deadline deadline) {
  const auto now = Clock::now();
  const auto wait =
      deadline <= now
          ? 0ms
          : std::min<std::chrono::milliseconds>(
                kMaxPollWait, std::chrono::ceil<std::chrono::milliseconds>(deadline - now));
  std::vector<pollfd> fds{{signal_fd_.get(), POLLIN, 0}};
  std::vector<Stream*> polled;
  for (auto& s : streams_) {
    if (!s->fd.valid()) continue;
    fds.push_back({s->fd.get(), POLLIN, 0});
    polled.push_back(s.get());
  }
  const int n = ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
  if (n > 0) {
    if (fds[0].revents != 0) read_signals();
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0 && !pump(*polled[i - 1], kReadsPerRound))
        close_stream(*polled[i - 1]);
    }
  }
  // Every round, not only on SIGCHLD: signals coalesce, and a cheap WNOHANG check cannot miss.
  reap();
  const auto after = Clock::now();
  for (auto& s : streams_) {
    if (s->fd.valid() && after >= s->close_by) close_stream(*s);
  }
  std::erase_if(streams_, [](const auto& s) { return !s->fd.valid(); });
}

void Supervisor::read_signals() {
  signalfd_siginfo info;
  while (::read(signal_fd_.get(), &info, sizeof(info)) == sizeof(info)) {
    if (info.ssi_signo != SIGCHLD) pending_signal_ = static_cast<int>(info.ssi_signo);
  }
}

void Supervisor::reap() {
  for (size_t i = 0; i < children_.size(); ++i) {
    Child& c = children_[i];
    if (!c.alive) continue;
    siginfo_t info{};
    // WNOWAIT keeps the zombie, so its pid (and process group id) cannot be reused while
    // we kill what is left of the group: helpers it left behind would hold its pipes open.
    if (waitid(P_PID, c.pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0) {
      continue;
    }
    ::kill(-c.pid, SIGKILL);
    if (waitpid(c.pid, &c.status, 0) != c.pid) continue;
    c.alive = false;
    exits_.push_back({static_cast<int>(i), c.status});
    log::get("launcher")->debug("{} (pid {}) {}", c.name, c.pid, describe_wait_status(c.status));
    // Forward what it wrote before exiting now, so it comes before any message about the exit.
    const auto close_by = Clock::now() + kDrainAfterExit;
    for (auto& s : streams_) {
      if (s->child != static_cast<int>(i) || !s->fd.valid()) continue;
      if (!pump(*s, kReadsAtExit))
        close_stream(*s);
      else
        s->close_by = close_by;
    }
  }
}

bool Supervisor::pump(Stream& s, int max_reads) {
  char buf[kReadChunkBytes];
  for (int reads = 0; reads < max_reads;) {
    const ssize_t n = ::read(s.fd.get(), buf, sizeof(buf));
    if (n > 0) {
      s.forwarder.feed(buf, static_cast<size_t>(n));
      ++reads;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && errno == EAGAIN;  // EAGAIN: all read, still open; 0: EOF
  }
  return true;
}

void Supervisor::close_stream(Stream& s) {
  if (!s.fd.valid()) return;
  s.forwarder.flush();
  s.fd.reset();
}

bool Supervisor::output_open(int child) const {
  return std::any_of(streams_.begin(), streams_.end(),
                     [&](const auto& s) { return s->child == child && s->fd.valid(); });
}

std::vector<ChildExit> Supervisor::take_exits() { return std::exchange(exits_, {}); }

int Supervisor::take_signal() { return std::exchange(pending_signal_, 0); }

void Supervisor::kill_group(int child, int sig) {
  if (children_[child].alive) ::kill(-children_[child].pid, sig);
}

}  // namespace gradsync::launcher
