// Turns the daemon's channel set-up into the channel ends one rank's algorithms use.
#pragma once

#include <string>
#include <vector>

#include "collectives/collective.h"
#include "client/daemon_wire.h"

namespace gradsync {

// `sockets`: the descriptors that came after the shared memory's with the join reply; a
// ChannelRef with `socket` = i + 1 takes sockets[i] (rank-owned TCP channels).
Result<RankLinks> build_links(const std::string& job, int rank, const std::vector<uint32_t>& ring,
                              const std::vector<std::string>& hosts, const wire::ChannelSetup& setup,
                              void* base, const ShmLayout& layout, std::vector<Fd> sockets = {});

// This rank leaves the job: marks every shared-memory channel end it owns (Channel::mark_left),
// so that a local peer still waiting on one (it made more calls) fails at once with kMismatch.
// Socket channels need nothing: the peer sees the socket close with data still owed.
void mark_left(const RankLinks& links);

}  // namespace gradsync
