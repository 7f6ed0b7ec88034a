#include "client/links.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "collectives/topology.h"
#include "transport/tcp/socket_driver.h"

namespace gradsync {

Result<RankLinks> build_links(const std::string& job, int rank, const std::vector<uint32_t>& ring,
                              const std::vector<std::string>& hosts, const wire::ChannelSetup& setup,
                              void* base, const ShmLayout& layout, std::vector<Fd> sockets) {
  RankLinks l;
  l.job = job;
  l.rank = rank;
  l.world_size = static_cast<int>(ring.size());
  l.ring = ring;
  l.hosts = hosts;
  l.rings = std::max<uint32_t>(1, setup.rings);
  if (l.rings > kMaxRings) {  // ring tags above the limit would name the trees' channels
    return Status(Code::kInternal, "gradsyncd gave job=" + job + " " + std::to_string(l.rings) +
                                       " rings, above the limit of " + std::to_string(kMaxRings));
  }
  auto it = std::find(ring.begin(), ring.end(), uint32_t(rank));
  if (it == ring.end()) return Status(Code::kInternal, "rank missing from the ring order");
  l.position = static_cast<int>(it - ring.begin());
  if (l.world_size == 1) return l;

  // (tag, peer, send) -> channel index, as the daemon laid them out.
  std::map<std::tuple<uint32_t, uint32_t, bool>, uint32_t> index;
  std::set<uint32_t> driven;  // channel indexes moved on a socket this rank owns
  std::shared_ptr<SocketDriver> driver;
  for (const auto& ref : setup.channels) {
    if (ref.index >= layout.num_channels) return Status(Code::kInternal, "channel index out of range");
    index[{ref.tag, ref.peer, ref.send}] = ref.index;
    if (ref.socket == 0) continue;
    if (ref.socket > sockets.size() || !sockets[ref.socket - 1].valid()) {
      return Status(Code::kInternal, "gradsyncd named socket " + std::to_string(ref.socket) + " for rank " +
                                         std::to_string(rank) + "'s channel to rank " + std::to_string(ref.peer) +
                                         " but passed " + std::to_string(sockets.size()));
    }
    if (!driver) driver = std::make_shared<SocketDriver>("job=" + job + " " + l.name(rank));
    Channel ch(base, layout, ref.index);
    Fd sock = std::move(sockets[ref.socket - 1]);
    if (ref.send) driver->add_sender(ch, std::move(sock), l.name(int(ref.peer)), int(ref.peer));
    else driver->add_receiver(ch, std::move(sock), l.name(int(ref.peer)), int(ref.peer));
    driven.insert(ref.index);
  }
  auto find = [&](uint32_t tag, int peer, bool send, Channel* out) -> Status {
    auto f = index.find({tag, uint32_t(peer), send});
    if (f == index.end()) {
      return {Code::kInternal, "gradsyncd gave rank " + std::to_string(rank) + " no " +
                                   (send ? "send" : "receive") + " channel tag " + std::to_string(tag) +
                                   " for peer " + std::to_string(peer) + " (daemon of another version?)"};
    }
    *out = Channel(base, layout, f->second);
    out->set_peer(peer);
    return Status::Ok();
  };
  l.ring_send.resize(l.rings);
  l.ring_recv.resize(l.rings);
  for (uint32_t r = 0; r < l.rings; ++r) {
    GS_RETURN_IF_ERROR(find(ring_tag(r), l.next_rank(), true, &l.ring_send[r]));
    GS_RETURN_IF_ERROR(find(ring_tag(r), l.prev_rank(), false, &l.ring_recv[r]));
  }
  for (uint32_t t = 0; t < kNumTrees; ++t) {
    TreeLinks tl = tree_links(ring, uint32_t(rank), t);
    l.trees[t] = tl;
    if (tl.parent >= 0) {
      GS_RETURN_IF_ERROR(find(tree_up_tag(t), tl.parent, true, &l.up_send[t]));
      GS_RETURN_IF_ERROR(find(tree_down_tag(t), tl.parent, false, &l.down_recv[t]));
    }
    for (int c = 0; c < 2; ++c) {
      if (tl.children[c] < 0) continue;
      GS_RETURN_IF_ERROR(find(tree_up_tag(t), tl.children[c], false, &l.up_recv[t][c]));
      GS_RETURN_IF_ERROR(find(tree_down_tag(t), tl.children[c], true, &l.down_send[t][c]));
    }
  }
  if (driver) {
    l.driver = driver;
    auto attach = [&](Channel& ch) {
      if (ch.slots() != 0) ch.set_driver(driver.get(), driven.count(ch.index()) != 0);
    };
    for (auto& ch : l.ring_send) attach(ch);
    for (auto& ch : l.ring_recv) attach(ch);
    for (uint32_t t = 0; t < kNumTrees; ++t) {
      attach(l.up_send[t]);
      attach(l.down_recv[t]);
      for (int c = 0; c < 2; ++c) {
        attach(l.up_recv[t][c]);
        attach(l.down_send[t][c]);
      }
    }
  }
  return l;
}

void mark_left(const RankLinks& l) {
  auto mark = [](Channel ch, bool producer) {
    if (ch.slots() != 0 && !ch.driven()) ch.mark_left(producer);
  };
  for (const Channel& ch : l.ring_send) mark(ch, true);
  for (const Channel& ch : l.ring_recv) mark(ch, false);
  for (uint32_t t = 0; t < kNumTrees; ++t) {
    mark(l.up_send[t], true);
    mark(l.down_recv[t], false);
    for (int c = 0; c < 2; ++c) {
      mark(l.up_recv[t][c], false);
      mark(l.down_send[t][c], true);
    }
  }
}

}  // namespace gradsync
