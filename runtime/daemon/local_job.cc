#include "daemon/local_job.h"

#include <algorithm>

namespace gradsync {

int LocalJob::local_index(uint32_t rank) const {
  auto it = std::find(local_ranks.begin(), local_ranks.end(), rank);
  return it == local_ranks.end() ? -1 : static_cast<int>(it - local_ranks.begin());
}

v1::ChannelSetup LocalJob::setup_for(uint32_t rank) const {
  // Channels 0..L-1: incoming channel of local rank i (written by its ring predecessor, or by
  // the proxy when that predecessor is on another node). Channels L..2L-1: outgoing staging
  // channel of local rank i, drained by the proxy when its successor is remote.
  const uint32_t L = static_cast<uint32_t>(local_ranks.size());
  const auto& ring = table.ring();
  const int n = ring.size();
  int pos = 0;
  for (int i = 0; i < n; ++i) {
    if (ring[i] == rank) pos = i;
  }
  uint32_t next = ring[(pos + 1) % n];
  int me = local_index(rank);
  int next_local = local_index(next);
  v1::ChannelSetup s;
  s.set_shm_bytes(layout.total_bytes());
  s.set_slots(layout.slots);
  s.set_slot_bytes(layout.slot_bytes);
  s.set_num_channels(layout.num_channels);
  s.set_recv_channel(static_cast<uint32_t>(me));
  if (next_local >= 0) {
    s.set_send_channel(static_cast<uint32_t>(next_local));
    s.set_send_is_remote(false);
  } else {
    s.set_send_channel(L + static_cast<uint32_t>(me));
    s.set_send_is_remote(true);
  }
  return s;
}

std::string LocalJob::host_of(uint32_t rank) const {
  if (rank < static_cast<uint32_t>(table.peers_size())) return table.peers(rank).hostname();
  return "?";
}

std::string LocalJob::peer_name(uint32_t rank) const {
  std::string ep;
  if (rank < static_cast<uint32_t>(table.peers_size())) ep = table.peers(rank).endpoint();
  return "rank " + std::to_string(rank) + " (host " + host_of(rank) + ", gradsyncd " + ep + ")";
}

bool LocalJob::all_left() const {
  return std::all_of(members.begin(), members.end(), [](auto& m) { return m.second.left; });
}

bool LocalJob::all_disconnected() const {
  return std::all_of(members.begin(), members.end(), [](auto& m) { return !m.second.connected; });
}

}  // namespace gradsync
