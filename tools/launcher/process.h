// Starting child processes for gradsyncrun: executable lookup, fork/exec with pipes, and
// naming how a child ended.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <string>
#include <vector>

#include "common/fd.h"
#include "gradsync/status.h"

namespace gradsync::launcher {

struct Command {
  std::string path;               // resolved executable, see find_executable()
  std::vector<std::string> argv;  // argv[0] included
  std::vector<std::string> env;   // complete environment, "KEY=VALUE"
  bool capture_output = true;     // false: the child shares the launcher's stdout/stderr
};

struct Spawned {
  pid_t pid = -1;
  Fd out;  // read ends of the child's stdout/stderr; invalid when not captured
  Fd err;
};

// Starts `cmd` in its own process group (so a signal reaches its helpers too) with stdin
// on /dev/null, the signal mask `child_mask` and SIGKILL as parent-death signal, so no rank
// outlives a launcher that was killed.
Result<Spawned> spawn(const Command& cmd, const sigset_t& child_mask);

// Looks `name` up in `dirs` first, then in $PATH (a name with a '/' is taken as is).
// On failure the status lists every path tried.
Result<std::string> find_executable(const std::string& name, const std::vector<std::string>& dirs);

// Directory holding the running executable (/proc/self/exe), "" if unknown.
std::string self_dir();

// "exited with code 3", "killed by signal SIGKILL".
std::string describe_wait_status(int status);

// The environment of this process with `overrides` ("KEY=VALUE") replacing or adding keys.
std::vector<std::string> environment_with(const std::vector<std::string>& overrides);

}  // namespace gradsync::launcher
