// RAII wrappers over the IbvApi table: every verbs object is a unique_ptr with a deleter that
// calls back through the same table, made by a create/open factory returning Result.
// Destruction order is the caller's: QPs before CQs and MRs, those before the PD, the PD
// before the Context (declare them in that reverse order).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gradsync/status.h"
#include "transport/verbs/ibv_api.h"

namespace gradsync::verbs {

template <typename T, auto Destroy>
struct IbvDeleter {
  const IbvApi* api = nullptr;
  void operator()(T* obj) const;
};

struct PortInfo {
  ibv_port_state state = IBV_PORT_NOP;
  uint8_t link_layer = IBV_LINK_LAYER_UNSPECIFIED;  // IBV_LINK_LAYER_INFINIBAND / _ETHERNET
  ibv_mtu active_mtu = IBV_MTU_1024;
  uint16_t lid = 0;
  int gid_tbl_len = 0;
  bool is_ethernet() const { return link_layer == IBV_LINK_LAYER_ETHERNET; }
};

struct DeviceInfo {
  std::string name;
  std::vector<PortInfo> ports;  // ports[i] is port i + 1; empty if the device did not open
};

class Context {
 public:
  // Opens `device`, or the first device when empty. Errors list the devices seen.
  static Result<Context> open(const IbvApi* api, const std::string& device = "");
  ibv_context* get() const { return ctx_.get(); }
  const IbvApi* api() const { return api_; }
  const std::string& name() const { return name_; }

 private:
  const IbvApi* api_ = nullptr;
  std::string name_;
  std::unique_ptr<ibv_context, IbvDeleter<ibv_context, &IbvApi::close_device>> ctx_;
};

Result<PortInfo> query_port(const Context& ctx, uint8_t port);
Result<std::vector<DeviceInfo>> list_devices(const IbvApi* api);

struct GidChoice {
  int index = 0;
  ibv_gid gid{};
};
// RoCE: the first RoCE v2 (when the GID type is readable) IPv4-mapped GID (::ffff:a.b.c.d),
// never zero or link-local fe80::. IB: index 0. override_index >= 0 is taken as given (checked
// against the table and for a zero GID), like NCCL_IB_GID_INDEX.
Result<GidChoice> select_gid(const Context& ctx, uint8_t port, int override_index = -1);

class ProtectionDomain {
 public:
  static Result<ProtectionDomain> create(const Context& ctx);
  ibv_pd* get() const { return pd_.get(); }
  const IbvApi* api() const { return api_; }
  const std::string& device() const { return device_; }

 private:
  const IbvApi* api_ = nullptr;
  std::string device_;
  std::unique_ptr<ibv_pd, IbvDeleter<ibv_pd, &IbvApi::dealloc_pd>> pd_;
};

class MemoryRegion {
 public:
  // Registers host memory [addr, addr + length) with IBV_ACCESS_* flags.
  static Result<MemoryRegion> create(const ProtectionDomain& pd, void* addr, size_t length,
                                     int access);
  // Registers bytes [offset, offset + length) of the dma-buf `fd` (GPU memory exported by
  // cuMemGetHandleForAddressRange), reached through the keys at [iova, iova + length); iova
  // must have the same page offset as offset (pass the GPU virtual address, as NCCL does).
  // The fd stays the caller's (gpu/gpu_memory_registration.h keeps it open while the MR
  // lives). kUnavailable when the table has no reg_dmabuf_mr (rdma-core < 34) or the
  // device/kernel refuses dma-buf (EOPNOTSUPP, EPROTONOSUPPORT).
  static Result<MemoryRegion> create_dmabuf(const ProtectionDomain& pd, int fd, uint64_t offset,
                                            size_t length, uint64_t iova, int access);
  ibv_mr* get() const { return mr_.get(); }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }
  // Where the keys address the MR: addr for create, iova for create_dmabuf (rdma-core stores
  // the dma-buf offset in ibv_mr::addr, so that field is not used).
  uint64_t addr() const { return base_; }
  size_t length() const { return mr_->length; }

 private:
  uint64_t base_ = 0;
  std::unique_ptr<ibv_mr, IbvDeleter<ibv_mr, &IbvApi::dereg_mr>> mr_;
};

