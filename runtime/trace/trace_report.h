// What a person needs from a job's flight recorders (gradsyncctl trace, the daemons' dump
// files): which ranks are behind, the collective they never entered, who waits for them,
// and each rank's last collectives. Pure functions over the RankTrace messages the daemons
// send; the coordinator only carries them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "coordinator.pb.h"

namespace gradsync::trace {

struct Diagnosis {
  std::vector<uint32_t> behind;     // ranks whose last collective is before the others'
  int64_t never_entered = -1;       // the first collective some rank never entered, -1 none
  std::vector<uint32_t> waiting;    // ranks inside `never_entered` (queued or started)
  std::vector<uint32_t> unknown;    // ranks of the world with no recorder read
  std::vector<std::string> lines;   // the summary, one finding a line
};

// `ranks`: what was read (any order, at most one per rank). `world_size`: the job's.
Diagnosis diagnose(const std::vector<v1::RankTrace>& ranks, uint32_t world_size);

// "rank 0 (host h, node n, pid p): 59 collectives recorded" and the last `last_n` records.
std::string render_rank(const v1::RankTrace& rank, size_t last_n);
// One record: "#58 allreduce count=1024 float32 sum ring shm: started 3.2 s ago, waiting for rank 3".
std::string render_record(const v1::TraceRecord& r, int64_t now_ns);

// The summary, then every rank's last `last_n` records, by rank.
std::string render(const std::vector<v1::RankTrace>& ranks, uint32_t world_size, size_t last_n);

// "0, 1, 3"
std::string join_ranks(const std::vector<uint32_t>& ranks);

}  // namespace gradsync::trace
