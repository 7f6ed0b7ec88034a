// dma-buf memory regions and the copy hook of the emulated fabric (a test double; no NIC, no
// GPU). A memfd-backed shared mapping stands in for an exported GPU range: it is registered
// through MemoryRegion::create_dmabuf with iova = the mapping's address, as register_gpu_memory
// does with the GPU virtual address. tests/gpu/verbs_gpu_test.cc runs the same path with
// cudaMalloc buffers and real dma-buf fds.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "transport/verbs/emulated_fabric.h"
#include "transport/verbs/verbs.h"

namespace gradsync::verbs {
namespace {

constexpr uint8_t kPort = 1;
constexpr uint32_t kPsn = 0x2468;
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;

#define ASSIGN_OK(lhs, expr)                                  \
  auto lhs##_r = (expr);                                      \
  ASSERT_TRUE(lhs##_r.ok()) << lhs##_r.status().to_string(); \
  auto lhs = std::move(lhs##_r).value()

size_t page_size() { return static_cast<size_t>(::sysconf(_SC_PAGESIZE)); }

bool contains(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

// A memfd of `bytes` mapped shared: the "exported device memory" of these tests.
class MemfdMapping {
 public:
  explicit MemfdMapping(size_t bytes) : bytes_(bytes) {
    fd_ = ::memfd_create("gradsync-dmabuf-test", MFD_CLOEXEC);
    if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) return;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p != MAP_FAILED) addr_ = static_cast<uint8_t*>(p);
  }
  ~MemfdMapping() {
    if (addr_) ::munmap(addr_, bytes_);
    if (fd_ >= 0) ::close(fd_);
  }
  MemfdMapping(const MemfdMapping&) = delete;
  MemfdMapping& operator=(const MemfdMapping&) = delete;
  bool ok() const { return addr_ != nullptr; }
  int fd() const { return fd_; }
  uint8_t* data() const { return addr_; }
  uint64_t iova() const { return reinterpret_cast<uint64_t>(addr_); }
  size_t size() const { return bytes_; }

 private:
  size_t bytes_;
  int fd_ = -1;
  uint8_t* addr_ = nullptr;
};

// One emulated RoCE device per "node", each with its PD, CQs and one RC QP to the other node.
struct Node {
  std::optional<Context> ctx;
  std::optional<ProtectionDomain> pd;
  std::optional<CompletionQueue> scq, rcq;
  std::optional<QueuePair> qp;
  std::vector<MemoryRegion> mrs;  // released before the PD
  void release() {
    qp.reset();
    scq.reset();
    rcq.reset();
    mrs.clear();
    pd.reset();
    ctx.reset();
  }
};

class Dmabuf : public ::testing::Test {
 protected:
  void SetUp() override {
    EmulatedFabric::instance().reset();
    EmulatedFabric::instance().set_copier(nullptr);
    EmulatedFabric::instance().add_device("emu0", 1, LinkLayer::kEthernet);
    EmulatedFabric::instance().add_device("emu1", 1, LinkLayer::kEthernet);
    for (int i = 0; i < 2; ++i) {
      Node& n = node_[i];
      ASSIGN_OK(ctx, Context::open(emulated_ibv(), "emu" + std::to_string(i)));
      n.ctx.emplace(std::move(ctx));
      ASSIGN_OK(pd, ProtectionDomain::create(*n.ctx));
      n.pd.emplace(std::move(pd));
      ASSIGN_OK(scq, CompletionQueue::create(*n.ctx, 64));
      ASSIGN_OK(rcq, CompletionQueue::create(*n.ctx, 64));
      n.scq.emplace(std::move(scq));
      n.rcq.emplace(std::move(rcq));
      QpCaps caps;
      caps.max_send_sge = 2;  // CopierCarriesEveryWrite gathers two SGEs
      ASSIGN_OK(qp, QueuePair::create_rc(*n.pd, *n.scq, *n.rcq, caps, "node " + std::to_string(1 - i)));
      n.qp.emplace(std::move(qp));
    }
  }
  void TearDown() override {
    EmulatedFabric::instance().set_copier(nullptr);
    for (auto& n : node_) n.release();
  }
  void Connect() {
    for (auto& n : node_) ASSERT_TRUE(n.qp->to_init(kPort, kAccess).ok());
    for (int i = 0; i < 2; ++i) {
      Node& peer = node_[1 - i];
      ASSIGN_OK(port, query_port(*peer.ctx, kPort));
      ASSIGN_OK(gid, select_gid(*peer.ctx, kPort));
      ASSIGN_OK(local_gid, select_gid(*node_[i].ctx, kPort));
      PeerAddress addr{peer.qp->qpn(), kPsn, port.lid, gid.gid, port.active_mtu};
      Status s = node_[i].qp->to_rtr(addr, port.active_mtu, local_gid.index);
      ASSERT_TRUE(s.ok()) << s.to_string();
      ASSERT_TRUE(node_[i].qp->to_rts(kPsn).ok());
    }
  }
  std::vector<ibv_wc> Drain(const CompletionQueue& cq) {
    std::array<ibv_wc, 16> wcs{};
    auto n = cq.poll(wcs);
    EXPECT_TRUE(n.ok());
    return {wcs.begin(), wcs.begin() + (n.ok() ? *n : 0)};
  }
  Result<MemoryRegion> RegDmabuf(int node, int fd, uint64_t offset, size_t length, uint64_t iova,
                                 int access = kAccess) {
    return MemoryRegion::create_dmabuf(*node_[node].pd, fd, offset, length, iova, access);
  }
  Node node_[2];
};

TEST_F(Dmabuf, MemfdMappingTakesWriteWithImm) {
  MemfdMapping dst(4 * page_size());
  ASSERT_TRUE(dst.ok()) << std::strerror(errno);
  std::memset(dst.data(), 0xEE, dst.size());
  ASSIGN_OK(rmr, RegDmabuf(1, dst.fd(), 0, dst.size(), dst.iova()));
  EXPECT_EQ(rmr.addr(), dst.iova()) << "keys address a dma-buf MR by iova";
  EXPECT_EQ(rmr.get()->addr, nullptr) << "rdma-core keeps the dma-buf offset (0) in ibv_mr::addr";
  EXPECT_EQ(rmr.length(), dst.size());
  EXPECT_TRUE(EmulatedFabric::instance().is_device_memory(rmr.get()));

  std::vector<uint8_t> src(page_size());
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  ASSIGN_OK(smr, MemoryRegion::create(*node_[0].pd, src.data(), src.size(), kAccess));
  EXPECT_FALSE(EmulatedFabric::instance().is_device_memory(smr.get()));
  Connect();

  ASSERT_TRUE(node_[1].qp->post_recv(41).ok());
  const size_t at = page_size() + 100;  // crosses into the next page
  Status s = node_[0].qp->post_write_with_imm(smr, 0, src.size(), rmr.addr() + at, rmr.rkey(), 0xD0D0, 7);
  ASSERT_TRUE(s.ok()) << s.to_string();
  auto sent = Drain(*node_[0].scq);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS) << node_[0].qp->check(sent[0]).to_string();
  auto got = Drain(*node_[1].rcq);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(got[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(got[0].wr_id, 41u);
  EXPECT_EQ(got[0].byte_len, src.size());
  EXPECT_EQ(ntohl(got[0].imm_data), 0xD0D0u);
  EXPECT_EQ(std::memcmp(dst.data() + at, src.data(), src.size()), 0);
  EXPECT_EQ(dst.data()[at - 1], 0xEE);
  EXPECT_EQ(dst.data()[at + src.size()], 0xEE);

  // The bytes are in the fd's pages, not just at that address: a second mapping sees them.
  void* again = ::mmap(nullptr, dst.size(), PROT_READ, MAP_SHARED, dst.fd(), 0);
  ASSERT_NE(again, MAP_FAILED);
  EXPECT_EQ(std::memcmp(static_cast<uint8_t*>(again) + at, src.data(), src.size()), 0);
  ::munmap(again, dst.size());

  node_[0].mrs.push_back(std::move(smr));
  node_[1].mrs.push_back(std::move(rmr));
}

TEST_F(Dmabuf, OffsetIntoTheBufferIsAddressedByIova) {
  MemfdMapping dst(4 * page_size());
  ASSERT_TRUE(dst.ok());
  std::memset(dst.data(), 0, dst.size());
  // Pages 1..2 of the fd, reached at the address of page 1.
  ASSIGN_OK(rmr, RegDmabuf(1, dst.fd(), page_size(), 2 * page_size(), dst.iova() + page_size()));
  EXPECT_EQ(rmr.addr(), dst.iova() + page_size());
  EXPECT_EQ(reinterpret_cast<uint64_t>(rmr.get()->addr), page_size());
  std::vector<uint8_t> src(64, 0x5A);
  ASSIGN_OK(smr, MemoryRegion::create(*node_[0].pd, src.data(), src.size(), kAccess));
  Connect();
  ASSERT_TRUE(node_[1].qp->post_recv(1).ok());
  ASSERT_TRUE(node_[0].qp->post_write_with_imm(smr, 0, 64, rmr.addr(), rmr.rkey(), 1, 1).ok());
  EXPECT_EQ(Drain(*node_[0].scq).at(0).status, IBV_WC_SUCCESS);
  EXPECT_EQ(dst.data()[page_size()], 0x5A);
  // Page 0 is outside the MR: a write there is a remote access error.
  ASSERT_TRUE(node_[1].qp->post_recv(2).ok());
  ASSERT_TRUE(node_[0].qp->post_write_with_imm(smr, 0, 64, dst.iova(), rmr.rkey(), 2, 2).ok());
  auto sent = Drain(*node_[0].scq);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(dst.data()[0], 0);
  node_[0].mrs.push_back(std::move(smr));
  node_[1].mrs.push_back(std::move(rmr));
}

TEST_F(Dmabuf, BadFdFailsClearly) {
  MemfdMapping buf(page_size());
  ASSERT_TRUE(buf.ok());
  auto r = RegDmabuf(0, -1, 0, buf.size(), buf.iova());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  const std::string& m = r.status().message();
  EXPECT_TRUE(contains(m, "verbs device emu0")) << m;
  EXPECT_TRUE(contains(m, "reg_dmabuf_mr")) << m;
  EXPECT_TRUE(contains(m, "fd -1")) << m;
  EXPECT_TRUE(contains(m, "errno " + std::to_string(EBADF))) << m;
  EXPECT_TRUE(contains(m, "not an open dma-buf fd")) << m;

  // A descriptor that was open once but is closed now.
  int fd = ::dup(buf.fd());
  ASSERT_GE(fd, 0);
  ::close(fd);
  r = RegDmabuf(0, fd, 0, buf.size(), buf.iova());
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "errno " + std::to_string(EBADF))) << r.status().message();
}

TEST_F(Dmabuf, OutOfRangeIovaAndBoundsFailClearly) {
  MemfdMapping buf(2 * page_size());
  ASSERT_TRUE(buf.ok());
  const std::string einval = "errno " + std::to_string(EINVAL);
  struct Case {
    const char* what;
    uint64_t offset;
    size_t length;
    uint64_t iova;
  };
  const Case cases[] = {
      {"iova range wraps around", 0, buf.size(), UINT64_MAX - page_size() + 1},
      {"iova above any user address", 0, buf.size(), uint64_t{1} << 60},
      {"iova 0", 0, buf.size(), 0},
      {"iova and offset page offsets differ", 0, buf.size(), buf.iova() + 8},
      {"past the end of the fd", page_size(), buf.size(), buf.iova() + page_size()},
      {"zero length", 0, 0, buf.iova()},
  };
  for (const Case& c : cases) {
    auto r = RegDmabuf(0, buf.fd(), c.offset, c.length, c.iova);
    ASSERT_FALSE(r.ok()) << c.what;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << c.what;
    const std::string& m = r.status().message();
    EXPECT_TRUE(contains(m, einval)) << c.what << ": " << m;
    EXPECT_TRUE(contains(m, "iova 0x")) << c.what << ": " << m;
    EXPECT_TRUE(contains(m, "emu0")) << c.what << ": " << m;
  }
}

TEST_F(Dmabuf, AccessFlagsOutsideTheManPageListAreRefused) {
  MemfdMapping buf(page_size());
  ASSERT_TRUE(buf.ok());
  EXPECT_FALSE(RegDmabuf(0, buf.fd(), 0, buf.size(), buf.iova(), kAccess | IBV_ACCESS_MW_BIND).ok());
  EXPECT_FALSE(RegDmabuf(0, buf.fd(), 0, buf.size(), buf.iova(), IBV_ACCESS_REMOTE_WRITE).ok());
  ASSIGN_OK(mr, RegDmabuf(0, buf.fd(), 0, buf.size(), buf.iova(),
                          kAccess | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_RELAXED_ORDERING));
  node_[0].mrs.push_back(std::move(mr));
}

TEST_F(Dmabuf, TableWithoutTheEntryIsUnavailable) {
  IbvApi old_rdma_core = *emulated_ibv();
  old_rdma_core.reg_dmabuf_mr = nullptr;
  old_rdma_core.reg_dmabuf_mr_missing = "libibverbs.so.1 has no ibv_reg_dmabuf_mr (rdma-core < 34)";
  MemfdMapping buf(page_size());
  ASSERT_TRUE(buf.ok());
  {
    ASSIGN_OK(ctx, Context::open(&old_rdma_core, "emu0"));
    ASSIGN_OK(pd, ProtectionDomain::create(ctx));
    auto r = MemoryRegion::create_dmabuf(pd, buf.fd(), 0, buf.size(), buf.iova(), kAccess);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kUnavailable);
    EXPECT_TRUE(contains(r.status().message(), "rdma-core < 34")) << r.status().message();
    EXPECT_TRUE(contains(r.status().message(), "emu0")) << r.status().message();
  }
}

// gradsyncctl doctor's NIC probe (ibv_reg_dmabuf_mr with fd -1, as NCCL probes): the
// emulated device checks the fd (EBADF), so it registers dma-buf; a provider that answers
// EOPNOTSUPP, or a table without the entry, does not.
ibv_mr* refuse_dmabuf(ibv_pd*, uint64_t, size_t, uint64_t, int, int) {
  errno = EOPNOTSUPP;
  return nullptr;
}

TEST_F(Dmabuf, ProbeTellsWhetherTheDeviceRegistersDmabuf) {
  std::string note;
  EXPECT_TRUE(probe_dmabuf(*node_[0].pd, &note));
  EXPECT_TRUE(contains(note, "as expected")) << note;

  IbvApi old_rdma_core = *emulated_ibv();
  old_rdma_core.reg_dmabuf_mr = nullptr;
  old_rdma_core.reg_dmabuf_mr_missing = "libibverbs.so.1 has no ibv_reg_dmabuf_mr (rdma-core < 34)";
  IbvApi refusing = *emulated_ibv();
  refusing.reg_dmabuf_mr = &refuse_dmabuf;
  for (const IbvApi* api : {&old_rdma_core, &refusing}) {
    ASSIGN_OK(ctx, Context::open(api, "emu0"));
    ASSIGN_OK(pd, ProtectionDomain::create(ctx));
    EXPECT_FALSE(probe_dmabuf(pd, &note));
    EXPECT_TRUE(contains(note, api == &refusing ? "provider or kernel without dma-buf" : "rdma-core < 34")) << note;
  }
}

// A device made to refuse dma-buf (EmulatedFabric::set_dmabuf_supported): the probe says no,
// and a registration of a real dma-buf fd fails with EOPNOTSUPP naming the device.
TEST_F(Dmabuf, DeviceWithoutDmabufSupportRefusesIt) {
  EmulatedFabric::instance().set_dmabuf_supported("emu1", false);
  std::string note;
  EXPECT_TRUE(probe_dmabuf(*node_[0].pd, &note)) << note;
  EXPECT_FALSE(probe_dmabuf(*node_[1].pd, &note));
  EXPECT_TRUE(contains(note, "provider or kernel without dma-buf")) << note;
  MemfdMapping dst(page_size());
  ASSERT_TRUE(dst.ok());
  auto mr = RegDmabuf(1, dst.fd(), 0, dst.size(), dst.iova());
  ASSERT_FALSE(mr.ok());
  EXPECT_TRUE(contains(mr.status().message(), "emu1")) << mr.status().message();
  EXPECT_TRUE(contains(mr.status().message(), "not supported")) << mr.status().message();
  EmulatedFabric::instance().set_dmabuf_supported("emu1", true);
  EXPECT_TRUE(RegDmabuf(1, dst.fd(), 0, dst.size(), dst.iova()).ok());
}

// The counting copier: records every call, then copies.
struct CopyLog {
  int calls = 0;
  size_t bytes = 0;
  void* last_dst = nullptr;
};
CopyLog g_copies;
void counting_copy(void* dst, const void* src, size_t n) {
  ++g_copies.calls;
  g_copies.bytes += n;
  g_copies.last_dst = dst;
  std::memcpy(dst, src, n);
}

TEST_F(Dmabuf, CopierCarriesEveryWrite) {
  MemfdMapping dst(page_size());
  ASSERT_TRUE(dst.ok());
  std::memset(dst.data(), 0, dst.size());
  ASSIGN_OK(rmr, RegDmabuf(1, dst.fd(), 0, dst.size(), dst.iova()));
  std::vector<uint8_t> src(256);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(255 - i);
  ASSIGN_OK(smr, MemoryRegion::create(*node_[0].pd, src.data(), src.size(), kAccess));
  Connect();
  g_copies = {};
  EmulatedFabric::instance().set_copier(&counting_copy);

  // WRITE_WITH_IMM through the wrapper: one copy, straight into the remote MR.
  ASSERT_TRUE(node_[1].qp->post_recv(1).ok());
  ASSERT_TRUE(node_[0].qp->post_write_with_imm(smr, 0, 100, rmr.addr() + 16, rmr.rkey(), 9, 1).ok());
  EXPECT_EQ(Drain(*node_[0].scq).at(0).status, IBV_WC_SUCCESS);
  EXPECT_EQ(g_copies.calls, 1);
  EXPECT_EQ(g_copies.bytes, 100u);
  EXPECT_EQ(g_copies.last_dst, dst.data() + 16);
  EXPECT_EQ(std::memcmp(dst.data() + 16, src.data(), 100), 0);

  // A plain WRITE with two SGEs through the table: one copy per SGE, back to back remotely.
  ibv_sge sges[2] = {{smr.addr() + 200, 20, smr.lkey()}, {smr.addr(), 10, smr.lkey()}};
  ibv_send_wr wr{};
  wr.wr_id = 2;
  wr.sg_list = sges;
  wr.num_sge = 2;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = rmr.addr() + 512;
  wr.wr.rdma.rkey = rmr.rkey();
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(emulated_ibv()->post_send(node_[0].qp->get(), &wr, &bad), 0);
  EXPECT_EQ(Drain(*node_[0].scq).at(0).status, IBV_WC_SUCCESS);
  EXPECT_EQ(g_copies.calls, 3);
  EXPECT_EQ(g_copies.bytes, 130u);
  EXPECT_EQ(std::memcmp(dst.data() + 512, src.data() + 200, 20), 0);
  EXPECT_EQ(std::memcmp(dst.data() + 532, src.data(), 10), 0);

  // Back to the default (memmove): the hook is no longer called.
  EmulatedFabric::instance().set_copier(nullptr);
  ASSERT_TRUE(node_[1].qp->post_recv(3).ok());
  ASSERT_TRUE(node_[0].qp->post_write_with_imm(smr, 0, 8, rmr.addr(), rmr.rkey(), 3, 3).ok());
  EXPECT_EQ(Drain(*node_[0].scq).at(0).status, IBV_WC_SUCCESS);
  EXPECT_EQ(g_copies.calls, 3);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), 8), 0);
  node_[0].mrs.push_back(std::move(smr));
  node_[1].mrs.push_back(std::move(rmr));
}

// The real libibverbs (dlopen): rdma-core >= 34 has ibv_reg_dmabuf_mr, so the optional entry
// is filled. Needs no device. Skips where libibverbs.so.1 is not installed.
TEST(LoadLibibverbs, ResolvesRegDmabufMrWhenPresent) {
  auto api = load_libibverbs();
  if (!api.ok()) GTEST_SKIP() << api.status().to_string();
  if ((*api)->reg_dmabuf_mr == nullptr) {
    ASSERT_NE((*api)->reg_dmabuf_mr_missing, nullptr);
    GTEST_SKIP() << (*api)->reg_dmabuf_mr_missing;
  }
  EXPECT_EQ((*api)->reg_dmabuf_mr_missing, nullptr);
}

}  // namespace
}  // namespace gradsync::verbs
