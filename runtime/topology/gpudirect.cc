#include "topology/gpudirect.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "topology/node_info.h"
#include "topology/sysfs.h"

namespace gradsync::topology {
namespace {

namespace fs = std::filesystem;
using sysfs::list_dir;
using sysfs::read_first_line;


bool exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}


std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::stringstream ss(path);
  std::string part;
  while (std::getline(ss, part, '/')) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

// The canonical path of `p` (inside root), with the root's canonical prefix removed so it
// reads like a real sysfs path ("/sys/devices/..."). Empty when it does not resolve.
std::string canonical_under(const SysfsRoot& root, const std::string& p) {
  std::error_code ec;
  fs::path real = fs::canonical(p, ec);
  if (ec) return "";
  fs::path base = fs::canonical(root.dir, ec);
  if (ec) return real.string();
  std::string r = real.string(), b = base.string();
  if (b != "/" && r.rfind(b, 0) == 0) r = r.substr(b.size());
  return r.empty() ? "/" : r;
}

int read_numa(const std::string& dev_dir) {
  const std::string s = read_first_line(dev_dir + "/numa_node");
  if (s.empty()) return -1;
  try {
    return std::stoi(s);
  } catch (...) {
    return -1;
  }
}

// A few data-centre parts by PCI device id; the rest print as "NVIDIA 10de:<device id>".
std::string model_from_pci_id(const std::string& device) {
  struct Known {
    const char* id;
    const char* name;
  };
  static constexpr Known kKnown[] = {
      {"0x2335", "NVIDIA H200"},          {"0x2330", "NVIDIA H100 80GB HBM3"},
      {"0x2331", "NVIDIA H100 PCIe"},     {"0x2324", "NVIDIA H800"},
      {"0x20b0", "NVIDIA A100-SXM4-40GB"}, {"0x20b2", "NVIDIA A100-SXM4-80GB"},
      {"0x20b5", "NVIDIA A100 80GB PCIe"}, {"0x20f1", "NVIDIA A100-PCIE-40GB"},
  };
  for (const auto& k : kKnown) {
    if (lower(device) == k.id) return k.name;
  }
  return "";
}

std::string hex4(const std::string& v) {  // "0x10de" -> "10de"
  return v.rfind("0x", 0) == 0 ? v.substr(2) : v;
}

RegistrationFacts read_registration(const SysfsRoot& root, const std::string& driver_version) {
  RegistrationFacts r;
  for (const char* p : {"/sys/module/nvidia_peermem", "/sys/module/nv_peer_mem"}) {
    if (exists(root.path(p))) {
      r.peermem_module = true;
      r.peermem_evidence.push_back(p);
    }
  }
  {
    std::ifstream mods(root.path("/proc/modules"));
    std::string line;
    while (std::getline(mods, line)) {
      if (line.rfind("nvidia_peermem ", 0) == 0 || line.rfind("nv_peer_mem ", 0) == 0) {
        r.peermem_module = true;
        r.peermem_evidence.push_back("/proc/modules: " + line.substr(0, line.find(' ')));
      }
    }
  }
  for (const char* p : {"/sys/kernel/mm/memory_peers/nv_mem/version",
                        "/sys/kernel/mm/memory_peers/nv_mem_nc/version"}) {
    if (exists(root.path(p))) {
      r.peermem_registered = true;
      r.peermem_evidence.push_back(p);
    }
  }
  r.kernel_release = read_first_line(root.path("/proc/sys/kernel/osrelease"));
  if (std::sscanf(r.kernel_release.c_str(), "%d.%d", &r.kernel_major, &r.kernel_minor) == 2) {
    r.kernel_has_rdma_dmabuf =
        r.kernel_major > 5 || (r.kernel_major == 5 && r.kernel_minor >= 12);
  }
  r.dmabuf_sysfs = exists(root.path("/sys/kernel/dmabuf"));
  const std::string cfg = root.path("/boot/config-" + r.kernel_release);
  if (!r.kernel_release.empty() && exists(cfg)) {
    std::ifstream in(cfg);
    std::string line, found;
    for (const char* key : {"CONFIG_DMA_SHARED_BUFFER", "CONFIG_INFINIBAND", "CONFIG_PCI_P2PDMA",
                            "CONFIG_DMABUF_MOVE_NOTIFY"}) {
      in.clear();
      in.seekg(0);
      std::string value = "not set";
      const std::string k = std::string(key) + "=";
      while (std::getline(in, line)) {
        if (line.rfind(k, 0) == 0) value = line.substr(k.size());
      }
      found += (found.empty() ? "" : ", ") + std::string(key) + "=" + value;
    }
    r.kernel_config_note = "/boot/config-" + r.kernel_release + ": " + found;
  } else if (exists(root.path("/proc/config.gz"))) {
    r.kernel_config_note =
        "/proc/config.gz present but compressed, not read (zcat /proc/config.gz | grep -e "
        "DMA_SHARED_BUFFER -e PCI_P2PDMA -e DMABUF_MOVE_NOTIFY)";
  } else {
    r.kernel_config_note = "kernel config not found (/boot/config-<release>, /proc/config.gz)";
  }
  r.open_kernel_module = driver_version.find("Open Kernel Module") != std::string::npos;
  return r;
}

std::string pad(const std::string& s, size_t width) {
  return s.size() >= width ? s + " " : s + std::string(width - s.size(), ' ');
}

std::string tri(int v, const std::string& unknown_reason) {
  if (v < 0) return "unknown (" + unknown_reason + ")";
  return v ? "yes" : "no";
}

}  // namespace

