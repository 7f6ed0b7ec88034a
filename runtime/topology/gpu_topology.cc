#include "topology/gpu_topology.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "topology/topo_file.h"

namespace gradsync::topology {
namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// "00000000:19:00.0" (NVML, CUDA) or "0000:19:00.0" -> "0000:19:00.0", as sysfs names it.
std::string normal_bus_id(const std::string& id) {
  std::string s = lower(id);
  if (const size_t colon = s.find(':'); colon != std::string::npos && colon > 4) s.erase(0, colon - 4);
  return s;
}

std::string nvml_bus_id(const nvml::PciInfo& p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%04x:%02x:%02x.0", p.domain & 0xffffu, p.bus & 0xffu, p.device & 0x1fu);
  return buf;
}

// "400 Gb/sec (4X NDR)" -> 400.
double rate_gbits(const std::string& rate) { return std::strtod(rate.c_str(), nullptr); }

double nvlink_gbps_per_link(const NvmlApi& api, nvml::Device d, unsigned link) {
  unsigned version = 0;
  // nvmlNvlinkVersion_t: 7 is NVLink 5.0; the earlier versions carry 20-25 GB/s per link.
  if (api.nvlink_version && api.nvlink_version(d, link, &version) == nvml::kSuccess && version >= 7) {
    return kNvLink5GBpsPerLink;
  }
  return kNvLinkGBpsPerLink;
}

// Grows the link matrix to the GPUs listed, keeping what it holds; the diagonal is kSelf.
void size_links(NodeTopology& topo) {
  const size_t n = topo.gpus.size();
  topo.links.resize(n);
  for (size_t a = 0; a < n; ++a) {
    topo.links[a].resize(n);
    topo.links[a][a] = GpuLink{GpuLinkKind::kSelf, 0, 0, std::nullopt, -1};
  }
}

// The GPU pairs from NVML into `topo` (GPUs already listed from sysfs, matched by bus id, or
// appended); "" on success, else why NVML could not say.
std::string links_from_nvml(const NvmlApi& api, NodeTopology& topo, std::map<std::string, size_t>& by_bus) {
  if (nvml::Return r = api.init(); r != nvml::kSuccess) return std::string(api.name) + ": nvmlInit_v2: " + nvml_error(api, r);
  struct Closer {
    const NvmlApi& api;
    ~Closer() { api.shutdown(); }
  } closer{api};
  unsigned count = 0;
  if (nvml::Return r = api.device_count(&count); r != nvml::kSuccess) {
    return std::string(api.name) + ": nvmlDeviceGetCount_v2: " + nvml_error(api, r);
  }
  std::vector<nvml::Device> dev(count, nullptr);
  std::vector<size_t> index(count);
  for (unsigned i = 0; i < count; ++i) {
    nvml::PciInfo pci{};
    if (nvml::Return r = api.device_by_index(i, &dev[i]); r != nvml::kSuccess) {
      return std::string(api.name) + ": nvmlDeviceGetHandleByIndex_v2(" + std::to_string(i) + "): " + nvml_error(api, r);
    }
    if (nvml::Return r = api.pci_info(dev[i], &pci); r != nvml::kSuccess) {
      return std::string(api.name) + ": nvmlDeviceGetPciInfo_v3(" + std::to_string(i) + "): " + nvml_error(api, r);
    }
    const std::string bus = nvml_bus_id(pci);
    auto it = by_bus.find(bus);
    if (it == by_bus.end()) {  // not in sysfs (a container without /sys/bus/pci): NVML's word
      it = by_bus.emplace(bus, topo.gpus.size()).first;
      topo.gpus.push_back({bus, "", -1});
    }
    index[i] = it->second;
    char name[96] = {};
    if (api.device_name(dev[i], name, sizeof(name)) == nvml::kSuccess && name[0]) topo.gpus[index[i]].name = name;
  }
  size_links(topo);
  const size_t n = topo.gpus.size();
  std::vector<std::vector<int>> direct(n, std::vector<int>(n, 0));
  std::vector<int> switch_links(n, 0);
  std::vector<double> per_link(n, kNvLinkGBpsPerLink);
  for (unsigned i = 0; i < count; ++i) {
    const size_t a = index[i];
    for (unsigned link = 0; link < nvml::kMaxLinks; ++link) {
      unsigned active = 0;
      const nvml::Return r = api.nvlink_state(dev[i], link, &active);
      if (r == nvml::kErrorInvalidArgument || r == nvml::kErrorNotSupported) break;  // past the last link
      if (r != nvml::kSuccess || active != nvml::kFeatureEnabled) continue;
      nvml::PciInfo remote{};
      if (api.nvlink_remote_pci(dev[i], link, &remote) != nvml::kSuccess) continue;
      per_link[a] = nvlink_gbps_per_link(api, dev[i], link);
      unsigned type = nvml::kNvLinkDeviceGpu;
      const bool typed = api.nvlink_remote_type && api.nvlink_remote_type(dev[i], link, &type) == nvml::kSuccess;
      auto peer = by_bus.find(nvml_bus_id(remote));
      if (typed ? type == nvml::kNvLinkDeviceGpu && peer != by_bus.end() : peer != by_bus.end()) {
        if (peer->second != a) ++direct[a][peer->second];
      } else if (!typed || type == nvml::kNvLinkDeviceSwitch) {
        ++switch_links[a];  // the far end is no GPU of this node: on HGX boards, an NVSwitch
      }
    }
  }
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = 0; b < n; ++b) {
      if (a == b) continue;
      GpuLink& l = topo.links[a][b];
      const int pair = std::max(direct[a][b], direct[b][a]);  // each link is seen from both ends
      if (pair > 0) {
        l.kind = GpuLinkKind::kNvLink;
        l.nvlinks = pair;
      } else if (switch_links[a] > 0 && switch_links[b] > 0) {
        l.kind = GpuLinkKind::kNvSwitch;
        l.nvlinks = std::min(switch_links[a], switch_links[b]);
      }
      if (l.kind != GpuLinkKind::kPcie) l.gbps = l.nvlinks * std::min(per_link[a], per_link[b]);
    }
  }
  // NVML's own P2P answer over NVLink, for pairs whose links it would not list one by one.
  for (unsigned i = 0; i < count; ++i) {
    for (unsigned j = 0; j < count; ++j) {
      GpuLink& l = topo.links[index[i]][index[j]];
      int status = -1;
      if (i == j || l.kind != GpuLinkKind::kPcie) continue;
      if (api.p2p_status(dev[i], dev[j], nvml::kP2PCapsNvLink, &status) == nvml::kSuccess &&
          status == nvml::kP2PStatusOk) {
        l.kind = GpuLinkKind::kNvLink;  // link count unknown: 0
      }
    }
  }
  return "";
}

}  // namespace

