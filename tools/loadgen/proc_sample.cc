#include "loadgen/proc_sample.h"

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

namespace gradsync::loadgen {

ProcSample sample_process(pid_t pid) {
  const std::string dir = pid == 0 ? "/proc/self" : "/proc/" + std::to_string(pid);
  ProcSample out;
  std::ifstream stat(dir + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return out;
  // Fields after the command name, which may hold spaces: it ends at the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return out;
  std::istringstream fields(line.substr(close + 2));
  std::string f;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; fields >> f; ++i) {  // field 3 is the state
    if (i == 14) utime = std::stoull(f);
    if (i == 15) {
      stime = std::stoull(f);
      break;
    }
  }
  out.cpu_s = double(utime + stime) / double(sysconf(_SC_CLK_TCK));
  std::ifstream status(dir + "/status");
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) out.rss_bytes = std::stoull(line.substr(6)) * 1024;
    if (line.rfind("Threads:", 0) == 0) out.threads = uint32_t(std::stoul(line.substr(8)));
  }
  out.ok = true;
  return out;
}

}  // namespace gradsync::loadgen
