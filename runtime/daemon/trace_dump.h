// gradsyncd's side of the flight recorders: reading the local ranks' recorders out of a job's
// shared memory (validated: trainers write it) and writing them to the log directory, on a
// failure, a timeout a trainer reports, and on demand (gradsyncctl trace).
#pragma once

#include <string>
#include <vector>

#include "coordinator.pb.h"
#include "daemon/local_job.h"

namespace gradsync {

// The recorders of `job`'s local ranks, the last `max_records` of each. Call with the daemon's
// mutex held (reads the job's members and layout).
std::vector<v1::RankTrace> read_local_traces(const LocalJob& job, const std::string& host, const std::string& node_id,
                                             uint32_t max_records);

// Writes `traces` (rendered, as gradsyncctl trace prints them) to
// DIR/trace-JOB-genG-NODE-WHEN.txt and returns the path.
Result<std::string> dump_traces(const std::string& dir, const LocalJob& job, const std::string& node_id,
                                const std::vector<v1::RankTrace>& traces, const std::string& why);

}  // namespace gradsync
