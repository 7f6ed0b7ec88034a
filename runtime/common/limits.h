// Bounds on what a trainer or a peer may ask of a daemon or the coordinator: every size and
// name that crosses a trust boundary is checked against these before anything is allocated.
#pragma once

#include <cstdint>
#include <string>

#include "gradsync/status.h"

namespace gradsync {

// Ranks in one job. Larger worlds are almost certainly a corrupted or hostile request: the
// coordinator keeps a peer entry per rank, each daemon a vector per rank.
constexpr uint32_t kMaxWorldSize = 1u << 20;
// Ranks of one job on one node: each is a connection, a thread and channels in one region.
constexpr uint32_t kMaxLocalWorldSize = 1024;
// Job ids: 1..128 characters of [A-Za-z0-9._:@+-] (they name memfds and go into logs).
constexpr size_t kMaxJobIdBytes = 128;
// Job tokens: at most this many bytes (random ones are 32 hex digits).
constexpr size_t kMaxTokenBytes = 1024;

// kInvalidArgument naming the offending character or length, else Ok.
Status check_job_id(const std::string& id);

}  // namespace gradsync
