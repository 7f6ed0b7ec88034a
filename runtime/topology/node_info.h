// What this node has: hostname, addresses, CPUs, GPUs, NICs. Discovered from the kernel
// (getifaddrs, sched_getaffinity, sysfs) so it works without CUDA or rdma-core installed.
#pragma once

#include <string>
#include <vector>

namespace gradsync::topology {

struct NodeInfo {
  std::string hostname;
  std::vector<std::string> addresses;  // non-loopback, "eth0=10.0.0.2", "eth0=fe80::1"
  unsigned cpus = 1;                   // CPUs this process may run on (affinity), >= 1
  std::vector<std::string> gpus;       // NVIDIA display/3D PCI functions: "0000:19:00.0 NVIDIA"
  std::vector<std::string> nics;       // RDMA devices ("mlx5_0") then net interfaces ("eth0")
};

NodeInfo discover();

// One line for logs: "node-a: 16 cpus, gpus [..], nics [..], addresses [..]".
std::string describe(const NodeInfo& info);

// The GPU part of discover(), with the PCI device directory as a parameter so tests can
// point it at a fake sysfs tree.
std::vector<std::string> find_nvidia_gpus(const std::string& pci_devices_dir);

}  // namespace gradsync::topology
