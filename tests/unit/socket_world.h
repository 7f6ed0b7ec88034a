// Ranks as threads where every rank is its own node: each rank gets the region gradsyncd lays
// out for a node with one rank (LocalJob::plan_channels), and every channel between two ranks a
// loopback TCP connection, handed to both ends as gradsyncd hands them (take_rank_sockets,
// build_links). So the collectives run through the rank-owned socket path
// (transport/tcp/socket_driver.h) with no daemon. Same interface as ThreadWorld for
// collective_matrix.h.
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "channel/shared_memory.h"
#include "client/links.h"
#include "daemon/local_job.h"
#include "thread_world.h"

namespace gradsync::testing {

// A connected loopback TCP pair. `buffer_bytes` > 0 shrinks both kernel buffers, so that sends
// and receives stop part-way through a slot.
inline std::pair<Fd, Fd> tcp_pair(int buffer_bytes = 0) {
  Fd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(listener.get(), 1) != 0 ||
      ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    throw std::runtime_error(errno_string("listen"));
  }
  Fd client(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  auto tune = [&](int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (buffer_bytes > 0) {
      setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
      setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
    }
  };
  tune(client.get());
  if (::connect(client.get(), reinterpret_cast<sockaddr*>(&a), len) != 0) throw std::runtime_error(errno_string("connect"));
  Fd server(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  if (!server.valid()) throw std::runtime_error(errno_string("accept"));
  tune(server.get());
  return {std::move(client), std::move(server)};
}

class SocketWorld {
 public:
  SocketWorld(int n, uint32_t rings, uint32_t slots = 4, uint32_t slot_bytes = 4096, int buffer_bytes = 0)
      : n_(n) {
    std::vector<uint32_t> ring;
    std::vector<std::string> hosts;
    for (int r = 0; r < n; ++r) {
      ring.push_back(uint32_t((r + 1) % n));  // positions differ from ranks, as in ThreadWorld
      hosts.push_back("node" + std::to_string(r));
    }
    for (int r = 0; r < n; ++r) {
      auto job = std::make_unique<LocalJob>();
      job->id = "sockets";
      job->rings = rings;
      job->ring = ring;
      job->local_ranks = {uint32_t(r)};
      job->plan_channels(slots, slot_bytes);
      auto shm = SharedMemory::create("socket-world", job->layout.total_bytes());
      if (!shm.ok()) throw std::runtime_error(shm.status().to_string());
      shms_.push_back(std::make_shared<SharedMemory>(std::move(shm).value()));
      init_job_control(shms_.back()->data(), job->layout);
      jobs_.push_back(std::move(job));
    }
    // One connection per channel: the sender's staging channel to the receiver's incoming one.
    for (const Edge& e : channel_edges(ring, rings)) {
      LocalJob::EdgeKey key{e.tag, e.src, e.dst};
      auto [to, from] = tcp_pair(buffer_bytes);
      jobs_[e.src]->rank_sockets[jobs_[e.src]->staging.at(key)] = std::move(to);
      jobs_[e.dst]->rank_sockets[jobs_[e.dst]->incoming.at(key)] = std::move(from);
    }
    for (int r = 0; r < n; ++r) {
      v1::ChannelSetup setup = jobs_[r]->setup_for(uint32_t(r));
      std::vector<Fd> socks = jobs_[r]->take_rank_sockets(&setup);
      // The daemon's setup (protobuf) as the library reads it off the socket (nanopb).
      auto read = wire::decode_channel_setup(setup.SerializeAsString());
      if (!read.ok()) throw std::runtime_error(read.status().to_string());
      auto l = build_links("sockets", r, ring, hosts, *read, shms_[r]->data(), jobs_[r]->layout, std::move(socks));
      if (!l.ok()) throw std::runtime_error(l.status().to_string());
      links_.push_back(std::move(l).value());
    }
  }

  int size() const { return n_; }
  const RankLinks& links(int r) const { return links_[r]; }
  void* base(int r) const { return shms_[r]->data(); }
  const ShmLayout& layout(int r) const { return jobs_[r]->layout; }
  // Rank r drives a large call's rings on `t` threads (0: the default).
  void set_ring_threads(int r, uint32_t t) { links_[r].ring_threads = t; }
  // Closes rank r's sockets (its process died): its links must not be used afterwards.
  void kill_rank(int r) { links_[r].driver.reset(); }

  std::vector<Status> run(const std::function<Status(int)>& fn) { return run_on_threads(n_, fn); }

  std::vector<Status> collective(std::vector<CollectiveCall> calls,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    return collective_on_threads(
        std::move(calls), &seq_, timeout, [&](int r) -> const RankLinks& { return links_[r]; },
        [&](int r) { return shms_[r]->data(); });
  }

 private:
  int n_;
  std::vector<std::unique_ptr<LocalJob>> jobs_;
  std::vector<std::shared_ptr<SharedMemory>> shms_;
  std::vector<RankLinks> links_;
  uint32_t seq_ = 0;
};

}  // namespace gradsync::testing