std::string SysfsRoot::path(std::string_view abs) const {
  std::string base = dir.empty() ? "/" : dir;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  if (base == "/") return std::string(abs);
  return base + std::string(abs);
}

const char* distance_name(PciDistance d) {
  switch (d) {
    case PciDistance::PIX: return "PIX";
    case PciDistance::PXB: return "PXB";
    case PciDistance::PHB: return "PHB";
    case PciDistance::NODE: return "NODE";
    case PciDistance::SYS: return "SYS";
  }
  return "?";
}

std::optional<PciDistance> parse_distance(std::string_view text) {
  std::string t = lower(std::string(text));
  if (t == "pix" || t == "1") return PciDistance::PIX;
  if (t == "pxb" || t == "2") return PciDistance::PXB;
  if (t == "phb" || t == "3") return PciDistance::PHB;
  if (t == "node" || t == "4") return PciDistance::NODE;
  if (t == "sys" || t == "5") return PciDistance::SYS;
  return std::nullopt;
}

PciDistance pci_distance(const std::string& a, int numa_a, const std::string& b, int numa_b) {
  // Split into the host bridge element ("pci0000:17") and the chain of PCI functions below it.
  auto chain = [](const std::string& path, std::string& host) {
    std::vector<std::string> below;
    bool seen = false;
    for (auto& part : split_path(path)) {
      if (!seen && part.rfind("pci", 0) == 0 && part.find(':') != std::string::npos) {
        host = part;
        seen = true;
      } else if (seen) {
        below.push_back(part);
      }
    }
    return below;
  };
  std::string host_a, host_b;
  std::vector<std::string> ca = chain(a, host_a), cb = chain(b, host_b);
  if (host_a.empty() || host_b.empty() || ca.empty() || cb.empty()) return PciDistance::SYS;
  if (host_a != host_b) return numa_a == numa_b ? PciDistance::NODE : PciDistance::SYS;
  ca.pop_back();  // the devices themselves; what is left are the bridges above each
  cb.pop_back();
  if (!ca.empty() && !cb.empty() && ca.back() == cb.back()) return PciDistance::PIX;
  if (!ca.empty() && !cb.empty() && ca.front() == cb.front()) return PciDistance::PXB;
  return PciDistance::PHB;
}

const char* path_name(DataPath p) {
  switch (p) {
    case DataPath::kGpuDirectRdma: return "GPUDirect RDMA";
    case DataPath::kHostStagedRdma: return "host-staged RDMA";
    case DataPath::kTcp: return "TCP";
  }
  return "?";
}

