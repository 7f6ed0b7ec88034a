#include "daemon/ring_count.h"

#include <algorithm>
#include <cctype>

#include "collectives/topology.h"

namespace gradsync {

uint64_t ring_memory_per_rank(uint32_t rings, uint32_t slots, uint32_t slot_bytes) {
  return 2 * uint64_t(rings) * slots * slot_bytes;
}

Result<uint32_t> parse_ring_count(std::string_view text, std::string_view what) {
  const auto bad = [&](const std::string& why) {
    return Status(Code::kInvalidArgument,
                  std::string(what) + "='" + std::string(text) + "' " + why + ": give a whole number from 1 to " +
                      std::to_string(kMaxRings) + " (the ring tags of a channel are 0.." +
                      std::to_string(kMaxRings - 1) + ")");
  };
  if (text.empty() || text.size() > 9) return bad(text.empty() ? "is empty" : "is not a ring count");
  uint32_t value = 0;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return bad("is not a ring count");
    value = value * 10 + uint32_t(c - '0');
  }
  if (value < 1) return bad("is below 1");
  if (value > kMaxRings) return bad("is above the limit of " + std::to_string(kMaxRings) + " rings");
  return value;
}

RingCount default_ring_count(unsigned cores, uint32_t slots, uint32_t slot_bytes) {
  RingCount rc;
  rc.chosen = true;
  const uint32_t by_cores = std::max(1u, cores / kCoresPerRing);
  const uint64_t per_ring = ring_memory_per_rank(1, slots, slot_bytes);
  const uint32_t by_memory =
      uint32_t(std::clamp<uint64_t>(per_ring ? kRingMemoryBudgetBytes / per_ring : kMaxRings, 1, kMaxRings));
  rc.rings = std::min({by_cores, by_memory, kMaxRings});
  const auto mib = [](uint64_t b) { return std::to_string(b >> 20) + " MiB"; };
  rc.why = std::to_string(rc.rings) + " ring(s) by default: " + std::to_string(cores) + " cpus / " +
           std::to_string(kCoresPerRing) + " per ring = " + std::to_string(by_cores) + ", shared memory " +
           mib(kRingMemoryBudgetBytes) + " per rank / " + mib(per_ring) + " per ring (2 x " + std::to_string(slots) +
           " slots x " + std::to_string(slot_bytes >> 10) + " KiB) = " + std::to_string(by_memory) + ", limit " +
           std::to_string(kMaxRings) + "; --rings or GRADSYNC_NRINGS sets it";
  return rc;
}

}  // namespace gradsync
