#include "topology/topology_summary.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <set>
#include <sstream>

#include "topology/topo_file.h"

namespace gradsync::topology {
namespace {

constexpr size_t kMaxShortString = 96;   // a bus id, a GPU or NIC name
constexpr size_t kMaxNoteBytes = 1024;   // the source (a file's path) and the fallback reason
constexpr int kMaxLinkLabelLinks = 999;  // "NV999"

bool known_label(const std::string& s, bool gpu_pair) {
  static const std::set<std::string> kPcie = {"PIX", "PXB", "PHB", "NODE", "SYS", "?"};
  if (kPcie.count(s)) return true;
  if (!gpu_pair) return false;
  if (s == "X" || s == "NV?") return true;
  if (s.size() < 3 || s.size() > 5 || s.compare(0, 2, "NV") != 0) return false;
  return std::all_of(s.begin() + 2, s.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
         std::stoi(s.substr(2)) <= kMaxLinkLabelLinks;
}

std::string distance_label(const std::optional<PciDistance>& d) { return d ? distance_name(*d) : "?"; }

}  // namespace

v1::GpuTopology summarize(const NodeTopology& t) {
  v1::GpuTopology s;
  s.set_source(t.source.substr(0, kMaxNoteBytes));
  s.set_note(t.note.substr(0, kMaxNoteBytes));
  const size_t n = std::min(t.gpus.size(), kMaxTopoGpus), m = std::min(t.nics.size(), kMaxTopoNics);
  for (size_t g = 0; g < n; ++g) {
    auto* gpu = s.add_gpus();
    gpu->set_bus_id(t.gpus[g].pci_bus_id.substr(0, kMaxShortString));
    gpu->set_name(t.gpus[g].name.substr(0, kMaxShortString));
  }
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = 0; b < n; ++b) {
      const GpuLink l = a < t.links.size() && b < t.links[a].size() ? t.links[a][b] : GpuLink{};
      s.add_links(link_label(l));
      s.add_link_gbps(uint32_t(std::lround(l.gbps)));
    }
  }
  for (size_t j = 0; j < m; ++j) {
    auto* nic = s.add_nics();
    nic->set_name(t.nics[j].name.substr(0, kMaxShortString));
    nic->set_gbits(uint32_t(std::lround(t.nics[j].gbits)));
  }
  for (size_t g = 0; g < n; ++g) {
    for (size_t j = 0; j < m; ++j) {
      s.add_nic_distance(g < t.nic_distance.size() && j < t.nic_distance[g].size() ? distance_label(t.nic_distance[g][j])
                                                                                    : "?");
    }
    const int rail = g < t.rails.size() ? t.rails[g] : -1;
    s.add_rails(rail >= 0 && size_t(rail) < m ? rail : -1);
  }
  s.set_nvswitch(t.nvswitch());
  return s;
}

Status check_summary(const v1::GpuTopology& s) {
  const auto bad = [](const std::string& why) {
    return Status(Code::kInvalidArgument, "gpu_topology: " + why);
  };
  const size_t n = size_t(s.gpus_size()), m = size_t(s.nics_size());
  if (n > kMaxTopoGpus) return bad(std::to_string(n) + " GPUs, above the limit of " + std::to_string(kMaxTopoGpus));
  if (m > kMaxTopoNics) return bad(std::to_string(m) + " NICs, above the limit of " + std::to_string(kMaxTopoNics));
  if (s.source().size() > kMaxNoteBytes || s.note().size() > kMaxNoteBytes) return bad("source or note too long");
  for (const auto& g : s.gpus()) {
    if (g.bus_id().size() > kMaxShortString || g.name().size() > kMaxShortString) return bad("a GPU's bus id or name too long");
  }
  for (const auto& nic : s.nics()) {
    if (nic.name().size() > kMaxShortString) return bad("a NIC's name too long");
  }
  if (size_t(s.links_size()) != n * n || size_t(s.link_gbps_size()) != n * n) {
    return bad(std::to_string(s.links_size()) + " link labels and " + std::to_string(s.link_gbps_size()) +
               " bandwidths for " + std::to_string(n) + " GPUs (want " + std::to_string(n * n) + " each)");
  }
  for (const auto& l : s.links()) {
    if (!known_label(l, true)) return bad("unknown link label '" + l.substr(0, kMaxShortString) + "'");
  }
  if (size_t(s.nic_distance_size()) != n * m) {
    return bad(std::to_string(s.nic_distance_size()) + " GPU-NIC distances for " + std::to_string(n) + " GPUs and " +
               std::to_string(m) + " NICs");
  }
  for (const auto& d : s.nic_distance()) {
    if (!known_label(d, false)) return bad("unknown GPU-NIC distance '" + d.substr(0, kMaxShortString) + "'");
  }
  if (size_t(s.rails_size()) != n) return bad(std::to_string(s.rails_size()) + " rails for " + std::to_string(n) + " GPUs");
  for (int32_t r : s.rails()) {
    if (r < -1 || r >= int32_t(m)) return bad("rail " + std::to_string(r) + " names no NIC of " + std::to_string(m));
  }
  return Status::Ok();
}