bool NodeTopology::nvswitch() const {
  for (const auto& row : links) {
    for (const auto& l : row) {
      if (l.kind == GpuLinkKind::kNvSwitch) return true;
    }
  }
  return false;
}

std::string link_label(const GpuLink& link) {
  switch (link.kind) {
    case GpuLinkKind::kSelf: return "X";
    case GpuLinkKind::kNvLink:
    case GpuLinkKind::kNvSwitch: return "NV" + (link.nvlinks > 0 ? std::to_string(link.nvlinks) : std::string("?"));
    case GpuLinkKind::kPcie: return link.pcie ? distance_name(*link.pcie) : "?";
  }
  return "?";
}

std::vector<int> assign_rails(const std::vector<std::vector<std::optional<PciDistance>>>& distance, size_t nics) {
  std::vector<int> rails(distance.size(), -1);
  std::vector<int> load(nics, 0);
  const auto rank = [](const std::optional<PciDistance>& d) { return d ? static_cast<int>(*d) : 100; };
  for (size_t g = 0; g < distance.size(); ++g) {
    int best = -1;
    for (size_t n = 0; n < nics && n < distance[g].size(); ++n) {
      const int r = rank(distance[g][n]);
      if (best < 0 || r < rank(distance[g][best]) || (r == rank(distance[g][best]) && load[n] < load[best])) {
        best = static_cast<int>(n);
      }
    }
    rails[g] = best;
    if (best >= 0) ++load[best];
  }
  return rails;
}

#if !GRADSYNC_TOPOLOGY_CUDA
CudaPeers probe_cuda_peers() {
  CudaPeers p;
  p.reason = "built without CUDA";
  return p;
}
#endif