std::string ordering_name(int v) {
  switch (v) {
    case 0: return "NONE (0): flush before a kernel consumes RDMA-written data";
    case 100: return "OWNER (100): the owning GPU sees completed RDMA writes without a flush";
    case 200: return "ALL_DEVICES (200): every GPU sees completed RDMA writes without a flush";
    default: return v < 0 ? "unknown" : "value " + std::to_string(v);
  }
}

bool RdmaDevice::has_active_port() const {
  return std::any_of(ports.begin(), ports.end(),
                     [](const RdmaPort& p) { return p.state == "ACTIVE"; });
}

GpuPath decide_path(const PathInputs& in, PciDistance level) {
  GpuPath out;
  const std::string gpu = in.gpu >= 0 ? "GPU " + std::to_string(in.gpu) : std::string("the GPU");
  if (!in.any_rdma_device) {
    out.path = DataPath::kTcp;
    out.reason = "no RDMA device";
    return out;
  }
  if (!in.nic_active) {
    out.path = DataPath::kTcp;
    out.reason = "no RDMA device has an ACTIVE port";
    return out;
  }
  out.nic = in.nic;
  out.distance = in.distance;
  out.path = DataPath::kHostStagedRdma;
  if (in.gpu_direct_rdma_supported == 0) {
    out.reason = gpu + " reports GPU_DIRECT_RDMA_SUPPORTED=0";
    return out;
  }
  // Registration: dma-buf first, then nvidia-peermem (design §3).
  std::string how;
  const bool nic_refuses = in.nic_dmabuf == 0;
  if (in.dma_buf_supported == 1 && in.kernel_rdma_dmabuf && !nic_refuses) {
    how = "dma-buf";
  } else if (in.peermem) {
    how = "nvidia-peermem";
  } else if (in.dma_buf_supported < 0 && in.kernel_rdma_dmabuf && in.open_kernel_module && !nic_refuses) {
    how = "dma-buf (inferred: open kernel module, kernel >= 5.12; CUDA attribute " +
          std::string("unknown: ") + in.cuda_unknown_reason + ")";
  }
  if (how.empty()) {
    std::string why;
    if (in.dma_buf_supported == 0) why = gpu + " reports DMA_BUF_SUPPORTED=0";
    else if (in.dma_buf_supported < 0) why = "dma-buf support unknown (" + in.cuda_unknown_reason + ")";
    if (!in.kernel_rdma_dmabuf) {
      why += (why.empty() ? "" : ", ") + std::string("kernel older than 5.12 (no RDMA dma-buf)");
    }
    if (nic_refuses) {
      why += (why.empty() ? "" : ", ") + in.nic + " does not register dma-buf (" + in.nic_dmabuf_note + ")";
    }
    out.reason = gpu + " memory cannot be registered with " + in.nic + ": " + why +
                 " and nvidia-peermem is not loaded";
    return out;
  }
  if (!in.distance) {
    out.reason = "no PCIe path between " + gpu + " and " + in.nic + " (distance unknown)";
    return out;
  }
  const std::string pair = gpu + " - " + in.nic + " is " + distance_name(*in.distance);
  if (static_cast<int>(*in.distance) > static_cast<int>(level)) {
    out.reason = pair + ", above GRADSYNC_GDR_LEVEL=" + distance_name(level);
    return out;
  }
  out.path = DataPath::kGpuDirectRdma;
  out.registration = how;
  out.reason = pair + ", within GRADSYNC_GDR_LEVEL=" + distance_name(level) + "; registration via " + how;
  return out;
}

GpuPath path_for_message(const GpuPath& peer, size_t message_bytes, size_t gdr_min_bytes) {
  if (peer.path != DataPath::kGpuDirectRdma || message_bytes >= gdr_min_bytes) return peer;
  GpuPath out = peer;
  out.path = DataPath::kHostStagedRdma;
  out.registration.clear();
  out.reason = std::to_string(message_bytes) + " bytes < GRADSYNC_GDR_MIN_BYTES=" +
               std::to_string(gdr_min_bytes) + ": host-staged RDMA for this message (" + peer.reason + ")";
  return out;
}