Result<NodeTopology> from_summary(const v1::GpuTopology& s) {
  GS_RETURN_IF_ERROR(check_summary(s));
  NodeTopology t;
  t.source = s.source();
  t.note = s.note();
  const size_t n = size_t(s.gpus_size()), m = size_t(s.nics_size());
  for (const auto& g : s.gpus()) t.gpus.push_back({g.bus_id(), g.name(), -1});
  for (const auto& nic : s.nics()) t.nics.push_back({nic.name(), "", double(nic.gbits())});
  t.links.assign(n, std::vector<GpuLink>(n));
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = 0; b < n; ++b) {
      const std::string& label = s.links(int(a * n + b));
      GpuLink& l = t.links[a][b];
      if (label == "X") {
        l.kind = GpuLinkKind::kSelf;
      } else if (label.rfind("NV", 0) == 0) {
        l.kind = s.nvswitch() ? GpuLinkKind::kNvSwitch : GpuLinkKind::kNvLink;
        l.nvlinks = label == "NV?" ? 0 : std::stoi(label.substr(2));  // digits: check_summary
        l.gbps = s.link_gbps(int(a * n + b));
      } else {
        l.pcie = parse_distance(label);  // nullopt for "?"
      }
    }
  }
  t.nic_distance.assign(n, std::vector<std::optional<PciDistance>>(m));
  for (size_t g = 0; g < n; ++g) {
    for (size_t j = 0; j < m; ++j) t.nic_distance[g][j] = parse_distance(s.nic_distance(int(g * m + j)));
  }
  t.rails.assign(s.rails().begin(), s.rails().end());
  return t;
}

std::string render_summary(const v1::GpuTopology& s, const std::string& indent) {
  std::ostringstream o;
  const size_t n = size_t(s.gpus_size()), m = size_t(s.nics_size());
  o << indent << "GPUs (" << (s.source().empty() ? "not reported" : s.source()) << "): " << n;
  if (s.nvswitch()) o << ", joined through NVSwitch";
  if (!s.note().empty()) o << " [" << s.note() << "]";
  o << "\n";
  if (n == 0) return o.str();
  for (size_t g = 0; g < n; ++g) {
    o << indent << "  GPU" << g << " " << s.gpus(int(g)).bus_id() << " " << s.gpus(int(g)).name() << "\n";
  }
  for (size_t j = 0; j < m; ++j) {
    o << indent << "  NIC" << j << " " << s.nics(int(j)).name();
    if (s.nics(int(j)).gbits() > 0) o << " " << s.nics(int(j)).gbits() << " Gb/s";
    o << "\n";
  }
  // The matrix: GPU columns, then NIC columns, then the rail, as nvidia-smi topo -m lays it out.
  size_t width = 6;
  for (const auto& nic : s.nics()) width = std::max(width, nic.name().size() + 1);
  const auto cell = [&](const std::string& text) { o << std::left << std::setw(int(width)) << text; };
  o << indent << "  ";
  cell("");
  for (size_t g = 0; g < n; ++g) cell("GPU" + std::to_string(g));
  for (const auto& nic : s.nics()) cell(nic.name());
  o << "rail\n";
  for (size_t a = 0; a < n; ++a) {
    o << indent << "  ";
    cell("GPU" + std::to_string(a));
    for (size_t b = 0; b < n; ++b) cell(s.links(int(a * n + b)));
    for (size_t j = 0; j < m; ++j) cell(s.nic_distance(int(a * m + j)));
    const int rail = s.rails(int(a));
    o << (rail >= 0 ? s.nics(rail).name() : "-") << "\n";
  }
  // Bandwidths of the NVLink pairs, once per distinct figure: "NV18 = 450 GB/s per direction".
  std::set<std::pair<std::string, uint32_t>> seen;
  for (size_t i = 0; i < n * n; ++i) {
    if (s.link_gbps(int(i)) > 0) seen.insert({s.links(int(i)), s.link_gbps(int(i))});
  }
  for (const auto& [label, gbps] : seen) o << indent << "  " << label << " = " << gbps << " GB/s per direction\n";
  return o.str();
}

}  // namespace gradsync::topology
