#include "topology/topo_file.h"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace gradsync::topology {
namespace {

constexpr int kMaxLinksPerPair = 64;   // NVLinks of one GPU pair or one GPU to its switches
constexpr int kMaxGBpsPerLink = 1000;  // GB/s per link and direction; 50 today (NVLink 5)
constexpr int kMaxNicGbits = 100000;   // Gb/s; 400 or 800 today
constexpr int kMaxDevice = 1023;       // CUDA device ordinal

bool is_hex(const std::string& s, size_t from, size_t n) {
  if (from + n > s.size()) return false;
  for (size_t i = from; i < from + n; ++i) {
    if (!std::isxdigit(static_cast<unsigned char>(s[i]))) return false;
  }
  return true;
}

// "0000:19:00.0" (or NVML's "00000000:19:00.0"), any case -> lower case with a 4-digit domain.
std::optional<std::string> bus_id(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s.size() == 16 && s.compare(0, 4, "0000") == 0) s.erase(0, 4);
  if (s.size() != 12 || !is_hex(s, 0, 4) || s[4] != ':' || !is_hex(s, 5, 2) || s[7] != ':' || !is_hex(s, 8, 2) ||
      s[10] != '.' || !is_hex(s, 11, 1)) {
    return std::nullopt;
  }
  return s;
}

class Parser {
 public:
  explicit Parser(std::string name) : name_(std::move(name)) { topo_.source = "file " + name_; }

  Status line(int number, const std::string& raw) {
    number_ = number;
    text_ = raw.substr(0, raw.find('#'));
    std::istringstream in(text_);
    words_.clear();
    for (std::string w; in >> w;) words_.push_back(w);
    while (!text_.empty() && std::isspace(static_cast<unsigned char>(text_.back()))) text_.pop_back();
    while (!text_.empty() && std::isspace(static_cast<unsigned char>(text_.front()))) text_.erase(0, 1);
    if (words_.empty()) return Status::Ok();
    const std::string& k = words_[0];
    if (k == "gpu") return gpu();
    if (k == "nic") return nic();
    if (k == "nvswitch") return nvswitch();
    if (k == "nvlink") return nvlink();
    if (k == "pcie") return pcie();
    if (k == "distance") return distance();
    if (k == "rail") return rail();
    return bad("unknown item '" + k + "' (gpu, nic, nvswitch, nvlink, pcie, distance, rail)");
  }

  Result<NodeTopology> finish() {
    if (topo_.gpus.empty()) return Status(Code::kInvalidArgument, name_ + ": declares no GPU (a 'gpu BUS-ID' line)");
    const size_t n = topo_.gpus.size();
    topo_.links.assign(n, std::vector<GpuLink>(n));
    for (size_t a = 0; a < n; ++a) {
      for (size_t b = 0; b < n; ++b) {
        GpuLink& l = topo_.links[a][b];
        if (a == b) {
          l.kind = GpuLinkKind::kSelf;
          continue;
        }
        l.pcie = PciDistance::SYS;
        if (switch_links_ > 0) {
          l.kind = GpuLinkKind::kNvSwitch;
          l.nvlinks = switch_links_;
          l.gbps = switch_links_ * switch_gbps_;
        }
      }
    }
    for (const auto& [ab, link] : pairs_) {
      for (auto [a, b] : {ab, std::pair{ab.second, ab.first}}) {
        GpuLink& l = topo_.links[a][b];
        if (link.pcie) l.pcie = link.pcie;
        if (link.kind == GpuLinkKind::kNvLink) {
          l.kind = link.kind;
          l.nvlinks = link.nvlinks;
          l.gbps = link.gbps;
        }
      }
    }
    topo_.nic_distance.assign(n, std::vector<std::optional<PciDistance>>(topo_.nics.size(), PciDistance::SYS));
    for (const auto& [gn, d] : distances_) topo_.nic_distance[gn.first][gn.second] = d;
    topo_.rails = assign_rails(topo_.nic_distance, topo_.nics.size());
    for (const auto& [g, nic] : rails_) topo_.rails[g] = nic;
    return std::move(topo_);
  }

 private:
  Status bad(const std::string& why) const {
    return Status(Code::kInvalidArgument,
                  name_ + " line " + std::to_string(number_) + ": '" + text_ + "': " + why);
  }

  Status need_fields(size_t least, const char* form) const {
    if (words_.size() < least) return bad(std::string("too few fields; the form is '") + form + "'");
    return Status::Ok();
  }

  Result<int> number(const std::string& word, const char* what, long lo, long hi) const {
    char* end = nullptr;
    const long v = std::strtol(word.c_str(), &end, 10);
    if (word.empty() || !end || *end != '\0' || !std::isdigit(static_cast<unsigned char>(word[0])) || v < lo || v > hi) {
      return bad(std::string(what) + " '" + word + "' is not a whole number from " + std::to_string(lo) + " to " +
                 std::to_string(hi));
    }
    return int(v);
  }