Result<size_t> parse_gdr_min_bytes(std::string_view text) {
  const auto bad = [&](const char* why) {
    return Status(Code::kInvalidArgument,
                  "GRADSYNC_GDR_MIN_BYTES='" + std::string(text) + "' " + why +
                      ": give a byte count such as 65536, 64K or 1M (K/M/G = 1024-based; 0 = GPUDirect RDMA "
                      "for every message size)");
  };
  size_t i = 0;
  unsigned long long value = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    const unsigned digit = static_cast<unsigned>(text[i] - '0');
    if (value > (~0ull - digit) / 10) return bad("is too large");
    value = value * 10 + digit;
    ++i;
  }
  if (i == 0) return bad("is not a byte count");
  unsigned shift = 0;
  if (i < text.size()) {
    switch (std::tolower(static_cast<unsigned char>(text[i]))) {
      case 'k': shift = 10; break;
      case 'm': shift = 20; break;
      case 'g': shift = 30; break;
      default: return bad("has an unknown suffix");
    }
    if (++i != text.size()) return bad("has trailing characters");
  }
  if (value > (~0ull >> shift) || (value << shift) > static_cast<unsigned long long>(SIZE_MAX))
    return bad("is too large");
  return static_cast<size_t>(value << shift);
}

size_t gdr_min_bytes_from_times(const std::vector<size_t>& sizes, const std::vector<double>& gdr_us,
                                const std::vector<double>& staged_us) {
  const size_t n = std::min({sizes.size(), gdr_us.size(), staged_us.size()});
  if (n == 0) return 0;
  size_t from = n;  // GPUDirect wins at every size from sizes[from] up
  for (size_t i = n; i-- > 0;) {
    if (gdr_us[i] > staged_us[i]) break;
    from = i;
  }
  if (from == 0) return 0;  // no slower at the smallest size measured: at every size
  return from < n ? sizes[from] : 2 * sizes[n - 1];
}

Result<size_t> gdr_min_bytes_from_env(size_t measured) {
  const char* env = std::getenv("GRADSYNC_GDR_MIN_BYTES");
  if (env == nullptr || *env == '\0') return measured;
  return parse_gdr_min_bytes(env);
}

bool GpuReport::all_gpus_gdr() const {
  if (gpus.empty()) return false;
  return std::all_of(paths.begin(), paths.end(),
                     [](const GpuPath& p) { return p.path == DataPath::kGpuDirectRdma; });
}

