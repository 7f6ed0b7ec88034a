// Attack 8 of docs/security.md: a user of the same machines looks for a job's token where it
// used to be, to join or disturb the job. It is not in any process's command line (what `ps`
// shows every user), not in any log (every process at debug level), and not in `gradsyncctl
// describe`. gradsyncrun takes it from a file; its ranks get it through their environment,
// which only their own user can read.
#include <dirent.h>
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cluster.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

constexpr char kToken[] = "tok-9d41c7e2-never-shown";

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The command lines of every process on the machine whose command line has the token, as
// "pid: cmdline" (NULs shown as spaces).
std::vector<std::string> command_lines_with(const std::string& needle) {
  std::vector<std::string> out;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::string cmd = slurp(std::string("/proc/") + e->d_name + "/cmdline");
    for (char& c : cmd) if (c == '\0') c = ' ';
    if (cmd.find(needle) != std::string::npos) out.push_back(std::string(e->d_name) + ": " + cmd);
  }
  ::closedir(d);
  return out;
}

TEST(TokenExposure, NotInArgvLogsOrDescribe) {
  Cluster c({.daemons = 2,
             .coordinator_args = {"--log-level", "debug"},
             .daemon_args = {"--log-level", "debug"}});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  const std::string token_file = c.dir() + "/token";
  {
    std::ofstream f(token_file);
    f << kToken << "\n";
  }
  ::chmod(token_file.c_str(), 0600);

  // One gradsyncrun per node, on the cluster's daemons, token from the file; the ranks live
  // until the test creates `release`.
  const std::string release = c.dir() + "/release";
  std::vector<Process> launchers;
  for (int node = 0; node < 2; ++node) {
    launchers.push_back(c.spawn(
        "gradsyncrun " + std::to_string(node),
        {binary("gradsyncrun"), "--daemon", c.socket(node), "--coordinator", c.coordinator_address(), "--nnodes",
         "2", "--node-rank", std::to_string(node), "-n", "2", "--job-id", "exposure", "--token-file", token_file,
         "--log-level", "debug", binary("allreduce_worker"), "hold", release},
        {{"GRADSYNC_JOB_TOKEN", ""}, {"GRADSYNC_LOG_LEVEL", "debug"}}, /*stdin_pipe=*/true));
  }
  ASSERT_TRUE(launchers[0].wait_for_output("[rank 0] JOINED", 60s)) << c.report(launchers);

  // While the job runs: no command line on the machine has it.
  const auto shown = command_lines_with(kToken);
  EXPECT_TRUE(shown.empty()) << "the token is in a command line: " << shown.front();
  // The ranks did get it (through the environment), or the check above proves nothing.
  std::string pid;
  for (const std::string& line : command_lines_with("allreduce_worker hold")) {
    const std::string cmd = line.substr(line.find(": ") + 2);
    if (cmd.rfind(binary("allreduce_worker"), 0) == 0) pid = line.substr(0, line.find(':'));
  }
  ASSERT_FALSE(pid.empty()) << "no rank process found";
  std::string environ = slurp("/proc/" + pid + "/environ");
  EXPECT_NE(environ.find(std::string("GRADSYNC_JOB_TOKEN=") + kToken), std::string::npos);

  Process describe = c.spawn("gradsyncctl describe",
                             {binary("gradsyncctl"), "--coordinator", c.coordinator_address(), "describe", "exposure"});
  auto st = describe.wait_for_exit(20s);
  ASSERT_TRUE(st.has_value() && st->success()) << describe.output();
  EXPECT_NE(describe.output().find("exposure"), std::string::npos) << describe.output();
  EXPECT_EQ(describe.output().find(kToken), std::string::npos) << describe.output();

  std::ofstream(release) << "go\n";
  for (auto& l : launchers) l.close_stdin();
  std::string problems = all_succeeded(launchers, 60s);
  EXPECT_EQ(problems, "") << c.report(launchers);

  // Nothing any process wrote has it: the daemons and coordinator at debug level, the
  // launchers and their ranks.
  const std::string everything = c.report(launchers);
  EXPECT_NE(everything.find("job=exposure"), std::string::npos) << "the logs are not what this test reads";
  EXPECT_EQ(everything.find(kToken), std::string::npos) << "the token is in a log:\n" << everything;
}

}  // namespace
}  // namespace gradsync::testing
