#include "launcher/process.h"

#include <fcntl.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <map>

extern char** environ;

namespace gradsync::launcher {
namespace {

constexpr int kExecFailedExit = 127;  // what shells return for "command not found"

std::vector<char*> c_strings(const std::vector<std::string>& items) {
  std::vector<char*> out;
  for (const auto& s : items) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

bool is_executable_file(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

// Only async-signal-safe calls from here on: the child of fork() runs this.
[[noreturn]] void exec_child(const Command& cmd, char* const* argv, char* const* envp, int out_w,
                             int err_w, pid_t parent, const sigset_t& mask) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(kExecFailedExit);              // the launcher died before prctl
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);  // dup2 drops CLOEXEC
  if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
  if (out_w >= 0) dup2(out_w, STDOUT_FILENO);
  if (err_w >= 0) dup2(err_w, STDERR_FILENO);
  signal(SIGPIPE, SIG_DFL);  // the launcher ignores it; ignored dispositions survive exec
  sigprocmask(SIG_SETMASK, &mask, nullptr);
  execve(cmd.path.c_str(), argv, envp);
  const char* why = strerror(errno);
  const char* parts[] = {"gradsyncrun: cannot execute ", cmd.path.c_str(), ": ", why, "\n"};
  for (const char* p : parts) (void)!write(STDERR_FILENO, p, strlen(p));
  _exit(kExecFailedExit);
}

Status errno_status(const std::string& what) {
  return Status(Code::kInternal, what + ": " + strerror(errno));
}

}  // namespace

Result<Spawned> spawn(const Command& cmd, const sigset_t& child_mask) {
  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  if (cmd.capture_output) {
    if (pipe2(out_pipe, O_CLOEXEC) != 0) return errno_status("pipe");
    if (pipe2(err_pipe, O_CLOEXEC) != 0) {
      close(out_pipe[0]);
      close(out_pipe[1]);
      return errno_status("pipe");
    }
  }
  Spawned s{-1, Fd(out_pipe[0]), Fd(err_pipe[0])};
  Fd out_w(out_pipe[1]);
  Fd err_w(err_pipe[1]);
  // Built before fork: the child may not allocate.
  auto argv = c_strings(cmd.argv);
  auto envp = c_strings(cmd.env);
  const pid_t parent = getpid();
  s.pid = fork();
  if (s.pid < 0) return errno_status("fork");
  if (s.pid == 0) {
    exec_child(cmd, argv.data(), envp.data(), out_w.get(), err_w.get(), parent, child_mask);
  }
  // Also from the parent, so kill(-pid) works even before the child ran; EACCES after the
  // child's exec is expected and harmless.
  setpgid(s.pid, s.pid);
  return s;
}

Result<std::string> find_executable(const std::string& name, const std::vector<std::string>& dirs) {
  if (name.find('/') != std::string::npos) {
    if (is_executable_file(name)) return name;
    return Status(Code::kNotFound, "'" + name + "' is not an executable file");
  }
  std::vector<std::string> search = dirs;
  const char* path_env = std::getenv("PATH");
  std::string path = path_env != nullptr ? path_env : "/usr/local/bin:/usr/bin:/bin";
  for (size_t start = 0; start <= path.size();) {
    const size_t end = std::min(path.find(':', start), path.size());
    search.push_back(end > start ? path.substr(start, end - start) : ".");  // "" means cwd
    start = end + 1;
  }
  std::vector<std::string> tried;
  for (const auto& dir : search) {
    const std::string candidate = dir + "/" + name;
    if (std::find(tried.begin(), tried.end(), candidate) != tried.end()) continue;
    if (is_executable_file(candidate)) return candidate;
    tried.push_back(candidate);
  }
  std::string list;
  for (const auto& t : tried) list += (list.empty() ? "" : ", ") + t;
  return Status(Code::kNotFound, "cannot find '" + name + "'; tried " + list);
}

std::string self_dir() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "" : exe.parent_path().string();
}

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* abbrev = sigabbrev_np(sig);
    return "killed by signal " + (abbrev ? "SIG" + std::string(abbrev) : std::to_string(sig));
  }
  return "ended with wait status " + std::to_string(status);
}

std::vector<std::string> environment_with(const std::vector<std::string>& overrides) {
  std::map<std::string, std::string> vars;  // ordered: children see a stable environment
  auto put = [&](const std::string& kv) {
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) vars[kv.substr(0, eq)] = kv.substr(eq + 1);
  };
  for (char** e = environ; *e != nullptr; ++e) put(*e);
  for (const auto& kv : overrides) put(kv);
  std::vector<std::string> out;
  for (const auto& [k, v] : vars) out.push_back(k + "=" + v);
  return out;
}

}  // namespace gradsync::launcher