NodeTopology discover_gpu_topology(const TopologySources& sources) {
  NodeTopology topo;
  const GpuReport rep = build_report(sources.root, CudaFacts{}, PciDistance::SYS);
  std::map<std::string, size_t> by_bus;
  for (const GpuInfo& g : rep.gpus) {
    by_bus[normal_bus_id(g.pci_address)] = topo.gpus.size();
    topo.gpus.push_back({normal_bus_id(g.pci_address), g.model, -1});
  }
  for (const RdmaDevice& d : rep.nics) {
    TopoNic nic{d.name, d.pci_address, 0};
    for (const RdmaPort& p : d.ports) {
      if (p.state == "ACTIVE" && nic.gbits == 0) nic.gbits = rate_gbits(p.rate);
    }
    topo.nics.push_back(std::move(nic));
  }
  size_links(topo);
  for (size_t a = 0; a < rep.gpus.size(); ++a) {
    for (size_t b = 0; b < rep.gpus.size(); ++b) {
      if (a == b || rep.gpus[a].sysfs_path.empty() || rep.gpus[b].sysfs_path.empty()) continue;
      topo.links[a][b].pcie = pci_distance(rep.gpus[a].sysfs_path, rep.gpus[a].numa_node, rep.gpus[b].sysfs_path,
                                           rep.gpus[b].numa_node);
    }
  }

  std::string why_not_nvml = sources.nvml ? links_from_nvml(*sources.nvml, topo, by_bus) : sources.nvml_missing;
  size_links(topo);  // NVML may have added GPUs before it failed
  if (why_not_nvml.empty()) {
    topo.source = "nvml";
  } else {
    topo.note = why_not_nvml;
    CudaPeers cuda = sources.cuda_peers ? sources.cuda_peers() : CudaPeers{false, "not asked", {}, {}};
    if (cuda.available) {
      topo.source = "cuda";
      for (size_t c = 0; c < cuda.pci_bus_ids.size(); ++c) {
        const std::string bus = normal_bus_id(cuda.pci_bus_ids[c]);
        if (!by_bus.count(bus)) {
          by_bus[bus] = topo.gpus.size();
          topo.gpus.push_back({bus, "", -1});
        }
        topo.gpus[by_bus[bus]].device = static_cast<int>(c);
      }
      size_links(topo);
      for (size_t a = 0; a < cuda.pci_bus_ids.size(); ++a) {
        for (size_t b = 0; b < cuda.pci_bus_ids.size(); ++b) {
          if (a == b || a >= cuda.can_access.size() || b >= cuda.can_access[a].size()) continue;
          topo.links[by_bus[normal_bus_id(cuda.pci_bus_ids[a])]][by_bus[normal_bus_id(cuda.pci_bus_ids[b])]].p2p =
              cuda.can_access[a][b] ? 1 : 0;
        }
      }
      topo.note += "; links from CUDA peer access over the PCIe paths (NVLink not told apart)";
    } else {
      topo.source = "pcie";
      topo.note += "; CUDA peer access: " + cuda.reason + "; links are the PCIe paths alone";
    }
  }

  // GPU-NIC distances from the report, by bus id; GPUs sysfs did not show have none.
  topo.nic_distance.assign(topo.gpus.size(), std::vector<std::optional<PciDistance>>(topo.nics.size()));
  for (size_t g = 0; g < rep.gpus.size(); ++g) {
    const size_t at = by_bus[normal_bus_id(rep.gpus[g].pci_address)];
    for (size_t n = 0; n < topo.nics.size(); ++n) topo.nic_distance[at][n] = rep.distance[g][n];
  }
  topo.rails = assign_rails(topo.nic_distance, topo.nics.size());
  return topo;
}

Result<NodeTopology> node_gpu_topology(const std::string& topo_file) {
  if (!topo_file.empty()) return parse_topo_file(topo_file);
  TopologySources src;
  auto nvml = load_nvml();
  if (nvml.ok()) src.nvml = *nvml;
  else src.nvml_missing = nvml.status().message();
  src.cuda_peers = &probe_cuda_peers;
  return discover_gpu_topology(src);
}

std::string describe(const NodeTopology& t) {
  std::string out = t.source + ": " + std::to_string(t.gpus.size()) + " GPU(s)";
  if (t.nvswitch()) {
    int links = 0;
    for (const auto& row : t.links) {
      for (const auto& l : row) {
        if (l.kind == GpuLinkKind::kNvSwitch) links = std::max(links, l.nvlinks);
      }
    }
    out += ", NVSwitch NV" + std::to_string(links);
  }
  out += ", " + std::to_string(t.nics.size()) + " NIC(s)";
  if (!t.rails.empty() && !t.nics.empty()) {
    out += ", rails";
    for (size_t g = 0; g < t.rails.size(); ++g) {
      out += " " + std::to_string(g) + ">" + (t.rails[g] >= 0 ? t.nics[size_t(t.rails[g])].name : "-");
    }
  }
  if (!t.note.empty()) out += " (" + t.note + ")";
  return out;
}

}  // namespace gradsync::topology