  Result<size_t> gpu_ref(const std::string& word) const {
    auto v = number(word, "GPU", 0, long(kMaxTopoGpus) - 1);
    if (!v.ok()) return v.status();
    if (size_t(*v) >= topo_.gpus.size()) {
      return bad("GPU " + word + " is not declared (" + std::to_string(topo_.gpus.size()) +
                 " 'gpu' line(s) above this one)");
    }
    return size_t(*v);
  }

  Result<size_t> nic_ref(const std::string& word) const {
    for (size_t i = 0; i < topo_.nics.size(); ++i) {
      if (topo_.nics[i].name == word) return i;
    }
    return bad("NIC '" + word + "' is not declared on a 'nic' line above this one");
  }

  Result<PciDistance> dist(const std::string& word) const {
    auto d = parse_distance(word);
    if (!d || word.size() < 3) return bad("distance '" + word + "' is not one of PIX, PXB, PHB, NODE, SYS");
    return *d;
  }

  // key=value options from words_[from..]; only the keys in `allowed`.
  Result<std::map<std::string, std::string>> options(size_t from, const std::set<std::string>& allowed) const {
    std::map<std::string, std::string> out;
    for (size_t i = from; i < words_.size(); ++i) {
      const size_t eq = words_[i].find('=');
      const std::string key = words_[i].substr(0, eq);
      if (eq == std::string::npos || eq + 1 == words_[i].size()) return bad("'" + words_[i] + "' is not KEY=VALUE");
      if (!allowed.count(key)) {
        std::string keys;
        for (const auto& a : allowed) keys += (keys.empty() ? "" : ", ") + a;
        return bad("unknown option '" + key + "' (this item takes " + (keys.empty() ? "none" : keys) + ")");
      }
      if (out.count(key)) return bad("option '" + key + "' given twice");
      out[key] = words_[i].substr(eq + 1);
    }
    return out;
  }

  Result<double> per_link_gbps(const std::map<std::string, std::string>& opts) const {
    auto it = opts.find("gbps");
    if (it == opts.end()) return kNvLinkGBpsPerLink;
    auto v = number(it->second, "gbps", 1, kMaxGBpsPerLink);
    if (!v.ok()) return v.status();
    return double(*v);
  }

  Status gpu() {
    GS_RETURN_IF_ERROR(need_fields(2, "gpu BUS-ID [device=N] [name=WORD]"));
    if (topo_.gpus.size() >= kMaxTopoGpus) return bad("more than " + std::to_string(kMaxTopoGpus) + " GPUs");
    auto id = bus_id(words_[1]);
    if (!id) return bad("'" + words_[1] + "' is not a PCI bus id like 0000:19:00.0");
    auto opts = options(2, {"device", "name"});
    if (!opts.ok()) return opts.status();
    TopoGpu g{*id, "", -1};
    if (auto it = opts->find("device"); it != opts->end()) {
      auto d = number(it->second, "device", 0, kMaxDevice);
      if (!d.ok()) return d.status();
      g.device = *d;
    }
    if (auto it = opts->find("name"); it != opts->end()) g.name = it->second;
    topo_.gpus.push_back(std::move(g));
    return Status::Ok();
  }

  Status nic() {
    GS_RETURN_IF_ERROR(need_fields(2, "nic NAME [gbits=N] [bus=BUS-ID]"));
    if (topo_.nics.size() >= kMaxTopoNics) return bad("more than " + std::to_string(kMaxTopoNics) + " NICs");
    if (words_[1].find('=') != std::string::npos) return bad("a NIC's name comes first, before any option");
    for (const auto& n : topo_.nics) {
      if (n.name == words_[1]) return bad("NIC '" + words_[1] + "' is declared twice");
    }
    auto opts = options(2, {"bus", "gbits"});
    if (!opts.ok()) return opts.status();
    TopoNic nic{words_[1], "", 0};
    if (auto it = opts->find("bus"); it != opts->end()) {
      auto id = bus_id(it->second);
      if (!id) return bad("'" + it->second + "' is not a PCI bus id like 0000:1a:00.0");
      nic.pci_bus_id = *id;
    }
    if (auto it = opts->find("gbits"); it != opts->end()) {
      auto v = number(it->second, "gbits", 1, kMaxNicGbits);
      if (!v.ok()) return v.status();
      nic.gbits = *v;
    }
    topo_.nics.push_back(std::move(nic));
    return Status::Ok();
  }

