#include "topology/node_info.h"
#include "topology/sysfs.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <thread>

namespace gradsync::topology {
namespace {

namespace fs = std::filesystem;
using sysfs::list_dir;
using sysfs::read_first_line;

constexpr const char* kPciDevicesDir = "/sys/bus/pci/devices";
constexpr const char* kInfinibandDir = "/sys/class/infiniband";
constexpr const char* kNetDir = "/sys/class/net";
constexpr const char* kNvidiaVendor = "0x10de";
constexpr const char* kDisplayClassPrefix = "0x03";  // PCI base class 03: display controller
constexpr int kMaxCpus = 1 << 16;                    // upper bound for the affinity mask



std::string local_hostname() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

std::vector<std::string> interface_addresses() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr || (ifa->ifa_flags & IFF_LOOPBACK)) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const int family = ifa->ifa_addr->sa_family;
    const void* addr = nullptr;
    if (family == AF_INET) {
      addr = &reinterpret_cast<const sockaddr_in*>(ifa->ifa_addr)->sin_addr;
    } else if (family == AF_INET6) {
      addr = &reinterpret_cast<const sockaddr_in6*>(ifa->ifa_addr)->sin6_addr;
    } else {
      continue;  // AF_PACKET and friends carry no IP address
    }
    if (inet_ntop(family, addr, text, sizeof(text)) == nullptr) continue;
    out.push_back(std::string(ifa->ifa_name) + "=" + text);
  }
  freeifaddrs(list);
  return out;
}

// CPUs we may run on, not CPUs installed: a container or taskset limits what we can use.
unsigned affinity_cpus() {
  for (int ncpus = 1024; ncpus <= kMaxCpus; ncpus *= 2) {
    cpu_set_t* set = CPU_ALLOC(ncpus);
    const size_t size = CPU_ALLOC_SIZE(ncpus);
    CPU_ZERO_S(size, set);
    const bool ok = sched_getaffinity(0, size, set) == 0;
    const int count = ok ? CPU_COUNT_S(size, set) : 0;
    CPU_FREE(set);
    if (ok) return count > 0 ? static_cast<unsigned>(count) : 1u;
    if (errno != EINVAL) break;  // EINVAL: the mask is too small for this kernel, grow it
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return "[" + out + "]";
}

}  // namespace

std::vector<std::string> find_nvidia_gpus(const std::string& pci_devices_dir) {
  std::vector<std::string> gpus;
  for (const auto& bdf : list_dir(pci_devices_dir)) {
    const fs::path dev = fs::path(pci_devices_dir) / bdf;
    if (read_first_line(dev / "vendor") != kNvidiaVendor) continue;
    if (read_first_line(dev / "class").rfind(kDisplayClassPrefix, 0) != 0) continue;
    gpus.push_back(bdf + " NVIDIA");
  }
  return gpus;
}

NodeInfo discover() {
  NodeInfo info;
  info.hostname = local_hostname();
  info.addresses = interface_addresses();
  info.cpus = affinity_cpus();
  info.gpus = find_nvidia_gpus(kPciDevicesDir);
  info.nics = list_dir(kInfinibandDir);
  for (auto& name : list_dir(kNetDir)) {
    if (name != "lo") info.nics.push_back(std::move(name));
  }
  return info;
}

std::string describe(const NodeInfo& info) {
  return info.hostname + ": " + std::to_string(info.cpus) + " cpus, gpus " + join(info.gpus) +
         ", nics " + join(info.nics) + ", addresses " + join(info.addresses);
}

}  // namespace gradsync::topology
