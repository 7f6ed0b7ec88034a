// Turns the daemon's channel set-up into the channel ends one rank's algorithms use.
#pragma once

#include <string>
#include <vector>

#include "collectives/collective.h"
#include "daemon.pb.h"

namespace gradsync {

// `sockets`: the descriptors that came after the shared memory's with the join reply; a
// ChannelRef with `socket` = i + 1 takes sockets[i] (rank-owned TCP channels).
Result<RankLinks> build_links(const std::string& job, int rank, const std::vector<uint32_t>& ring,
                              const std::vector<std::string>& hosts, const v1::ChannelSetup& setup,
                              void* base, const ShmLayout& layout, std::vector<Fd> sockets = {});

}  // namespace gradsync
