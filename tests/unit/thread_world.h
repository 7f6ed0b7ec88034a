// Ranks as threads over real shared-memory channels in one process, laid out exactly as the
// daemon lays them out for one node (LocalJob::plan_channels), so collectives run through the
// production channel and algorithm code without processes or sockets.
#pragma once

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "channel/shared_memory.h"
#include "client/links.h"
#include "daemon/local_job.h"

namespace gradsync::testing {

// Runs fn(rank) on one thread per rank; returns their statuses.
inline std::vector<Status> run_on_threads(int n, const std::function<Status(int)>& fn) {
  std::vector<Status> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { out[r] = fn(r); });
  for (auto& t : threads) t.join();
  return out;
}

// One collective on every rank of a world of threads: calls[r] on links(r), whose job control
// block (abort flag) is at control(r); the calls get sequence number *seq, which advances.
template <typename Links, typename Control>
std::vector<Status> collective_on_threads(std::vector<CollectiveCall> calls, uint32_t* seq,
                                          std::chrono::milliseconds timeout, Links links, Control control) {
  for (auto& c : calls) c.seq = *seq;
  ++*seq;
  return run_on_threads(int(calls.size()), [&](int r) {
    WaitContext wait;
    wait.control = static_cast<const JobControl*>(control(r));
    wait.deadline = deadline_after(timeout);
    return run_collective(links(r), wait, calls[r]);
  });
}

class ThreadWorld {
 public:
  ThreadWorld(int n, uint32_t rings, uint32_t slots = 4, uint32_t slot_bytes = 4096) : n_(n) {
    job_.id = "threads";
    job_.rings = rings;
    std::vector<std::string> hosts;
    for (int r = 0; r < n; ++r) {
      // A ring order other than 0..n-1 (1, 2, ..., n-1, 0), as the coordinator may hand out:
      // positions and ranks differ, which the block-placing collectives must respect.
      job_.ring.push_back(uint32_t((r + 1) % n));
      job_.local_ranks.push_back(uint32_t(r));
      hosts.push_back("localhost");
    }
    ring_ = job_.ring;
    job_.plan_channels(slots, slot_bytes);
    auto shm = SharedMemory::create("thread-world", job_.layout.total_bytes());
    if (!shm.ok()) throw std::runtime_error(shm.status().to_string());
    shm_ = std::make_shared<SharedMemory>(std::move(shm).value());
    init_job_control(shm_->data(), job_.layout);
    for (int r = 0; r < n; ++r) {
      // The daemon's setup (protobuf) as the library reads it off the socket (nanopb).
      auto setup = wire::decode_channel_setup(job_.setup_for(uint32_t(r)).SerializeAsString());
      if (!setup.ok()) throw std::runtime_error(setup.status().to_string());
      auto l = build_links("threads", r, ring_, hosts, *setup, shm_->data(), job_.layout);
      if (!l.ok()) throw std::runtime_error(l.status().to_string());
      links_.push_back(std::move(l).value());
    }
  }

  int size() const { return n_; }
  const RankLinks& links(int r) const { return links_[r]; }
  const std::vector<uint32_t>& ring() const { return ring_; }
  void* base() const { return shm_->data(); }
  const ShmLayout& layout() const { return job_.layout; }

  // Runs fn(rank) on one thread per rank; returns their statuses.
  std::vector<Status> run(const std::function<Status(int)>& fn) { return run_on_threads(n_, fn); }

  // One collective on every rank; calls[r] is rank r's call (seq filled in here).
  std::vector<Status> collective(std::vector<CollectiveCall> calls,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    return collective_on_threads(
        std::move(calls), &seq_, timeout, [&](int r) -> const RankLinks& { return links_[r]; },
        [&](int) { return shm_->data(); });
  }

 private:
  int n_;
  LocalJob job_;
  std::vector<uint32_t> ring_;
  std::shared_ptr<SharedMemory> shm_;
  std::vector<RankLinks> links_;
  uint32_t seq_ = 0;
};

}  // namespace gradsync::testing
