// Attack 3 of docs/security.md over the emulated fabric: a peer that completed the
// authenticated Hello (it holds the job token) writes by RDMA where it should not. A receiving
// gradsyncd registers for remote write only each channel's receive slots and their metadata,
// with keys made for that generation of the job. So a write just outside a channel's slots
// with that channel's key, and a write into the slots with a key of the job's previous
// generation, are both refused by the NIC (remote access error); the attacked job fails
// naming it, a job running all along on the same daemons completes, and they serve a new one.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "daemon_cluster.h"

namespace gradsync {
namespace {

using testing::DaemonCluster;
using testing::DaemonWorld;
using verbs::EmulatedFabric;
using namespace std::chrono_literals;

constexpr uint32_t kSlots = 4, kSlotBytes = 4096;

// One allreduce of 3 slots' worth on every rank, checked.
::testing::AssertionResult allreduce_ok(DaemonWorld& w) {
  const size_t count = 3 * kSlotBytes / sizeof(float);
  std::vector<std::vector<float>> buf(w.size(), std::vector<float>(count));
  auto st = w.run([&](int r) {
    std::fill(buf[r].begin(), buf[r].end(), float(r + 1));
    return w.comm(r).allreduce(buf[r].data(), count, DataType::kFloat32, ReduceOp::kSum);
  });
  const float want = float(w.size() * (w.size() + 1) / 2);
  for (int r = 0; r < w.size(); ++r) {
    if (!st[r].ok()) return ::testing::AssertionFailure() << "rank " << r << ": " << st[r].to_string();
    if (buf[r][count - 1] != want) return ::testing::AssertionFailure() << "rank " << r << " got " << buf[r][count - 1];
  }
  return ::testing::AssertionSuccess();
}

// Posts one signaled RDMA WRITE of 64 bytes on `qp` (a daemon's, connected to the peer) to
// `remote` with `rkey`, as a peer gone bad would. The daemon's pump polls that QP's CQ.
void hostile_write(ibv_qp* qp, uint64_t remote, uint32_t rkey) {
  static char payload[64] = "not a gradient";
  const verbs::IbvApi* api = verbs::emulated_ibv();
  ibv_mr* mr = api->reg_mr(qp->pd, payload, sizeof(payload), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr);
  ibv_sge sge{reinterpret_cast<uint64_t>(payload), sizeof(payload), mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 0xbad;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(api->post_send(qp, &wr, &bad), 0);
  // Deregistered at the end of the test: the WR may still be in the fabric's queue.
  static std::vector<ibv_mr*> keep;
  keep.push_back(mr);
}

// The QPs of `device` that connected since `before` was taken.
std::vector<ibv_qp*> new_qps(const std::string& device, const std::vector<ibv_qp*>& before) {
  std::vector<ibv_qp*> out;
  for (ibv_qp* q : EmulatedFabric::instance().sending_qps(device)) {
    if (std::find(before.begin(), before.end(), q) == before.end()) out.push_back(q);
  }
  return out;
}

// Within 20 s the job's allreduces fail on every rank, naming the refused write (the write may
// have gone on a channel that these calls do not use: its pump still sees the error).
void expect_refused(DaemonWorld& w) {
  std::vector<std::vector<float>> bufs(w.size(), std::vector<float>(kSlotBytes));
  const auto until = std::chrono::steady_clock::now() + 20s;
  auto st = w.run([&](int r) {
    Status s = Status::Ok();
    while (s.ok() && std::chrono::steady_clock::now() < until) {
      s = w.comm(r).allreduce(bufs[r].data(), bufs[r].size(), DataType::kFloat32, ReduceOp::kSum);
    }
    return s;
  });
  bool named = false;
  for (int r = 0; r < w.size(); ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r << " did not notice the refused write";
    named = named || st[r].message().find("remote access error") != std::string::npos;
  }
  EXPECT_TRUE(named) << st[0].to_string() << "\n" << st[1].to_string();
}

TEST(VerbsMemoryAttack, WritesOutsideAChannelsSlotsAndKeysOfAnEarlierGenerationAreRefused) {
  DaemonCluster cluster({.nodes = 2, .slots = kSlots, .slot_bytes = kSlotBytes});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto& fabric = EmulatedFabric::instance();
  const std::string node0 = cluster.device(0), node1 = cluster.device(1);

  // Generation 1 of job "victim": what node 1 lets a peer write.
  std::vector<EmulatedFabric::RemoteWindow> first_windows;
  {
    DaemonWorld first(cluster, 2, 1, "victim");
    ASSERT_EQ(first.join_error(), "");
    ASSERT_TRUE(allreduce_ok(first));
    first_windows = fabric.remote_windows(node1);
  }
  ASSERT_FALSE(first_windows.empty());
  for (const auto& w : first_windows) {
    EXPECT_LE(w.length, size_t{kSlots} * kSlotBytes) << "node 1 lets a peer write " << w.length
                                                     << " bytes: more than one channel's receive slots";
  }

  DaemonWorld bystander(cluster, 2, 1, "bystander");
  ASSERT_EQ(bystander.join_error(), "");
  ASSERT_TRUE(allreduce_ok(bystander));

  // Generation 2 of "victim": new keys; a write with a generation-1 key into its slots.
  {
    const auto before = fabric.sending_qps(node0);
    const auto windows_before = fabric.remote_windows(node1);
    DaemonWorld victim(cluster, 2, 1, "victim");
    ASSERT_EQ(victim.join_error(), "");
    ASSERT_TRUE(allreduce_ok(victim));
    std::set<uint32_t> old_keys;
    for (const auto& w : first_windows) old_keys.insert(w.rkey);
    EmulatedFabric::RemoteWindow slots{};
    for (const auto& w : fabric.remote_windows(node1)) {
      EXPECT_EQ(old_keys.count(w.rkey), 0u) << "a key of generation 1 still opens node 1's memory";
      const bool new_one = std::none_of(windows_before.begin(), windows_before.end(),
                                        [&](const auto& b) { return b.rkey == w.rkey; });
      if (new_one && w.length == size_t{kSlots} * kSlotBytes) slots = w;
    }
    ASSERT_NE(slots.rkey, 0u) << "no receive-slot window of the victim on node 1";
    auto qps = new_qps(node0, before);
    ASSERT_FALSE(qps.empty());
    hostile_write(qps.front(), slots.addr, *old_keys.begin());
    expect_refused(victim);
  }

  // Job "victim-b": a write just past a channel's slots, with that channel's own key.
  {
    const auto before = fabric.sending_qps(node0);
    const auto windows_before = fabric.remote_windows(node1);
    DaemonWorld victim(cluster, 2, 1, "victim-b");
    ASSERT_EQ(victim.join_error(), "");
    ASSERT_TRUE(allreduce_ok(victim));
    EmulatedFabric::RemoteWindow slots{};
    for (const auto& w : fabric.remote_windows(node1)) {
      const bool new_one = std::none_of(windows_before.begin(), windows_before.end(),
                                        [&](const auto& b) { return b.rkey == w.rkey; });
      if (new_one && w.length == size_t{kSlots} * kSlotBytes) slots = w;
    }
    ASSERT_NE(slots.rkey, 0u);
    auto qps = new_qps(node0, before);
    ASSERT_FALSE(qps.empty());
    hostile_write(qps.front(), slots.addr + slots.length, slots.rkey);
    expect_refused(victim);
  }

  // The bystander job was never touched, and the daemons serve a new job.
  EXPECT_TRUE(allreduce_ok(bystander));
  DaemonWorld after(cluster, 2, 1, "after-attack");
  ASSERT_EQ(after.join_error(), "");
  EXPECT_TRUE(allreduce_ok(after));
}

}  // namespace
}  // namespace gradsync
