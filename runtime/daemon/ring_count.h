// How many parallel rings a node's jobs get: the value given (--rings, GRADSYNC_NRINGS), checked
// against the limit of the tag space, or a default chosen from the node's cores and the shared
// memory each ring costs; and, at join, the count a job uses when its nodes chose differently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/status.h"

namespace gradsync {

// Shared memory of a node's ring channels per local rank, at most: each ring gives a rank an
// incoming and (across nodes) a staging channel of slots x slot_bytes, 16 MiB with the default
// 8 slots of 1 MiB, so 128 MiB allows 8 default rings. A default never exceeds it; an explicit
// --rings may (the operator asked for it, and the log says what it costs).
constexpr uint64_t kRingMemoryBudgetBytes = uint64_t(128) << 20;

// Cores one ring needs to pay off: a ring's copies, reductions and socket moves run on a thread
// of each rank, and the node's other ranks, the daemon and the kernel's TCP work need the rest.
// Measured on the 16-core H200 host, 2 nodes x 1 rank over TCP (docs/benchmarks.md): 1 ring
// 1.29-1.55x NCCL over sockets, 8 rings 3.4-4.0x from 16 MiB.
constexpr unsigned kCoresPerRing = 2;

struct RingCount {
  uint32_t rings = 1;
  bool chosen = false;  // true: the default (no --rings / GRADSYNC_NRINGS); false: given
  std::string why;      // logged at start: "8 rings: 16 cpus / 2 per ring, ..."
};

// The bytes of ring channels one rank holds with `rings` rings: 2 x rings x slots x slot_bytes.
uint64_t ring_memory_per_rank(uint32_t rings, uint32_t slots, uint32_t slot_bytes);

// A ring count given as text by `what` ("--rings", "GRADSYNC_NRINGS"): a whole number in
// [1, kMaxRings]; anything else is kInvalidArgument naming the value and the limit.
Result<uint32_t> parse_ring_count(std::string_view text, std::string_view what);

// The default: cores / kCoresPerRing, at least 1, at most kMaxRings and what
// kRingMemoryBudgetBytes allows at this slot geometry. A 2-core machine gets 1 ring.
RingCount default_ring_count(unsigned cores, uint32_t slots, uint32_t slot_bytes);

// A job's ring count is agreed by the coordinator from every node's offer (rings,
// rings_chosen in v1::ChannelOffer): a count given to a node wins, else the smallest choice.

}  // namespace gradsync