GpuReport build_report(const SysfsRoot& root, const CudaFacts& cuda, PciDistance level,
                       const std::function<NicDmaBufProbe(const std::string& device)>& probe) {
  GpuReport rep;
  rep.root = root.dir;
  rep.cuda = cuda;
  rep.level = level;
  rep.driver_version = read_first_line(root.path("/proc/driver/nvidia/version"));
  if (rep.driver_version.empty()) {
    const std::string v = read_first_line(root.path("/sys/module/nvidia/version"));
    if (!v.empty()) rep.driver_version = "nvidia module " + v;
  }

  const std::string pci_dir = root.path("/sys/bus/pci/devices");
  for (const auto& entry : find_nvidia_gpus(pci_dir)) {
    GpuInfo g;
    g.pci_address = entry.substr(0, entry.find(' '));
    const std::string dev = pci_dir + "/" + g.pci_address;
    const std::string device_id = read_first_line(dev + "/device");
    g.pci_id = hex4(read_first_line(dev + "/vendor")) + ":" + hex4(device_id);
    g.sysfs_path = canonical_under(root, dev);
    g.numa_node = read_numa(dev);
    for (size_t i = 0; i < rep.cuda.gpus.size(); ++i) {
      if (lower(rep.cuda.gpus[i].pci_address) == lower(g.pci_address)) {
        g.cuda_index = static_cast<int>(i);
      }
    }
    if (g.cuda_index >= 0 && !rep.cuda.gpus[g.cuda_index].name.empty()) {
      g.model = rep.cuda.gpus[g.cuda_index].name;
    } else {
      g.model = model_from_pci_id(device_id);
      if (g.model.empty()) g.model = "NVIDIA " + g.pci_id;
    }
    rep.gpus.push_back(std::move(g));
  }

  const std::string ib_dir = root.path("/sys/class/infiniband");
  for (const auto& name : list_dir(ib_dir)) {
    RdmaDevice d;
    d.name = name;
    const std::string dev_link = ib_dir + "/" + name + "/device";
    d.sysfs_path = canonical_under(root, dev_link);
    if (!d.sysfs_path.empty()) {
      const std::string leaf = fs::path(d.sysfs_path).filename().string();
      if (std::count(leaf.begin(), leaf.end(), ':') == 2) d.pci_address = leaf;
    }
    d.numa_node = read_numa(dev_link);
    d.netdevs = list_dir(dev_link + "/net");
    for (const auto& port : list_dir(ib_dir + "/" + name + "/ports")) {
      const std::string pd = ib_dir + "/" + name + "/ports/" + port;
      RdmaPort p;
      p.number = port;
      p.state = read_first_line(pd + "/state");  // "4: ACTIVE"
      if (auto colon = p.state.find(": "); colon != std::string::npos) {
        p.state = p.state.substr(colon + 2);
      }
      p.link_layer = read_first_line(pd + "/link_layer");
      p.active_mtu = read_first_line(pd + "/active_mtu");
      p.rate = read_first_line(pd + "/rate");
      d.ports.push_back(std::move(p));
    }
    if (probe) {
      NicDmaBufProbe p = probe(d.name);
      d.dmabuf = p.supported;
      d.dmabuf_note = std::move(p.note);
    }
    rep.nics.push_back(std::move(d));
  }

  rep.reg = read_registration(root, rep.driver_version);

  for (const auto& g : rep.gpus) {
    std::vector<std::optional<PciDistance>> row;
    for (const auto& n : rep.nics) {
      if (g.sysfs_path.empty() || n.sysfs_path.empty() || n.pci_address.empty()) {
        row.push_back(std::nullopt);
      } else {
        row.push_back(pci_distance(g.sysfs_path, g.numa_node, n.sysfs_path, n.numa_node));
      }
    }
    rep.distance.push_back(std::move(row));
  }

  for (size_t gi = 0; gi < rep.gpus.size(); ++gi) {
    const GpuInfo& g = rep.gpus[gi];
    PathInputs in;
    in.gpu = static_cast<int>(gi);
    in.any_rdma_device = !rep.nics.empty();
    // Nearest device with an ACTIVE port; unknown distance counts as farthest.
    int best = -1, best_rank = 1 << 20;
    for (size_t ni = 0; ni < rep.nics.size(); ++ni) {
      if (!rep.nics[ni].has_active_port()) continue;
      const auto& dist = rep.distance[gi][ni];
      const int rank = dist ? static_cast<int>(*dist) : 100;
      if (rank < best_rank) {
        best_rank = rank;
        best = static_cast<int>(ni);
      }
    }
    if (best >= 0) {
      in.nic_active = true;
      in.nic = rep.nics[best].name;
      in.distance = rep.distance[gi][best];
      in.nic_dmabuf = rep.nics[best].dmabuf;
      in.nic_dmabuf_note = rep.nics[best].dmabuf_note;
    }
    if (g.cuda_index >= 0) {
      const CudaGpu& c = rep.cuda.gpus[g.cuda_index];
      in.gpu_direct_rdma_supported = c.gpu_direct_rdma_supported;
      in.dma_buf_supported = c.dma_buf_supported;
    }
    in.cuda_unknown_reason = rep.cuda.available ? "CUDA does not list this GPU"
                                                : rep.cuda.unavailable_reason;
    in.peermem = rep.reg.peermem_module || rep.reg.peermem_registered;
    in.kernel_rdma_dmabuf = rep.reg.kernel_has_rdma_dmabuf;
    in.open_kernel_module = rep.reg.open_kernel_module;
    rep.paths.push_back(decide_path(in, level));
  }
  return rep;
}