// Whether the device of `pd` registers dma-buf memory, probed as NCCL does: ibv_reg_dmabuf_mr
// with fd -1. A provider and kernel with dma-buf MRs refuse the fd (EBADF, or EINVAL for a
// check that comes first): true. EOPNOTSUPP / EPROTONOSUPPORT, or a table without the entry
// (rdma-core < 34): false. *note says which, for gradsyncctl doctor. An MR made by a broken
// provider is deregistered at once and counts as supported.
bool probe_dmabuf(const ProtectionDomain& pd, std::string* note);

class CompletionQueue {
 public:
  static Result<CompletionQueue> create(const Context& ctx, int entries);
  ibv_cq* get() const { return cq_.get(); }
  // Non-blocking: returns how many entries of `out` were filled (0 when none is ready).
  Result<int> poll(std::span<ibv_wc> out) const;

 private:
  const IbvApi* api_ = nullptr;
  std::unique_ptr<ibv_cq, IbvDeleter<ibv_cq, &IbvApi::destroy_cq>> cq_;
};

// What the peer sends us out of band to connect an RC QP.
struct PeerAddress {
  uint32_t qpn = 0;
  uint32_t psn = 0;  // 24 bits
  uint16_t lid = 0;  // IB only; 0 on RoCE
  ibv_gid gid{};     // RoCE (and IB across subnets)
  ibv_mtu mtu = IBV_MTU_1024;
};

struct QpCaps {
  uint32_t max_send_wr = 128;  // outstanding sends; a ring step posts a few per peer
  uint32_t max_recv_wr = 128;  // posted receives, one per expected WRITE_WITH_IMM
  uint32_t max_send_sge = 1;   // scatter/gather entries per send: slots are contiguous
  uint32_t max_recv_sge = 1;
  uint32_t max_inline_data = 0;  // bytes; no inline sends yet
};

class QueuePair {
 public:
  // An RC QP on `pd`; `peer` (e.g. "rank 3 host node-b") is named in every error.
  static Result<QueuePair> create_rc(const ProtectionDomain& pd, const CompletionQueue& send_cq,
                                     const CompletionQueue& recv_cq, const QpCaps& caps,
                                     std::string peer);
  ibv_qp* get() const { return qp_.get(); }
  uint32_t qpn() const { return qp_->qp_num; }

  Status to_init(uint8_t port, int access);
  // sgid_index < 0: IB routing by LID without GRH; otherwise a GRH with that local GID.
  Status to_rtr(const PeerAddress& peer, ibv_mtu local_active_mtu, int sgid_index);
  Status to_rts(uint32_t psn);

  // WRITE_WITH_IMM of local[offset, offset + len) to remote_addr; imm in host order.
  Status post_write_with_imm(const MemoryRegion& local, size_t offset, size_t len,
                             uint64_t remote_addr, uint32_t rkey, uint32_t imm, uint64_t wr_id);
  // RDMA WRITE (no immediate, no receive consumed at the peer). Unsignaled writes complete
  // silently; their send-queue entries are freed by the next signaled completion.
  Status post_write(const MemoryRegion& local, size_t offset, size_t len, uint64_t remote_addr,
                    uint32_t rkey, uint64_t wr_id, bool signaled);
  // A zero-length receive, consumed by one incoming WRITE_WITH_IMM.
  Status post_recv(uint64_t wr_id);

  // kOk for a successful completion, else kAborted naming the QP, device, peer and status.
  Status check(const ibv_wc& wc) const;

 private:
  Status modify(ibv_qp_attr& attr, int mask, const char* what);
  Status post_rdma(ibv_wr_opcode opcode, const MemoryRegion& local, size_t offset, size_t len,
                   uint64_t remote_addr, uint32_t rkey, uint32_t imm, uint64_t wr_id, bool signaled);
  std::string where() const;

  const IbvApi* api_ = nullptr;
  std::string device_;
  std::string peer_;
  uint8_t port_ = 0;
  std::unique_ptr<ibv_qp, IbvDeleter<ibv_qp, &IbvApi::destroy_qp>> qp_;
};

}  // namespace gradsync::verbs
