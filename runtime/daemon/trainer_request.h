// What gradsyncd accepts from a process on its trainer socket, before anything is allocated
// or shared for it: the size of a request frame, and the fields of a join. Pure functions, so
// that the fuzz targets (fuzz/) exercise exactly what the daemon runs.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "common/fd.h"
#include "daemon.pb.h"

namespace gradsync {

// The largest request a trainer may send (a join with its token, an abort with its reason):
// what one connection can make the daemon allocate.
constexpr uint32_t kMaxRequestBytes = 64 << 10;

// Reads one request frame of at most kMaxRequestBytes.
Status read_trainer_request(int sock, v1::ClientMessage* msg, Deadline deadline);

// Checks a join's job id, sizes, ranks and token against the limits (common/limits.h).
// `pid` and `host` name the caller in the error.
Status check_join_request(const v1::JoinRequest& req, uint32_t pid, const std::string& host);

// Checks an elastic regroup (gradsync/elastic.h) the same way: job id, token, sizes, waits.
Status check_regroup_request(const v1::RegroupRequest& req, uint32_t pid, const std::string& host);

}  // namespace gradsync
