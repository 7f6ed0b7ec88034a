// GPUDirect RDMA readiness: what this machine allows, read from sysfs/procfs only.
//
// The pure parts (PCIe distance letters, the per-GPU path decision of design §3, the report
// built from a sysfs tree) live here so tests can run them against a fake tree in a temp
// directory. CUDA facts are an input (CudaFacts): the caller fills them, for example
// tools/doctor by dlopen-ing libcuda.so.1, or leaves them unavailable.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/status.h"

namespace gradsync::topology {

// Where the fake or real kernel trees are: "/" in production, a temp dir in tests. Every
// sysfs/procfs path below is read as root + "/sys/..." or root + "/proc/...".
struct SysfsRoot {
  std::string dir = "/";
  std::string path(std::string_view abs) const;  // path("/sys/x") -> dir + "/sys/x"
};

// GPU-NIC PCIe distance, the letters of `nvidia-smi topo -m` and NCCL, nearest first.
enum class PciDistance { PIX = 1, PXB = 2, PHB = 3, NODE = 4, SYS = 5 };

const char* distance_name(PciDistance d);
// "PIX", "pxb", ... (case-insensitive) or NCCL's numbers 1..5; nullopt when unknown.
std::optional<PciDistance> parse_distance(std::string_view text);

// Distance between two PCI devices from their sysfs device paths (the realpath of
// /sys/bus/pci/devices/ADDR, e.g. "/sys/devices/pci0000:17/0000:17:00.0/0000:18:00.0/0000:19:00.0")
// and their numa_node values (-1 = unknown):
//   PIX  the two share their immediate parent bridge (same PCIe switch port)
//   PXB  they share some bridge below the host bridge, but not the immediate parent
//   PHB  same host bridge ("pciDDDD:BB" element), no bridge in common
//   NODE different host bridges, same NUMA node (both -1 counts as the same node)
//   SYS  different NUMA nodes, or a path without a "pci" host bridge element
PciDistance pci_distance(const std::string& sysfs_path_a, int numa_a,
                         const std::string& sysfs_path_b, int numa_b);

// What CUDA says, per device; -1 = not known.
struct CudaGpu {
  std::string pci_address;  // "0000:19:00.0", lower case
  std::string name;         // "NVIDIA H200"
  int dma_buf_supported = -1;       // CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124)
  int gpu_direct_rdma_supported = -1;  // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (116)
  int rdma_writes_ordering = -1;       // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING (118)
};

struct CudaFacts {
  bool available = false;
  std::string unavailable_reason = "built without CUDA";  // shown as "unknown (<reason>)"
  int driver_version = 0;  // cuDriverGetVersion: 13000 = 13.0
  std::vector<CudaGpu> gpus;
};

struct RdmaPort {
  std::string number;      // "1"
  std::string state;       // "ACTIVE" (from "4: ACTIVE")
  std::string link_layer;  // "InfiniBand", "Ethernet"
  std::string active_mtu;  // empty when sysfs has no such file (ibv_devinfo shows it)
  std::string rate;        // "400 Gb/sec (4X NDR)"
};

struct RdmaDevice {
  std::string name;         // "mlx5_0"
  std::string pci_address;  // "0000:1a:00.0"; empty for a device that is not a PCI function
  std::string sysfs_path;   // PCI device path relative to the root, "/sys/devices/pci..."
  int numa_node = -1;
  std::vector<std::string> netdevs;  // "ib0", "ens1f0np0"
  std::vector<RdmaPort> ports;
  // dma-buf registration on this device, probed through verbs (gradsyncctl doctor): 1 yes,
  // 0 no, -1 not probed; the note says how it was found out.
  int dmabuf = -1;
  std::string dmabuf_note;
  bool has_active_port() const;
};

// The verbs probe of one device's dma-buf support (RdmaDevice::dmabuf and its note).
struct NicDmaBufProbe {
  int supported = -1;
  std::string note;
};

struct GpuInfo {
  std::string pci_address;  // "0000:19:00.0"
  std::string pci_id;       // "10de:2335"
  std::string model;        // from CUDA, else from the PCI device id, else "NVIDIA 10de:<device id>"
  std::string sysfs_path;
  int numa_node = -1;
  int cuda_index = -1;  // index into GpuReport::cuda.gpus; -1 when not matched
};

enum class DataPath { kGpuDirectRdma, kHostStagedRdma, kTcp };
const char* path_name(DataPath p);

// Facts about registering GPU memory with a NIC (design §3 verbs, gdr_verbs.md §1).
struct RegistrationFacts {
  bool peermem_module = false;     // /sys/module/nvidia_peermem or /proc/modules
  bool peermem_registered = false;  // /sys/kernel/mm/memory_peers/nv_mem*/version
  std::vector<std::string> peermem_evidence;  // which files said so
  std::string kernel_release;        // /proc/sys/kernel/osrelease
  int kernel_major = 0, kernel_minor = 0;
  bool kernel_has_rdma_dmabuf = false;  // >= 5.12
  bool dmabuf_sysfs = false;            // /sys/kernel/dmabuf (CONFIG_DMABUF_SYSFS_STATS)
  std::string kernel_config_note;       // what the kernel config said, or why it was not read
  bool open_kernel_module = false;      // driver version line says "Open Kernel Module"
};

struct GpuPath {
  DataPath path = DataPath::kTcp;
  std::string nic;  // chosen RDMA device; empty for TCP
  std::optional<PciDistance> distance;
  std::string registration;  // "dma-buf", "nvidia-peermem", "" when none
  std::string reason;
};

// Inputs of the decision for one GPU, so it can be tested without a tree.
struct PathInputs {
  int gpu = -1;             // the GPU's index, for the reason text ("GPU 0 - mlx5_0 is SYS, ...")
  bool any_rdma_device = false;
  bool nic_active = false;  // the nearest device has an ACTIVE port
  std::string nic;          // nearest device with an ACTIVE port (else nearest device)
  std::optional<PciDistance> distance;
  int gpu_direct_rdma_supported = -1;  // CUDA attribute 116, -1 unknown
  int dma_buf_supported = -1;          // CUDA attribute 124, -1 unknown
  std::string cuda_unknown_reason;     // "built without CUDA", ...
  bool peermem = false;                // nvidia-peermem registered with ib_core (or module loaded)
  bool kernel_rdma_dmabuf = false;     // kernel >= 5.12
  bool open_kernel_module = false;     // hint for dma-buf when CUDA is unknown
  int nic_dmabuf = -1;                 // the NIC's probe: 1 registers dma-buf, 0 not, -1 unknown
  std::string nic_dmabuf_note;
};

// Design §3, per GPU (and so per peer reached through its NIC): GPUDirect RDMA when a verbs
// device with an ACTIVE port is there, GPU memory can be registered with it (dma-buf or
// nvidia-peermem) and the GPU-NIC distance is within `level` (GRADSYNC_GDR_LEVEL, default
// PXB); host-staged RDMA when there is such a device but GPUDirect is not allowed; TCP when
// there is none. The reason names the GPU, the NIC and the rule, e.g.
// "GPU 0 - mlx5_0 is SYS, above GRADSYNC_GDR_LEVEL=PXB".
GpuPath decide_path(const PathInputs& in, PciDistance level);

// Design §3 rule 4, per message: a peer whose path is GPUDirect RDMA still sends a message
// of fewer than `gdr_min_bytes` host-staged (registration, mapping and flush costs can exceed
// the gain for small messages); any other path is returned as it is. The returned reason
// says which rule applied ("1024 bytes < GRADSYNC_GDR_MIN_BYTES=65536: host-staged RDMA").
GpuPath path_for_message(const GpuPath& peer, size_t message_bytes, size_t gdr_min_bytes);

// GRADSYNC_GDR_MIN_BYTES: the smallest message sent by GPUDirect RDMA. A byte count with an
// optional binary suffix K, M or G ("65536", "64K", "1M"); 0 = GPUDirect for every size.
// Unset or empty: `measured` (the threshold the runtime measured at start,
// gdr_min_bytes_from_times). Anything else: kInvalidArgument naming the
// variable and the bad value, so a typo does not silently change the path.
Result<size_t> gdr_min_bytes_from_env(size_t measured);
// The threshold from a measurement: per message size (ascending), the time of one call on the
// GPUDirect path and on the host-staged path. The smallest measured size from which GPUDirect
// is no slower at every larger measured size, or 0 (every size) when that is the smallest
// measured; twice the largest size when it is slower even there (larger calls are where
// staging costs most); 0 for no sizes.
size_t gdr_min_bytes_from_times(const std::vector<size_t>& sizes, const std::vector<double>& gdr_us,
                                const std::vector<double>& staged_us);
// The same parsing, for a given text (tests, command lines).
Result<size_t> parse_gdr_min_bytes(std::string_view text);

struct GpuReport {
  std::string root;
  CudaFacts cuda;
  std::string driver_version;  // first line of /proc/driver/nvidia/version, or module version
  std::vector<GpuInfo> gpus;
  std::vector<RdmaDevice> nics;
  // distance[g][n]: GPU g to NIC n; nullopt when one has no PCI path.
  std::vector<std::vector<std::optional<PciDistance>>> distance;
  RegistrationFacts reg;
  PciDistance level = PciDistance::PXB;
  std::vector<GpuPath> paths;  // one per GPU
  bool all_gpus_gdr() const;   // false when there is no GPU
};

// Reads the tree under root; `cuda` is copied into the report and matched by PCI address.
// `probe`, when given, is asked about each RDMA device by name (gradsyncctl doctor opens it
// through verbs); the answer goes into RdmaDevice::dmabuf and the path decision.
GpuReport build_report(const SysfsRoot& root, const CudaFacts& cuda, PciDistance level,
                       const std::function<NicDmaBufProbe(const std::string& device)>& probe = nullptr);

// The PCIe distance between the NVIDIA GPU at `gpu_pci` ("0000:19:00.0", any case; a longer
// domain as CUDA prints it is accepted) and the RDMA device `nic` in the tree under root;
// nullopt when either is not there or they share no PCI path. The GPU communicator checks it
// against GRADSYNC_GDR_LEVEL before taking GPUDirect RDMA (design §3).
std::optional<PciDistance> gpu_nic_distance(const SysfsRoot& root, const std::string& gpu_pci,
                                            const std::string& nic);

// The text gradsyncctl doctor prints.
std::string render(const GpuReport& report);

// gradsyncctl doctor's exit status: 0, or 1 with require_gdr when some GPU cannot use
// GPUDirect RDMA (also when there is no GPU at all: nothing can).
int doctor_exit_code(const GpuReport& report, bool require_gdr);

// RDMA write ordering value as text: "OWNER (100)".
std::string ordering_name(int value);

}  // namespace gradsync::topology
