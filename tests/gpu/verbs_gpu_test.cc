// GPU memory through the verbs path: register_gpu_memory (dma-buf from the real CUDA driver)
// on two emulated RoCE devices ("two nodes"), RC QPs connected INIT->RTR->RTS with the verbs.h
// wrappers, and WRITE_WITH_IMM moving a pattern GPU -> GPU in slot-sized pieces with receives
// posted first. The emulated fabric is a test double (emulated_fabric.h): the fd and iova are
// checked, and the bytes are moved by the copier installed here, cudaMemcpy(cudaMemcpyDefault),
// not by a NIC. So the bandwidth table is an emulated-fabric figure (a device-to-device copy per
// piece plus the fabric's bookkeeping), not a GPUDirect RDMA measurement.
//
// ctest label gpu. Each test skips itself when cudaGetDeviceCount finds no device, except
// HostPointerIsRefused and NoDriverFailsCleanly, which also run (and check the errors) there.
// On the H200 machine: build-*/bin/verbs_gpu_test --gtest_filter='VerbsGpu*'
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "gpu/gpu_memory_registration.h"
#include "transport/verbs/emulated_fabric.h"
#include "transport/verbs/verbs.h"

namespace gradsync {
namespace {

using verbs::CompletionQueue;
using verbs::Context;
using verbs::EmulatedFabric;
using verbs::MemoryRegion;
using verbs::ProtectionDomain;
using verbs::QueuePair;

constexpr uint8_t kPort = 1;
constexpr uint32_t kPsn = 0x1357;
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
constexpr uint32_t kWindow = 64;  // receives posted ahead = writes in flight (the credits)

bool have_gpu() {
  static const bool has = [] {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e == cudaSuccess && count > 0;
  }();
  return has;
}

int gpu_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount)"

#define CUDA_ASSERT(expr)                                                  \
  do {                                                                     \
    const cudaError_t e_ = (expr);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

#define ASSIGN_OK(lhs, expr)                                  \
  auto lhs##_r = (expr);                                      \
  ASSERT_TRUE(lhs##_r.ok()) << lhs##_r.status().to_string(); \
  auto lhs = std::move(lhs##_r).value()

// The fabric's copier for GPU buffers. A device-to-device cudaMemcpy may return before the
// copy is done, and the fabric completes the WRITE as soon as the copier returns, so the copy
// is waited for here (the legacy default stream of the current device, where cudaMemcpy
// queued it): a completion then means the bytes are there, as with a NIC. Errors are kept for
// the test to check (the fabric has no way to fail a copy).
std::atomic<int> g_copy_errors{0};
std::atomic<long> g_copy_calls{0};
void cuda_copy(void* dst, const void* src, size_t n) {
  g_copy_calls.fetch_add(1, std::memory_order_relaxed);
  if (cudaMemcpy(dst, src, n, cudaMemcpyDefault) != cudaSuccess || cudaStreamSynchronize(nullptr) != cudaSuccess) {
    (void)cudaGetLastError();
    g_copy_errors.fetch_add(1, std::memory_order_relaxed);
  }
}

// cudaMalloc'd bytes, freed on destruction.
struct DeviceBuffer {
  explicit DeviceBuffer(int device, size_t bytes) : device(device), bytes(bytes) {
    if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&ptr, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      ptr = nullptr;
    }
  }
  ~DeviceBuffer() {
    if (ptr) {
      cudaSetDevice(device);
      cudaFree(ptr);
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(ptr); }
  int device;
  size_t bytes;
  void* ptr = nullptr;
};

std::vector<uint8_t> pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> out(bytes);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < bytes; ++i) {
    x = x * 1664525u + 1013904223u;
    out[i] = static_cast<uint8_t>(x >> 24);
  }
  return out;
}

struct Node {
  int gpu = 0;
  std::optional<Context> ctx;
  std::optional<ProtectionDomain> pd;
  std::optional<CompletionQueue> scq, rcq;
  std::optional<QueuePair> qp;
  std::vector<GpuRegistration> regs;  // released before the PD
  void release() {
    qp.reset();
    scq.reset();
    rcq.reset();
    regs.clear();
    pd.reset();
    ctx.reset();
  }
};

class VerbsGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    EmulatedFabric::instance().reset();
    EmulatedFabric::instance().add_device("roce0", 1, verbs::LinkLayer::kEthernet);
    EmulatedFabric::instance().add_device("roce1", 1, verbs::LinkLayer::kEthernet);
    if (have_gpu()) EmulatedFabric::instance().set_copier(&cuda_copy);
    g_copy_errors = 0;
    g_copy_calls = 0;
    const int gpus = have_gpu() ? gpu_count() : 1;
    for (int i = 0; i < 2; ++i) {
      Node& n = node_[i];
      n.gpu = i % gpus;  // two GPUs: node 0 on GPU 0, node 1 on GPU 1; else both on GPU 0
      ASSIGN_OK(ctx, Context::open(verbs::emulated_ibv(), "roce" + std::to_string(i)));
      n.ctx.emplace(std::move(ctx));
      ASSIGN_OK(pd, ProtectionDomain::create(*n.ctx));
      n.pd.emplace(std::move(pd));
      ASSIGN_OK(scq, CompletionQueue::create(*n.ctx, 1024));
      ASSIGN_OK(rcq, CompletionQueue::create(*n.ctx, 1024));
      n.scq.emplace(std::move(scq));
      n.rcq.emplace(std::move(rcq));
      ASSIGN_OK(qp, QueuePair::create_rc(*n.pd, *n.scq, *n.rcq, verbs::QpCaps{},
                                         "node " + std::to_string(1 - i) + " (roce" + std::to_string(1 - i) + ")"));
      n.qp.emplace(std::move(qp));
    }
  }
  void TearDown() override {
    for (auto& n : node_) n.release();  // MRs deregistered and dma-buf fds closed ...
    for (auto& b : buf_) b.reset();     // ... before the memory is freed
    EmulatedFabric::instance().set_copier(nullptr);
  }
  // cudaMalloc'd buffers of both nodes, freed in TearDown after the registrations.
  bool Alloc(size_t bytes) {
    for (int i = 0; i < 2; ++i) {
      buf_[i].emplace(node_[i].gpu, bytes);
      if (!buf_[i]->ptr) return false;
    }
    return true;
  }
  void Connect() {
    for (auto& n : node_) ASSERT_TRUE(n.qp->to_init(kPort, kAccess).ok());
    for (int i = 0; i < 2; ++i) {
      Node& peer = node_[1 - i];
      ASSIGN_OK(port, verbs::query_port(*peer.ctx, kPort));
      ASSIGN_OK(gid, verbs::select_gid(*peer.ctx, kPort));
      ASSIGN_OK(local_gid, verbs::select_gid(*node_[i].ctx, kPort));
      verbs::PeerAddress addr{peer.qp->qpn(), kPsn, port.lid, gid.gid, port.active_mtu};
      Status s = node_[i].qp->to_rtr(addr, port.active_mtu, local_gid.index);
      ASSERT_TRUE(s.ok()) << s.to_string();
      ASSERT_TRUE(node_[i].qp->to_rts(kPsn).ok());
    }
  }
  // Registers on node i; skips the test when the GPU has no dma-buf at all.
  void Register(int i, void* ptr, size_t bytes, std::optional<GpuRegistration>* out) {
    auto r = register_gpu_memory(*node_[i].pd, ptr, bytes, kAccess);
    if (!r.ok() && r.status().message().find("DMA_BUF_SUPPORTED=0") != std::string::npos)
      GTEST_SKIP() << r.status().to_string();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    out->emplace(std::move(r).value());
  }
  // Moves bytes [0, bytes) of src to dst node 0 -> node 1 as WRITE_WITH_IMM pieces of `slot`
  // bytes, kWindow receives posted ahead; checks every completion and imm. Returns the number
  // of pieces; a failure is an ASSERT in the caller's test.
  void Transfer(const GpuRegistration& src, const GpuRegistration& dst, size_t bytes, size_t slot,
                uint32_t imm_base, size_t* pieces_out) {
    const size_t pieces = (bytes + slot - 1) / slot;
    const size_t src_off = src.ptr() - src.mr().addr();  // offset of the buffer in its MR
    std::array<ibv_wc, 64> wcs{};
    size_t posted = 0, received = 0;
    while (received < pieces) {
      const size_t batch = std::min<size_t>(kWindow, pieces - posted);
      for (size_t k = 0; k < batch; ++k)
        ASSERT_TRUE(node_[1].qp->post_recv(posted + k).ok());
      for (size_t k = 0; k < batch; ++k) {
        const size_t p = posted + k;
        const size_t off = p * slot, len = std::min(slot, bytes - off);
        Status s = node_[0].qp->post_write_with_imm(src.mr(), src_off + off, len, dst.ptr() + off,
                                                    dst.mr().rkey(), imm_base + static_cast<uint32_t>(p), p);
        ASSERT_TRUE(s.ok()) << s.to_string();
      }
      posted += batch;
      size_t sent = 0;
      while (sent < batch) {
        auto n = node_[0].scq->poll(wcs);
        ASSERT_TRUE(n.ok());
        ASSERT_GT(*n, 0) << "send completions missing";
        for (int j = 0; j < *n; ++j) ASSERT_TRUE(node_[0].qp->check(wcs[j]).ok()) << node_[0].qp->check(wcs[j]).to_string();
        sent += *n;
      }
      while (received < posted) {
        auto n = node_[1].rcq->poll(wcs);
        ASSERT_TRUE(n.ok());
        ASSERT_GT(*n, 0) << "receive completions missing";
        for (int j = 0; j < *n; ++j) {
          const ibv_wc& wc = wcs[j];
          ASSERT_TRUE(node_[1].qp->check(wc).ok()) << node_[1].qp->check(wc).to_string();
          ASSERT_EQ(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
          ASSERT_EQ(wc.wr_id, received) << "receives complete in order";
          ASSERT_EQ(ntohl(wc.imm_data), imm_base + static_cast<uint32_t>(received));
          ASSERT_EQ(wc.byte_len, std::min(slot, bytes - received * slot));
          ++received;
        }
      }
    }
    // Before anything on the receiving GPU reads the slots: flush where ordering needs it.
    if (!flush_needed_) {
      ASSIGN_OK(need, gdr_flush_needed(node_[1].gpu));
      flush_needed_ = need;
    }
    if (*flush_needed_) {
      ASSERT_EQ(cudaSetDevice(node_[1].gpu), cudaSuccess);
      Status f = flush_gdr_writes();
      ASSERT_TRUE(f.ok()) << f.to_string();
    }
    *pieces_out = pieces;
  }
  Node node_[2];
  std::optional<DeviceBuffer> buf_[2];
  std::optional<bool> flush_needed_;  // gdr_flush_needed of the receiving GPU, read once
};

TEST_F(VerbsGpu, DmaBufRegistrationAndWriteWithImmGpuToGpu) {
  REQUIRE_GPU();
  constexpr size_t kBytes = (8u << 20) + 12345;  // last piece short
  constexpr size_t kSlot = 1u << 20;
  constexpr size_t kLead = 1000;  // the buffers start inside a page: the export is aligned around them
  constexpr size_t kAlloc = kBytes + (64u << 10);  // the page-aligned range stays inside the allocation
  ASSERT_TRUE(Alloc(kAlloc)) << "cudaMalloc failed";
  DeviceBuffer& a = *buf_[0];
  DeviceBuffer& b = *buf_[1];
  std::optional<GpuRegistration> src, dst;
  Register(0, a.data() + kLead, kBytes, &src);
  if (IsSkipped()) return;
  Register(1, b.data() + kLead, kBytes, &dst);
  ASSERT_FALSE(HasFatalFailure());

  for (const GpuRegistration* r : {&*src, &*dst}) {
    EXPECT_EQ(r->method(), "dma-buf") << "the H200 has DMA_BUF_SUPPORTED=1; the emulated NIC takes the fd";
    EXPECT_TRUE(EmulatedFabric::instance().is_device_memory(r->mr().get()));
    ASSERT_GE(r->dmabuf_fd(), 0);
    EXPECT_NE(::fcntl(r->dmabuf_fd(), F_GETFD), -1) << "the registration keeps its fd open";
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    EXPECT_EQ(r->mr().addr() % page, 0u) << "iova = the page-aligned start";
    EXPECT_LE(r->mr().addr(), r->ptr());
    EXPECT_GE(r->mr().addr() + r->mr().length(), r->ptr() + r->bytes());
    char link[256] = {};
    const std::string fdpath = "/proc/self/fd/" + std::to_string(r->dmabuf_fd());
    const ssize_t n = ::readlink(fdpath.c_str(), link, sizeof(link) - 1);
    std::printf("GPU %d: %s, fd %d -> %s, MR 0x%llx + %zu bytes\n", r->device(), r->method().c_str(),
                r->dmabuf_fd(), n > 0 ? link : "?", static_cast<unsigned long long>(r->mr().addr()),
                r->mr().length());
  }
  node_[0].regs.push_back(std::move(*src));
  node_[1].regs.push_back(std::move(*dst));
  const GpuRegistration& s = node_[0].regs.back();
  const GpuRegistration& d = node_[1].regs.back();
  Connect();

  const std::vector<uint8_t> want = pattern(kBytes, 42);
  CUDA_ASSERT(cudaMemcpy(a.data() + kLead, want.data(), kBytes, cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemset(b.data(), 0xEE, kAlloc));
  size_t pieces = 0;
  Transfer(s, d, kBytes, kSlot, 0x10000, &pieces);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(pieces, 9u);
  EXPECT_EQ(g_copy_errors.load(), 0);
  EXPECT_EQ(g_copy_calls.load(), 9);

  std::vector<uint8_t> got(kAlloc);
  CUDA_ASSERT(cudaMemcpy(got.data(), b.data(), got.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(got.data() + kLead, want.data(), kBytes), 0) << "pattern on the receiving GPU";
  EXPECT_EQ(got[kLead - 1], 0xEE) << "nothing before the buffer";
  EXPECT_EQ(got[kLead + kBytes], 0xEE) << "nothing after it";

  ASSIGN_OK(need, gdr_flush_needed(node_[1].gpu));
  std::printf("GPU %d: GPU_DIRECT_RDMA_WRITES_ORDERING %s -> flush %s\n", node_[1].gpu,
              need ? "below OWNER" : "OWNER or wider", need ? "needed (done after each transfer)" : "not needed");
  // Called once either way: the entry point resolves, and on OWNER it is a no-op.
  CUDA_ASSERT(cudaSetDevice(node_[1].gpu));
  Status f = flush_gdr_writes();
  EXPECT_TRUE(f.ok()) << f.to_string();
}

TEST_F(VerbsGpu, EmulatedWriteBandwidthTable) {
  REQUIRE_GPU();
  constexpr size_t kMax = 256u << 20;
  constexpr size_t kSlot = 4u << 20;
  ASSERT_TRUE(Alloc(kMax)) << "cudaMalloc failed";
  DeviceBuffer& a = *buf_[0];
  DeviceBuffer& b = *buf_[1];
  std::optional<GpuRegistration> src, dst;
  Register(0, a.ptr, kMax, &src);
  if (IsSkipped()) return;
  Register(1, b.ptr, kMax, &dst);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_EQ(src->method(), "dma-buf");
  node_[0].regs.push_back(std::move(*src));
  node_[1].regs.push_back(std::move(*dst));
  Connect();
  const std::vector<uint8_t> want = pattern(kMax, 7);
  CUDA_ASSERT(cudaMemcpy(a.ptr, want.data(), kMax, cudaMemcpyHostToDevice));

  std::printf("\nEMULATED FABRIC (test double): WRITE_WITH_IMM GPU %d -> GPU %d, %zu MiB slots, "
              "%u receives ahead.\nEach piece is moved by cudaMemcpy(cudaMemcpyDefault) inside "
              "post_send: this is NOT a NIC or GPUDirect RDMA figure.\n",
              node_[0].gpu, node_[1].gpu, kSlot >> 20, kWindow);
  std::printf("%12s %8s %10s %10s\n", "bytes", "pieces", "time_us", "GB/s");
  uint32_t imm = 0;
  for (size_t bytes = 1u << 20; bytes <= kMax; bytes *= 2) {
    const size_t slot = std::min(bytes, kSlot);
    const int iters = bytes >= (64u << 20) ? 5 : 20;
    size_t pieces = 0;
    Transfer(node_[0].regs[0], node_[1].regs[0], bytes, slot, imm, &pieces);  // warm-up
    ASSERT_FALSE(HasFatalFailure());
    imm += static_cast<uint32_t>(pieces);
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < iters; ++it) {
      Transfer(node_[0].regs[0], node_[1].regs[0], bytes, slot, imm, &pieces);
      ASSERT_FALSE(HasFatalFailure());
      imm += static_cast<uint32_t>(pieces);
    }
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
    std::printf("%12zu %8zu %10.1f %10.2f\n", bytes, pieces, us, bytes / us / 1e3);
    std::vector<uint8_t> got(bytes);
    CUDA_ASSERT(cudaMemcpy(got.data(), b.ptr, bytes, cudaMemcpyDeviceToHost));
    ASSERT_EQ(std::memcmp(got.data(), want.data(), bytes), 0) << bytes << " bytes";
  }
  EXPECT_EQ(g_copy_errors.load(), 0);
}

// Runs with and without a GPU: never a registration, always a clear error.
TEST_F(VerbsGpu, HostPointerIsRefused) {
  std::vector<uint8_t> host(1 << 20);
  auto r = register_gpu_memory(*node_[0].pd, host.data(), host.size(), kAccess);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().to_string();
  const std::string& m = r.status().message();
  char addr[32];
  std::snprintf(addr, sizeof(addr), "0x%llx", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(host.data())));
  EXPECT_NE(m.find(addr), std::string::npos) << m;
  if (have_gpu()) {
    EXPECT_NE(m.find("not CUDA device memory"), std::string::npos) << m;
    void* pinned = nullptr;
    CUDA_ASSERT(cudaMallocHost(&pinned, 4096));
    auto p = register_gpu_memory(*node_[0].pd, pinned, 4096, kAccess);
    cudaFreeHost(pinned);
    ASSERT_FALSE(p.ok());
    EXPECT_NE(p.status().message().find("pinned host memory"), std::string::npos) << p.status().message();
  }
  std::printf("%s\n", m.c_str());
  EXPECT_FALSE(register_gpu_memory(*node_[0].pd, nullptr, 16, kAccess).ok());
}

// Without a GPU (this binary does not link libcuda): the driver-backed calls fail with a
// reason instead of crashing or refusing to start.
TEST_F(VerbsGpu, NoDriverFailsCleanly) {
  if (have_gpu()) GTEST_SKIP() << "a CUDA device is present";
  auto need = gdr_flush_needed(0);
  EXPECT_FALSE(need.ok());
  Status f = flush_gdr_writes();
  EXPECT_FALSE(f.ok());
  std::printf("gdr_flush_needed: %s\nflush_gdr_writes: %s\n", need.status().to_string().c_str(),
              f.to_string().c_str());
}

}  // namespace
}  // namespace gradsync
