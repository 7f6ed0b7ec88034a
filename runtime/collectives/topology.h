// Who talks to whom: the ring and the two trees of a communicator, derived from the ring
// order the coordinator hands out, and the directed channels they need. Pure functions: the
// daemon (to allocate channels and proxies) and the trainer (to find them) compute the same.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradsync {

// A channel carries one kind of traffic between two ranks, so that algorithms running
// interleaved never read each other's slots.
enum class ChannelTag : uint32_t {
  kRing = 0,       // + ring index: rank -> next rank of ring r
  kTreeUp = 16,    // + tree index: child -> parent
  kTreeDown = 24,  // + tree index: parent -> child
};
// Ring tags run from kRing up to kTreeUp: 16 rings at most (gradsyncd --rings refuses more).
constexpr uint32_t kMaxRings = 16;
constexpr uint32_t kNumTrees = 2;
static_assert(uint32_t(ChannelTag::kRing) + kMaxRings <= uint32_t(ChannelTag::kTreeUp),
              "ring tags must not reach the tree tags");
static_assert(uint32_t(ChannelTag::kTreeUp) + kNumTrees <= uint32_t(ChannelTag::kTreeDown),
              "tree-up tags must not reach the tree-down tags");

constexpr uint32_t ring_tag(uint32_t ring) { return uint32_t(ChannelTag::kRing) + ring; }
constexpr uint32_t tree_up_tag(uint32_t tree) { return uint32_t(ChannelTag::kTreeUp) + tree; }
constexpr uint32_t tree_down_tag(uint32_t tree) { return uint32_t(ChannelTag::kTreeDown) + tree; }

struct Edge {
  uint32_t tag;
  uint32_t src;  // rank
  uint32_t dst;  // rank
  bool operator==(const Edge&) const = default;
};

// A rank's place in one of the two trees: -1 where there is none.
struct TreeLinks {
  int parent = -1;
  int children[2] = {-1, -1};
};

// Tree t over ring positions: tree 0 is a binary heap rooted at position 0 (children of
// position v are 2v+1 and 2v+2), tree 1 the same heap over mirrored positions (rooted at the
// last position). Ranks in the first half of the ring are interior in tree 0 and leaves in
// tree 1, and the other way round for the second half, so each carries about half the
// interior work; each tree reduces half of the data.
TreeLinks tree_links(const std::vector<uint32_t>& ring, uint32_t rank, uint32_t tree);
// The same for the rank at ring position `pos`, in O(1).
TreeLinks tree_links_at(const std::vector<uint32_t>& ring, size_t pos, uint32_t tree);

// Every directed channel of a communicator with `rings` rings and both trees; sorted, no
// duplicates. World size 1 needs none.
std::vector<Edge> channel_edges(const std::vector<uint32_t>& ring, uint32_t rings);

// The channels of channel_edges() with an end at one of the ring positions `positions`, in
// O(positions x rings): what one node needs of a large job. Sorted, no duplicates.
std::vector<Edge> channel_edges_at(const std::vector<uint32_t>& ring, const std::vector<size_t>& positions,
                                   uint32_t rings);

}  // namespace gradsync