std::optional<PciDistance> gpu_nic_distance(const SysfsRoot& root, const std::string& gpu_pci,
                                            const std::string& nic) {
  // CUDA prints "00000000:19:00.0" or "0000:19:00.0"; sysfs has "0000:19:00.0".
  std::string want;
  for (char ch : gpu_pci) want += char(std::tolower(static_cast<unsigned char>(ch)));
  if (const size_t colon = want.find(':'); colon != std::string::npos && colon > 4) want.erase(0, colon - 4);
  const GpuReport r = build_report(root, CudaFacts{}, PciDistance::SYS);
  for (size_t g = 0; g < r.gpus.size(); ++g) {
    if (r.gpus[g].pci_address != want) continue;
    for (size_t n = 0; n < r.nics.size(); ++n) {
      if (r.nics[n].name == nic) return r.distance[g][n];
    }
  }
  return std::nullopt;
}

int doctor_exit_code(const GpuReport& report, bool require_gdr) {
  return require_gdr && !report.all_gpus_gdr() ? 1 : 0;
}

std::string render(const GpuReport& r) {
  std::ostringstream o;
  const std::string cuda_unknown =
      r.cuda.available ? "CUDA does not list this GPU" : r.cuda.unavailable_reason;
  o << "gradsyncctl doctor: GPUDirect RDMA readiness"
    << (r.root.empty() || r.root == "/" ? "" : " (sysfs root " + r.root + ")") << "\n";

  if (r.gpus.empty() && r.nics.empty()) {
    o << "no NVIDIA GPU found; no RDMA device found: gradsync will use TCP with host memory\n";
  }

  o << "\nGPUs\n";
  if (r.gpus.empty()) o << "  none: no NVIDIA display/3D PCI function in /sys/bus/pci/devices\n";
  for (size_t i = 0; i < r.gpus.size(); ++i) {
    const auto& g = r.gpus[i];
    o << "  GPU" << i << "  " << g.pci_address << "  " << g.model << " [" << g.pci_id << "]"
      << "  numa " << g.numa_node << "\n";
  }
  o << "  driver: " << (r.driver_version.empty()
                            ? "unknown (no /proc/driver/nvidia/version, no /sys/module/nvidia/version)"
                            : r.driver_version)
    << "\n";
  o << "  CUDA: ";
  if (r.cuda.available) {
    o << "driver API " << r.cuda.driver_version / 1000 << "." << (r.cuda.driver_version % 1000) / 10
      << ", " << r.cuda.gpus.size() << " device(s)\n";
  } else {
    o << "unknown (" << r.cuda.unavailable_reason << ")\n";
  }

  o << "\nNICs (RDMA devices, /sys/class/infiniband)\n";
  if (r.nics.empty()) o << "  none\n";
  for (const auto& n : r.nics) {
    o << "  " << n.name << "  " << (n.pci_address.empty() ? "(not a PCI function)" : n.pci_address)
      << "  numa " << n.numa_node;
    if (!n.netdevs.empty()) {
      o << "  netdev";
      for (const auto& nd : n.netdevs) o << " " << nd;
    }
    o << "\n";
    if (n.ports.empty()) o << "    no ports\n";
    for (const auto& p : n.ports) {
      o << "    port " << p.number << ": " << (p.state.empty() ? "?" : p.state) << ", "
        << (p.link_layer.empty() ? "?" : p.link_layer) << ", rate "
        << (p.rate.empty() ? "?" : p.rate) << ", active_mtu "
        << (p.active_mtu.empty() ? "n/a (not in sysfs; see ibv_devinfo)" : p.active_mtu) << "\n";
    }
    o << "    dma-buf registration: "
      << (n.dmabuf == 1 ? "yes" : n.dmabuf == 0 ? "no" : "not probed")
      << (n.dmabuf_note.empty() ? "" : " (" + n.dmabuf_note + ")") << "\n";
  }

  o << "\nTopology (GPU to NIC, from sysfs PCIe paths)\n";
  if (r.gpus.empty() || r.nics.empty()) {
    o << "  nothing to compare\n";
  } else {
    o << "  " << pad("", 7);
    for (const auto& n : r.nics) o << pad(n.name, std::max<size_t>(6, n.name.size() + 1));
    o << "\n";
    for (size_t gi = 0; gi < r.gpus.size(); ++gi) {
      o << "  " << pad("GPU" + std::to_string(gi), 7);
      for (size_t ni = 0; ni < r.nics.size(); ++ni) {
        const auto& d = r.distance[gi][ni];
        o << pad(d ? distance_name(*d) : "?", std::max<size_t>(6, r.nics[ni].name.size() + 1));
      }
      o << "\n";
    }
    o << "  PIX same switch port, PXB same switch, PHB same host bridge, NODE same NUMA node, "
         "SYS across NUMA nodes\n";
  }

  o << "\nRegistering GPU memory with a NIC\n";
  o << "  nvidia-peermem: ";
  if (r.reg.peermem_module || r.reg.peermem_registered) {
    o << (r.reg.peermem_registered ? "loaded and registered with ib_core" : "module loaded");
    if (!r.reg.peermem_registered) {
      o << ", but /sys/kernel/mm/memory_peers/nv_mem is missing (not registered with ib_core?)";
    }
    o << " [";
    for (size_t i = 0; i < r.reg.peermem_evidence.size(); ++i) {
      o << (i ? ", " : "") << r.reg.peermem_evidence[i];
    }
    o << "]\n";
  } else {
    o << "not loaded (no /sys/module/nvidia_peermem, not in /proc/modules, no "
         "/sys/kernel/mm/memory_peers/nv_mem)\n";
  }
  o << "  dma-buf, kernel: " << (r.reg.kernel_release.empty() ? "release unknown" : r.reg.kernel_release);
  if (!r.reg.kernel_release.empty()) {
    o << (r.reg.kernel_has_rdma_dmabuf ? " (>= 5.12: has the RDMA dma-buf ioctls)"
                                       : " (< 5.12: no RDMA dma-buf)");
  }
  o << "; /sys/kernel/dmabuf " << (r.reg.dmabuf_sysfs ? "present" : "absent (informational)")
    << "\n  dma-buf, kernel config: " << r.reg.kernel_config_note << "\n";
  o << "  dma-buf, driver: "
    << (r.driver_version.empty() ? "unknown (no driver version)"
        : r.reg.open_kernel_module ? "open kernel module (dma-buf capable)"
                                   : "proprietary kernel module (dma-buf needs the open module)")
    << "\n";
  o << "  dma-buf, NIC: ";
  if (r.nics.empty()) o << "no RDMA device";
  for (size_t i = 0; i < r.nics.size(); ++i) {
    const RdmaDevice& n = r.nics[i];
    o << (i ? "; " : "") << n.name << " " << (n.dmabuf == 1 ? "yes" : n.dmabuf == 0 ? "no" : "not probed");
  }
  o << (r.nics.empty() ? "" : " (ibv_reg_dmabuf_mr with fd -1: see NICs above)") << "\n";
  for (size_t i = 0; i < r.gpus.size(); ++i) {
    const CudaGpu* c = r.gpus[i].cuda_index >= 0 ? &r.cuda.gpus[r.gpus[i].cuda_index] : nullptr;
    o << "  GPU" << i << ": DMA_BUF_SUPPORTED " << tri(c ? c->dma_buf_supported : -1, cuda_unknown)
      << "; GPU_DIRECT_RDMA_SUPPORTED "
      << tri(c ? c->gpu_direct_rdma_supported : -1, cuda_unknown)
      << "\n        RDMA write ordering: "
      << (c && c->rdma_writes_ordering >= 0 ? ordering_name(c->rdma_writes_ordering)
                                            : "unknown (" + cuda_unknown + ")")
      << "\n";
  }

  o << "\nPath per GPU (design section 3; GRADSYNC_GDR_LEVEL=" << distance_name(r.level) << ")\n";
  if (r.gpus.empty()) {
    o << "  no GPU: " << (r.nics.empty() ? "TCP" : "RDMA") << " with host memory\n";
  }
  for (size_t i = 0; i < r.paths.size(); ++i) {
    const auto& p = r.paths[i];
    o << "  GPU" << i << ": " << path_name(p.path);
    if (!p.nic.empty()) o << " via " << p.nic;
    o << " -- " << p.reason << "\n";
  }
  o << "  (doctor reports what the machine allows, not what a running job chose)\n";
  return o.str();
}

}  // namespace gradsync::topology
