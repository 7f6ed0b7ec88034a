// gradsyncd's ring count: the limit of the tag space and the default from cores and shared
// memory. The count a job of differently started nodes uses is the coordinator's
// (coordinator_layout_test.cc, OfferFold).
#include "daemon/ring_count.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "collectives/topology.h"

namespace gradsync {
namespace {

constexpr uint32_t kSlots = 8;
constexpr uint32_t kMiB = 1u << 20;

TEST(RingCount, TheTagSpaceHoldsSixteenRings) {
  EXPECT_EQ(kMaxRings, 16u);
  // Every ring tag lies below the first tree tag, so 16 rings and both trees are distinct channels.
  std::vector<uint32_t> ring = {0, 1, 2, 3, 4};
  std::set<uint32_t> tags;
  for (const Edge& e : channel_edges(ring, kMaxRings)) tags.insert(e.tag);
  EXPECT_EQ(tags.size(), size_t(kMaxRings + 2 * kNumTrees));
  EXPECT_EQ(*tags.begin(), 0u);
  EXPECT_EQ(ring_tag(kMaxRings - 1) + 1, tree_up_tag(0));
}

TEST(RingCount, ParsesOneToTheLimitAndNamesTheLimitOtherwise) {
  for (const char* ok : {"1", "8", "16"}) {
    auto r = parse_ring_count(ok, "--rings");
    ASSERT_TRUE(r.ok()) << ok << ": " << r.status().to_string();
    EXPECT_EQ(*r, uint32_t(std::stoul(ok)));
  }
  for (const char* bad : {"17", "32", "0", "", "-1", "4x", " 4", "99999999999"}) {
    auto r = parse_ring_count(bad, "GRADSYNC_NRINGS");
    ASSERT_FALSE(r.ok()) << "'" << bad << "' was accepted";
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find("GRADSYNC_NRINGS='" + std::string(bad) + "'"), std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find("1 to 16"), std::string::npos) << r.status().message();
  }
  EXPECT_NE(parse_ring_count("17", "--rings").status().message().find("above the limit of 16 rings"),
            std::string::npos);
}

TEST(RingCount, DefaultFollowsTheCoresWithinTheMemoryBudget) {
  // 2 cores (the CI machine): one ring, as before.
  EXPECT_EQ(default_ring_count(1, kSlots, kMiB).rings, 1u);
  EXPECT_EQ(default_ring_count(2, kSlots, kMiB).rings, 1u);
  EXPECT_EQ(default_ring_count(4, kSlots, kMiB).rings, 2u);
  EXPECT_EQ(default_ring_count(8, kSlots, kMiB).rings, 4u);
  // 16 cores (the H200 host): 8 rings, where 8 measured 3.4-4.0x NCCL over sockets.
  EXPECT_EQ(default_ring_count(16, kSlots, kMiB).rings, 8u);
  // More cores: the 128 MiB per rank budget stops at 8 rings of 16 MiB each...
  EXPECT_EQ(default_ring_count(64, kSlots, kMiB).rings, 8u);
  EXPECT_LE(ring_memory_per_rank(default_ring_count(64, kSlots, kMiB).rings, kSlots, kMiB), kRingMemoryBudgetBytes);
  // ...smaller slots allow more, up to the tag limit; larger ones fewer, never none.
  EXPECT_EQ(default_ring_count(64, kSlots, 256u << 10).rings, 16u);
  EXPECT_EQ(default_ring_count(64, 64, 64 * kMiB).rings, 1u);
  const RingCount rc = default_ring_count(16, kSlots, kMiB);
  EXPECT_TRUE(rc.chosen);
  EXPECT_NE(rc.why.find("16 cpus"), std::string::npos) << rc.why;
  EXPECT_NE(rc.why.find("16 MiB per ring"), std::string::npos) << rc.why;
}

}  // namespace
}  // namespace gradsync
