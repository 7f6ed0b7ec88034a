// gradsyncctl top: jobs, their ranks, rates and data paths, refreshed live.
//
// Each refresh lists the jobs (ListJobs) and gathers the ranks of the running ones through
// TraceJob with `quiet` (the daemons write no dump) and one record per rank: each rank's
// totals of completed collectives and bytes (its /metrics counters), its path and its last
// collective. Rates are the differences between two gatherings over their wall-clock gap.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "coordinator.grpc.pb.h"

namespace gradsync::top {

// One rank in one gathering.
struct RankSample {
  uint32_t rank = 0;
  std::string host, path, last;
  uint64_t calls = 0, bytes = 0;
  int64_t read_ns = 0;
};

// What one refresh shows: `before` and `after` are the two gatherings of one job.
std::string render_job(const v1::JobSummary& job, const std::vector<RankSample>& before,
                       const std::vector<RankSample>& after);

// args: what follows "top" ("--once", "--interval-ms N", "JOB"). Returns the exit status.
int run(v1::Coordinator::Stub& stub, const std::vector<std::string>& args, FILE* out, FILE* err);

}  // namespace gradsync::top