  Status nvswitch() {
    GS_RETURN_IF_ERROR(need_fields(2, "nvswitch LINKS [gbps=N]"));
    if (switch_links_ > 0) return bad("a second 'nvswitch' line");
    for (const auto& [ab, link] : pairs_) {
      if (link.kind == GpuLinkKind::kNvLink) return bad("GPUs joined by NVSwitch have no 'nvlink' pairs besides");
    }
    auto links = number(words_[1], "LINKS", 1, kMaxLinksPerPair);
    if (!links.ok()) return links.status();
    auto opts = options(2, {"gbps"});
    if (!opts.ok()) return opts.status();
    auto gbps = per_link_gbps(*opts);
    if (!gbps.ok()) return gbps.status();
    switch_links_ = *links;
    switch_gbps_ = *gbps;
    return Status::Ok();
  }

  Result<std::pair<size_t, size_t>> pair(const char* form) const {
    GS_RETURN_IF_ERROR(need_fields(4, form));
    auto a = gpu_ref(words_[1]);
    if (!a.ok()) return a.status();
    auto b = gpu_ref(words_[2]);
    if (!b.ok()) return b.status();
    if (*a == *b) return bad("a GPU paired with itself");
    return std::pair{std::min(*a, *b), std::max(*a, *b)};
  }

  Status nvlink() {
    auto p = pair("nvlink A B LINKS [gbps=N]");
    if (!p.ok()) return p.status();
    if (switch_links_ > 0) return bad("GPUs joined by NVSwitch have no 'nvlink' pairs besides");
    auto links = number(words_[3], "LINKS", 1, kMaxLinksPerPair);
    if (!links.ok()) return links.status();
    auto opts = options(4, {"gbps"});
    if (!opts.ok()) return opts.status();
    auto gbps = per_link_gbps(*opts);
    if (!gbps.ok()) return gbps.status();
    GpuLink& l = pairs_[*p];
    if (l.kind == GpuLinkKind::kNvLink) return bad("this GPU pair already has an 'nvlink' line");
    l.kind = GpuLinkKind::kNvLink;
    l.nvlinks = *links;
    l.gbps = *links * *gbps;
    return Status::Ok();
  }

  Status pcie() {
    auto p = pair("pcie A B PIX|PXB|PHB|NODE|SYS");
    if (!p.ok()) return p.status();
    if (words_.size() > 4) return bad("one distance after the two GPUs, nothing more");
    auto d = dist(words_[3]);
    if (!d.ok()) return d.status();
    GpuLink& l = pairs_[*p];
    if (l.pcie) return bad("this GPU pair already has a 'pcie' line");
    l.pcie = *d;
    return Status::Ok();
  }

  Status distance() {
    GS_RETURN_IF_ERROR(need_fields(4, "distance GPU NIC PIX|PXB|PHB|NODE|SYS"));
    if (words_.size() > 4) return bad("one distance after the GPU and the NIC, nothing more");
    auto g = gpu_ref(words_[1]);
    if (!g.ok()) return g.status();
    auto n = nic_ref(words_[2]);
    if (!n.ok()) return n.status();
    auto d = dist(words_[3]);
    if (!d.ok()) return d.status();
    if (!distances_.emplace(std::pair{*g, *n}, *d).second) return bad("this GPU and NIC already have a distance");
    return Status::Ok();
  }

  Status rail() {
    GS_RETURN_IF_ERROR(need_fields(3, "rail GPU NIC|none"));
    if (words_.size() > 3) return bad("a GPU and a NIC, nothing more");
    auto g = gpu_ref(words_[1]);
    if (!g.ok()) return g.status();
    int nic = -1;  // "none": the GPU has no NIC of its own
    if (words_[2] != "none") {
      auto n = nic_ref(words_[2]);
      if (!n.ok()) return n.status();
      nic = int(*n);
    }
    if (!rails_.emplace(*g, nic).second) return bad("GPU " + words_[1] + " already has a rail");
    return Status::Ok();
  }

  std::string name_;
  NodeTopology topo_;
  int number_ = 0;
  std::string text_;
  std::vector<std::string> words_;
  int switch_links_ = 0;
  double switch_gbps_ = kNvLinkGBpsPerLink;
  // Declared pairs (a < b): kind kNvLink from 'nvlink', pcie from 'pcie'; kPcie + no pcie unused.
  std::map<std::pair<size_t, size_t>, GpuLink> pairs_;
  std::map<std::pair<size_t, size_t>, PciDistance> distances_;
  std::map<size_t, int> rails_;  // GPU -> NIC, -1 none
};

}  // namespace

Result<NodeTopology> parse_topo_text(const std::string& text, const std::string& name) {
  Parser p(name);
  std::istringstream in(text);
  int number = 0;
  for (std::string line; std::getline(in, line);) GS_RETURN_IF_ERROR(p.line(++number, line));
  return p.finish();
}

Result<NodeTopology> parse_topo_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status(Code::kInvalidArgument, "topology file " + path + " (GRADSYNC_TOPO_FILE) cannot be read");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_topo_text(text.str(), path);
}

}  // namespace gradsync::topology
