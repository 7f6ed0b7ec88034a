// The verbs wrappers against the emulated fabric (a test double; no NIC involved).
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <array>
#include <optional>
#include <cstring>
#include <vector>

#include "transport/verbs/emulated_fabric.h"
#include "transport/verbs/verbs.h"

namespace gradsync::verbs {
namespace {

constexpr uint8_t kPort = 1;
constexpr size_t kBytes = 4096;  // one slot
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;

#define ASSIGN_OK(lhs, expr)                                  \
  auto lhs##_r = (expr);                                      \
  ASSERT_TRUE(lhs##_r.ok()) << lhs##_r.status().to_string(); \
  auto lhs = std::move(lhs##_r).value()

// Two RC QPs on one emulated RoCE device, connected through the real INIT->RTR->RTS helpers.
class Pair : public ::testing::Test {
 protected:
  void SetUp() override {
    EmulatedFabric::instance().reset();
    EmulatedFabric::instance().add_device("emu0", 1, LinkLayer::kEthernet);
    api_ = emulated_ibv();
    ASSIGN_OK(ctx, Context::open(api_, "emu0"));
    ctx_.emplace(std::move(ctx));
    ASSIGN_OK(pd, ProtectionDomain::create(*ctx_));
    pd_.emplace(std::move(pd));
    for (int i = 0; i < 2; ++i) {
      buf_[i].assign(kBytes, static_cast<uint8_t>(i));
      ASSIGN_OK(mr, MemoryRegion::create(*pd_, buf_[i].data(), kBytes, kAccess));
      mr_[i].emplace(std::move(mr));
      ASSIGN_OK(scq, CompletionQueue::create(*ctx_, 64));
      ASSIGN_OK(rcq, CompletionQueue::create(*ctx_, 64));
      scq_[i].emplace(std::move(scq));
      rcq_[i].emplace(std::move(rcq));
      ASSIGN_OK(qp, QueuePair::create_rc(*pd_, *scq_[i], *rcq_[i], QpCaps{}, "rank " + std::to_string(1 - i)));
      qp_[i].emplace(std::move(qp));
    }
  }
  void TearDown() override {
    for (auto& q : qp_) q.reset();
    for (int i = 0; i < 2; ++i) { scq_[i].reset(); rcq_[i].reset(); mr_[i].reset(); }
    pd_.reset();
    ctx_.reset();
  }
  void Connect(bool rts = true) {
    ASSIGN_OK(port, query_port(*ctx_, kPort));
    ASSIGN_OK(gid, select_gid(*ctx_, kPort));
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(qp_[i]->to_init(kPort, kAccess).ok());
    for (int i = 0; i < 2; ++i) {
      PeerAddress peer{qp_[1 - i]->qpn(), kPsn, port.lid, gid.gid, port.active_mtu};
      Status s = qp_[i]->to_rtr(peer, port.active_mtu, gid.index);
      ASSERT_TRUE(s.ok()) << s.to_string();
      if (rts) {
        ASSERT_TRUE(qp_[i]->to_rts(kPsn).ok());
      }
    }
  }
  std::vector<ibv_wc> Drain(const CompletionQueue& cq) {
    std::array<ibv_wc, 16> wcs{};
    auto n = cq.poll(wcs);
    EXPECT_TRUE(n.ok());
    return {wcs.begin(), wcs.begin() + (n.ok() ? *n : 0)};
  }
  Status Write(size_t len, uint64_t raddr, uint32_t rkey, uint32_t imm, uint64_t wr_id) {
    return qp_[0]->post_write_with_imm(*mr_[0], 0, len, raddr, rkey, imm, wr_id);
  }
  static constexpr uint32_t kPsn = 0x123456;
  const IbvApi* api_ = nullptr;
  std::optional<Context> ctx_;
  std::optional<ProtectionDomain> pd_;
  std::vector<uint8_t> buf_[2];
  std::optional<MemoryRegion> mr_[2];
  std::optional<CompletionQueue> scq_[2], rcq_[2];
  std::optional<QueuePair> qp_[2];
};

TEST_F(Pair, WriteWithImmLandsBytesImmAndLength) {
  Connect();
  ASSERT_TRUE(qp_[1]->post_recv(77).ok());
  std::memcpy(buf_[0].data(), "gradsync", 8);
  ASSERT_TRUE(Write(100, mr_[1]->addr() + 8, mr_[1]->rkey(), 0xC0FFEE, 5).ok());
  auto sent = Drain(*scq_[0]);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(sent[0].opcode, IBV_WC_RDMA_WRITE);
  EXPECT_EQ(sent[0].wr_id, 5u);
  auto got = Drain(*rcq_[1]);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(got[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(got[0].wr_id, 77u);
  EXPECT_EQ(got[0].byte_len, 100u);
  EXPECT_TRUE(got[0].wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(ntohl(got[0].imm_data), 0xC0FFEEu);
  EXPECT_EQ(std::memcmp(buf_[1].data() + 8, buf_[0].data(), 100), 0);
  EXPECT_EQ(buf_[1][7], 1);    // untouched before
  EXPECT_EQ(buf_[1][108], 1);  // and after
}

TEST_F(Pair, WriteBeforeRtsIsRefused) {
  Connect(/*rts=*/false);
  EXPECT_EQ(EmulatedFabric::instance().qp_state(qp_[0]->get()), IBV_QPS_RTR);
  Status s = Write(8, mr_[1]->addr(), mr_[1]->rkey(), 1, 1);
  EXPECT_EQ(s.code(), Code::kFailedPrecondition);
  EXPECT_NE(s.message().find("peer rank 1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("emu0"), std::string::npos) << s.message();
}

TEST_F(Pair, RtsSkippingRtrIsRefused) {
  ASSERT_TRUE(qp_[0]->to_init(kPort, kAccess).ok());
  EXPECT_FALSE(qp_[0]->to_rts(kPsn).ok());
}

TEST_F(Pair, WriteWithoutReceiveIsRnrAndErrorsTheQp) {
  Connect();
  ASSERT_TRUE(Write(8, mr_[1]->addr(), mr_[1]->rkey(), 1, 9).ok());
  auto sent = Drain(*scq_[0]);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
  Status s = qp_[0]->check(sent[0]);
  EXPECT_EQ(s.code(), Code::kAborted);
  EXPECT_NE(s.message().find("RNR retry counter exceeded"), std::string::npos) << s.message();
  EXPECT_EQ(EmulatedFabric::instance().qp_state(qp_[0]->get()), IBV_QPS_ERR);
}

TEST_F(Pair, BadRkeyOrBoundsIsRemoteAccessError) {
  Connect();
  ASSERT_TRUE(qp_[1]->post_recv(1).ok());
  ASSERT_TRUE(Write(8, mr_[1]->addr(), mr_[1]->rkey() + 100, 1, 1).ok());  // wrong rkey
  auto sent = Drain(*scq_[0]);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_NE(qp_[0]->check(sent[0]).message().find("remote access error"), std::string::npos);
  EXPECT_EQ(EmulatedFabric::instance().qp_state(qp_[0]->get()), IBV_QPS_ERR);
  EXPECT_TRUE(Drain(*rcq_[1]).empty());  // the receive was not consumed
  EXPECT_EQ(buf_[1][0], 1);
}

TEST_F(Pair, OutOfBoundsWriteIsRemoteAccessError) {
  Connect();
  ASSERT_TRUE(qp_[1]->post_recv(1).ok());
  ASSERT_TRUE(Write(16, mr_[1]->addr() + kBytes - 8, mr_[1]->rkey(), 1, 1).ok());
  auto sent = Drain(*scq_[0]);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_REM_ACCESS_ERR);
}

TEST_F(Pair, RegionWithoutRemoteWriteIsRemoteAccessError) {
  Connect();
  std::vector<uint8_t> ro(kBytes);
  ASSIGN_OK(mr, MemoryRegion::create(*pd_, ro.data(), kBytes, IBV_ACCESS_LOCAL_WRITE));
  ASSERT_TRUE(qp_[1]->post_recv(1).ok());
  ASSERT_TRUE(Write(8, mr.addr(), mr.rkey(), 1, 1).ok());
  auto sent = Drain(*scq_[0]);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_REM_ACCESS_ERR);
}

TEST_F(Pair, LinkDownMidStreamErrorsAndFlushes) {
  Connect();
  ASSERT_TRUE(qp_[1]->post_recv(1).ok());
  ASSERT_TRUE(qp_[0]->post_recv(10).ok());
  ASSERT_TRUE(qp_[0]->post_recv(11).ok());
  ASSERT_TRUE(Write(8, mr_[1]->addr(), mr_[1]->rkey(), 1, 100).ok());
  ASSERT_EQ(Drain(*scq_[0]).at(0).status, IBV_WC_SUCCESS);
  EmulatedFabric::instance().set_link_down("emu0", kPort);
  ASSERT_TRUE(Write(8, mr_[1]->addr(), mr_[1]->rkey(), 2, 101).ok());
  ASSERT_TRUE(Write(8, mr_[1]->addr(), mr_[1]->rkey(), 3, 102).ok());
  auto sent = Drain(*scq_[0]);
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_EQ(sent[0].status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_EQ(sent[0].wr_id, 101u);
  EXPECT_NE(qp_[0]->check(sent[0]).message().find("transport retry counter exceeded"), std::string::npos);
  EXPECT_EQ(sent[1].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(sent[1].wr_id, 102u);
  EXPECT_EQ(EmulatedFabric::instance().qp_state(qp_[0]->get()), IBV_QPS_ERR);
  auto flushed = Drain(*rcq_[0]);
  ASSERT_EQ(flushed.size(), 2u);
  EXPECT_EQ(flushed[0].wr_id, 10u);
  EXPECT_EQ(flushed[1].wr_id, 11u);
  for (auto& wc : flushed) EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
}

TEST_F(Pair, ForcedQpErrorFlushesReceives) {
  Connect();
  ASSERT_TRUE(qp_[1]->post_recv(3).ok());
  EmulatedFabric::instance().force_qp_error(qp_[1]->get());
  auto flushed = Drain(*rcq_[1]);
  ASSERT_EQ(flushed.size(), 1u);
  EXPECT_EQ(flushed[0].status, IBV_WC_WR_FLUSH_ERR);
  // The peer can no longer reach it.
  ASSERT_TRUE(Write(8, mr_[1]->addr(), mr_[1]->rkey(), 1, 1).ok());
  EXPECT_EQ(Drain(*scq_[0]).at(0).status, IBV_WC_RETRY_EXC_ERR);
}

TEST(VerbsGid, PicksIpv4MappedRoceV2AndHonoursOverride) {
  EmulatedFabric::instance().reset();
  EmulatedFabric::instance().add_device("emu0", 1, LinkLayer::kEthernet);
  auto ctx = Context::open(emulated_ibv());
  ASSERT_TRUE(ctx.ok()) << ctx.status().to_string();
  auto gid = select_gid(*ctx, kPort);
  ASSERT_TRUE(gid.ok()) << gid.status().to_string();
  EXPECT_EQ(gid->index, 3);  // 0/1 are fe80 (v1/v2), 2 is ::ffff v1, 3 is ::ffff v2
  EXPECT_EQ(gid->gid.raw[10], 0xff);
  EXPECT_EQ(gid->gid.raw[11], 0xff);
  EXPECT_EQ(gid->gid.raw[12], 10);
  auto forced = select_gid(*ctx, kPort, 1);
  ASSERT_TRUE(forced.ok());
  EXPECT_EQ(forced->index, 1);
  EXPECT_EQ(forced->gid.raw[0], 0xfe);
  auto bad = select_gid(*ctx, kPort, 9);
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("emu0"), std::string::npos);
}

TEST(VerbsDevices, ListAndOpenByName) {
  EmulatedFabric::instance().reset();
  EmulatedFabric::instance().add_device("emu0", 1, LinkLayer::kEthernet);
  EmulatedFabric::instance().add_device("emu_ib", 2, LinkLayer::kInfiniBand);
  auto devs = list_devices(emulated_ibv());
  ASSERT_TRUE(devs.ok());
  ASSERT_EQ(devs->size(), 2u);
  EXPECT_EQ((*devs)[1].name, "emu_ib");
  ASSERT_EQ((*devs)[1].ports.size(), 2u);
  EXPECT_FALSE((*devs)[1].ports[0].is_ethernet());
  EXPECT_NE((*devs)[1].ports[0].lid, 0);
  EXPECT_EQ((*devs)[0].ports.at(0).state, IBV_PORT_ACTIVE);
  auto missing = Context::open(emulated_ibv(), "mlx5_9");
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_NE(missing.status().message().find("emu0,emu_ib"), std::string::npos);
}

// No assumption about this machine: libibverbs may or may not be installed; there is no NIC.
TEST(VerbsReal, LoadEitherWorksOrSaysWhy) {
  auto api = load_libibverbs();
  if (!api.ok()) {
    EXPECT_EQ(api.status().code(), Code::kUnavailable);
    EXPECT_NE(api.status().message().find("libibverbs.so.1"), std::string::npos);
    EXPECT_NE(api.status().message().find("falling back to TCP"), std::string::npos);
    return;
  }
  EXPECT_STREQ((*api)->name, "libibverbs.so.1");
  auto devs = list_devices(*api);
  ASSERT_TRUE(devs.ok()) << devs.status().to_string();
  if (!devs->empty()) GTEST_SKIP() << devs->size() << " real verbs device(s) present";
  // No device: NULL list with ENOSYS (no uverbs in the kernel) or an empty list.
  auto ctx = Context::open(*api);
  EXPECT_TRUE(ctx.status().code() == Code::kUnavailable || ctx.status().code() == Code::kNotFound)
      << ctx.status().to_string();
}

}  // namespace
}  // namespace gradsync::verbs
