// A node's GPU topology: its GPUs, how each pair is joined (NVLink, NVSwitch or PCIe), its NICs
// with their PCIe distance to each GPU, and each GPU's own NIC (its rail). Found through NVML
// (dlopen'ed, nvml_api.h), else CUDA peer access, else PCIe paths alone, always with the reason;
// or declared by a topology file (GRADSYNC_TOPO_FILE, topo_file.h) for tests that give ranks
// sharing one GPU the shape of several GPUs and nodes. The GPU channels are planned over it; the
// daemon sends a summary to the coordinator (topology_summary.h) and `gradsyncctl describe`
// prints it.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "gradsync/status.h"
#include "topology/gpudirect.h"
#include "topology/nvml_api.h"

namespace gradsync::topology {

// NVLink line rate per link and direction, GB/s, where NVML does not give the version: NVLink
// 2.0 to 4.0 (V100, A100, H100/H200: 18 links = 450 GB/s per direction).
constexpr double kNvLinkGBpsPerLink = 25.0;
// NVLink 5.0 (B200: 18 links = 900 GB/s per direction).
constexpr double kNvLink5GBpsPerLink = 50.0;

enum class GpuLinkKind { kSelf, kNvLink, kNvSwitch, kPcie };

// How two GPUs of a node are joined.
struct GpuLink {
  GpuLinkKind kind = GpuLinkKind::kPcie;
  int nvlinks = 0;    // NVLink: links between the two; NVSwitch: the fewer of their switch links
  double gbps = 0;    // GB/s per direction over NVLink/NVSwitch; 0 for PCIe (not measured)
  std::optional<PciDistance> pcie;  // the PCIe path between the two, where known
  int p2p = -1;       // CUDA peer access between them: 1 yes, 0 no, -1 not asked
  bool operator==(const GpuLink&) const = default;
};

// The letters of `nvidia-smi topo -m`: "X" (itself), "NV18" (18 NVLinks, direct or through
// NVSwitch), "PIX" .. "SYS" (PCIe), "?" (PCIe, path unknown).
std::string link_label(const GpuLink& link);

struct TopoGpu {
  std::string pci_bus_id;  // "0000:19:00.0", lower case
  std::string name;        // "NVIDIA H200"
  int device = -1;         // the CUDA device it is (a topology file may map several GPUs to 0); -1 unknown
};

struct TopoNic {
  std::string name;        // "mlx5_0"
  std::string pci_bus_id;  // "" when not a PCI function
  double gbits = 0;        // line rate of its first ACTIVE port, Gb/s; 0 unknown
};

struct NodeTopology {
  std::string source;  // "nvml", "cuda" (peer access), "pcie" (sysfs paths only), "file PATH"
  std::string note;    // why a fallback was taken ("libnvidia-ml.so.1 not found ..."); "" with NVML
  std::vector<TopoGpu> gpus;
  std::vector<std::vector<GpuLink>> links;  // [a][b], symmetric; [a][a] is kSelf
  std::vector<TopoNic> nics;
  std::vector<std::vector<std::optional<PciDistance>>> nic_distance;  // [gpu][nic]
  std::vector<int> rails;  // per GPU: the index of its NIC in `nics`; -1 without NICs or none declared
  bool nvswitch() const;   // some pair is joined through NVSwitch
};

// Each GPU's own NIC: the nearest (PIX before PXB .. SYS, unknown last); among equally near
// NICs the one with the fewest GPUs so far, then the lowest index, so that 8 GPUs that all see
// 4 NICs alike get two each. -1 for every GPU when there is no NIC.
std::vector<int> assign_rails(const std::vector<std::vector<std::optional<PciDistance>>>& distance, size_t nics);

// What the CUDA runtime says about peer access, for the fallback without NVML.
struct CudaPeers {
  bool available = false;
  std::string reason;                       // why not, when !available
  std::vector<std::string> pci_bus_ids;     // per CUDA device, "0000:19:00.0"
  std::vector<std::vector<int>> can_access;  // [a][b]: cudaDeviceCanAccessPeer
};
// cuda_peers.cc in builds with CUDA; elsewhere {false, "built without CUDA"}.
CudaPeers probe_cuda_peers();

// Where discovery looks; tests pass a fake tree, a fake NVML table and fake CUDA answers.
struct TopologySources {
  SysfsRoot root;
  const NvmlApi* nvml = nullptr;          // null: no NVML, for the reason below
  std::string nvml_missing = "NVML not asked";
  std::function<CudaPeers()> cuda_peers;  // null: no CUDA fallback
};

// GPUs and NICs from sysfs (gpudirect.h's reader), pairs from NVML, else from CUDA peer access
// over the PCIe distances, else PCIe distances alone; `note` says which source failed and why.
NodeTopology discover_gpu_topology(const TopologySources& sources);

// The node's topology as the daemon and the GPU communicator take it: the file `topo_file`
// when it is not empty (GRADSYNC_TOPO_FILE; a file that does not parse is an error, never
// ignored), else discovery with the real NVML, CUDA and /sys.
Result<NodeTopology> node_gpu_topology(const std::string& topo_file);

// One line for logs: "nvml: 8 GPUs, NVSwitch NV18, 8 NICs, rails 0>mlx5_0 1>mlx5_1 ...".
std::string describe(const NodeTopology& topo);

}  // namespace gradsync::topology
