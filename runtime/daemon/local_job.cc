#include "daemon/local_job.h"

#include <algorithm>

namespace gradsync {

bool LocalJob::is_local(uint32_t rank) const {
  return std::binary_search(local_ranks.begin(), local_ranks.end(), rank);
}

void LocalJob::plan_channels(uint32_t slots, uint32_t slot_bytes, uint32_t recorder_entries) {
  std::vector<size_t> positions;
  for (size_t p = 0; p < ring.size(); ++p) {
    if (is_local(ring[p])) positions.push_back(p);
  }
  uint32_t next = 0;
  incoming.clear();
  staging.clear();
  for (const Edge& e : channel_edges_at(ring, positions, rings)) {
    EdgeKey key{e.tag, e.src, e.dst};
    if (is_local(e.dst)) incoming[key] = next++;
    else if (is_local(e.src)) staging[key] = next++;
  }
  layout.num_channels = next;
  layout.slots = slots;
  layout.slot_bytes = slot_bytes;
  layout.recorders = recorder_entries == 0 ? 0 : uint32_t(local_ranks.size());
  layout.recorder_entries = layout.recorders == 0 ? 0 : recorder_entries;
}

void LocalJob::init_recorders() const {
  for (uint32_t i = 0; i < layout.recorders; ++i) {
    init_recorder(static_cast<char*>(shm->data()) + layout.recorder_offset(i), layout.recorder_entries, local_ranks[i]);
  }
}

v1::ChannelSetup LocalJob::setup_for(uint32_t rank) const {
  v1::ChannelSetup s;
  s.set_shm_bytes(layout.total_bytes());
  s.set_slots(layout.slots);
  s.set_slot_bytes(layout.slot_bytes);
  s.set_num_channels(layout.num_channels);
  s.set_rings(rings);
  if (layout.recorders != 0) {
    auto it = std::lower_bound(local_ranks.begin(), local_ranks.end(), rank);
    s.set_recorders(layout.recorders);
    s.set_recorder_entries(layout.recorder_entries);
    s.set_recorder_index(uint32_t(it - local_ranks.begin()));
  }
  // A local destination owns the channel; the sender writes straight into it. A remote one
  // is reached through this node's staging channel and the proxy.
  auto add = [&](const std::map<EdgeKey, uint32_t>& from, bool remote) {
    for (const auto& [key, index] : from) {
      auto [tag, src, dst] = key;
      if (src != rank && dst != rank) continue;
      auto* ref = s.add_channels();
      ref->set_tag(tag);
      ref->set_send(src == rank);
      ref->set_peer(src == rank ? dst : src);
      ref->set_index(index);
      ref->set_remote(remote);
    }
  };
  add(incoming, false);
  add(staging, true);
  return s;
}

std::vector<Fd> LocalJob::take_rank_sockets(v1::ChannelSetup* setup) {
  std::vector<Fd> out;
  for (auto& ref : *setup->mutable_channels()) {
    auto it = rank_sockets.find(ref.index());
    if (it == rank_sockets.end()) continue;
    out.push_back(std::move(it->second));
    rank_sockets.erase(it);
    ref.set_socket(uint32_t(out.size()));
  }
  return out;
}

std::string LocalJob::host_of(uint32_t rank) const {
  auto it = hosts.find(rank);
  return it == hosts.end() ? "?" : it->second;
}

std::string LocalJob::peer_name(uint32_t rank) const {
  std::string ep = rank < endpoints.size() ? endpoints[rank].proxy() : "?";
  return "rank " + std::to_string(rank) + " (host " + host_of(rank) + ", gradsyncd " + ep + ")";
}

std::string LocalJob::member_name(uint32_t rank, const std::string& host) const {
  auto it = members.find(rank);
  std::string pid = it == members.end() ? "?" : std::to_string(it->second.pid);
  return "rank " + std::to_string(rank) + " (pid " + pid + ", host " + host + ")";
}

bool LocalJob::all_left() const {
  return std::all_of(members.begin(), members.end(), [](auto& m) { return m.second.left; });
}

std::string LocalJob::missing_local_ranks() const {
  if (members.empty()) return "";
  int64_t base = int64_t(members.begin()->second.rank) - members.begin()->second.local_rank;
  for (const auto& [r, m] : members) {
    if (int64_t(r) - m.local_rank != base) return "";  // not contiguous: cannot tell
  }
  std::string out;
  for (uint32_t i = 0; i < local_world_size; ++i) {
    int64_t r = base + i;
    if (r < 0 || members.count(uint32_t(r))) continue;
    out += (out.empty() ? "" : ",") + std::to_string(r);
  }
  return out;
}

bool LocalJob::all_disconnected() const {
  return std::all_of(members.begin(), members.end(), [](auto& m) { return !m.second.connected; });
}

}  // namespace gradsync
