// EmulatedFabric: an in-process RDMA fabric behind the IbvApi table — a TEST DOUBLE.
//
// Nothing here has run on a real NIC; it models the parts of RC verbs semantics our transport
// relies on, so that transport logic and error handling are testable on machines without an
// RDMA device (CI, the H200 VM). What is modelled:
//   * devices / ports (state, active MTU, LID, GID table with RoCE v1/v2 types laid out like
//     mlx5: 0 fe80 v1, 1 fe80 v2, 2 ::ffff:a.b.c.d v1, 3 ::ffff:a.b.c.d v2);
//   * PDs, MRs (lkey/rkey, bounds, access flags), CQs, RC QPs with the state machine
//     RESET->INIT->RTR->RTS (required attribute masks checked) and ERROR;
//   * dma-buf MRs (reg_dmabuf_mr), see "dma-buf MRs" below;
//   * RDMA WRITE / WRITE_WITH_IMM (a copy into the peer's MR) and SEND / SEND_WITH_IMM,
//     addressed by the dest QPN + GID (RoCE) or LID (IB) given at RTR. Every byte the fabric
//     moves goes through one copy function (set_copier; memmove by default);
//   * error completions: REM_ACCESS_ERR (rkey/bounds/access), LOC_PROT_ERR (lkey),
//     RNR_RETRY_EXC_ERR (no posted receive), RETRY_EXC_ERR (link down / peer gone),
//     WR_FLUSH_ERR (everything posted to, or pending on, a QP in ERROR).
// Not modelled: timing (all work completes synchronously inside post_send, there is no
// background thread), RNR/transport retries (an RNR is an error at once), CQ overrun,
// async events, SRQs, READ/atomics, completion channels, PSN checks, max_send_wr limits.
// Thread-safe: one mutex guards the whole fabric (the copy function runs under it).
//
// dma-buf MRs. reg_dmabuf_mr(pd, offset, length, iova, fd, access) cannot map the dma-buf
// (a real NIC reaches the exporter's pages through the kernel; this process has no such
// path), so the emulation takes `iova` as the address of the bytes in this process: the
// caller passes the virtual address of the exported range, as NCCL and perftest do with the
// GPU VA, and a host mapping in CPU tests. What it checks, each failing with NULL + errno:
//   EBADF   fd is not an open file descriptor (fstat). Any open fd is accepted: the kernel
//           would also refuse one that is not a dma-buf (EINVAL); the emulation cannot tell;
//   EINVAL  unknown PD; length 0; access flags outside LOCAL_WRITE, REMOTE_WRITE,
//           REMOTE_READ, REMOTE_ATOMIC, RELAXED_ORDERING (the man page's list), or
//           REMOTE_WRITE without LOCAL_WRITE; iova and offset with different page offsets;
//           offset + length past the fd's size (when fstat reports one: memfd, dma-buf);
//           an iova range that cannot be a user address here (0, wrapping, or above 2^57,
//           since the emulation dereferences it).
// As rdma-core does (libibverbs/verbs.c), the returned ibv_mr's addr field holds `offset`,
// not iova; keys address the MR by iova. The fd is only checked, never kept or read: the
// caller owns it. is_device_memory() tells such an MR from an ibv_reg_mr one. With real GPU
// buffers, install a copier that can reach them (cudaMemcpy with cudaMemcpyDefault): the
// default memmove would fault on a device pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/verbs/ibv_api.h"

namespace gradsync::verbs {

enum class LinkLayer { kInfiniBand, kEthernet };

class EmulatedFabric {
 public:
  static EmulatedFabric& instance();

  // Adds a device with ports 1..num_ports, all ACTIVE. Ethernet ports get the 4-entry RoCE GID
  // table above (IPv4 10.<device#>.<port>.1) and LID 0; IB ports a LID and GID 0 only.
  void add_device(const std::string& name, int num_ports, LinkLayer link_layer);
  // Takes a port down (or back up). Sends to or from it then fail with RETRY_EXC_ERR.
  void set_link_state(const std::string& device, uint8_t port, bool up);
  void set_link_down(const std::string& device, uint8_t port) { set_link_state(device, port, false); }
  // Makes the device answer reg_dmabuf_mr with EOPNOTSUPP (a NIC or driver without dma-buf
  // support), or accept it again.
  void set_dmabuf_supported(const std::string& device, bool supported);
  // Moves a QP to ERROR as a fatal NIC event would; its receives are flushed.
  void force_qp_error(ibv_qp* qp);
  // Moves every QP opened on `device` to ERROR (a NIC reset, seen by a process that cannot
  // reach the QP handles); returns how many.
  int force_device_qp_errors(const std::string& device);
  // The QP's current state, including transitions the fabric made (errors).
  ibv_qp_state qp_state(ibv_qp* qp);
  // Removes all devices. Every object opened on them must have been destroyed already.
  // The copier is left as it is.
  void reset();

  // The function through which every WRITE, WRITE_WITH_IMM and SEND moves bytes (gathering
  // the local SGEs and placing them in the remote MR or receive buffers). Default: memmove
  // (memcpy semantics, also right for a loopback write onto overlapping bytes); nullptr
  // restores it. A GPU test installs one that calls cudaMemcpy(dst, src, n,
  // cudaMemcpyDefault) so the fabric moves real GPU buffers; it runs under the fabric lock
  // and must not call back into the fabric.
  using Copier = void (*)(void* dst, const void* src, size_t n);
  void set_copier(Copier copier);
  // True for an MR made by reg_dmabuf_mr ("device memory"), false for reg_mr or unknown.
  bool is_device_memory(ibv_mr* mr);

  // For tests of what a process exposes (docs/security.md, attack 3): every MR on `device`
  // that a peer may write (IBV_ACCESS_REMOTE_WRITE), with the address range its rkey reaches.
  struct RemoteWindow {
    uint64_t addr = 0;
    size_t length = 0;
    uint32_t rkey = 0;
  };
  std::vector<RemoteWindow> remote_windows(const std::string& device);
  // Every QP opened on `device` that is connected and can send (RTS): a test playing a peer
  // that went bad posts on one.
  std::vector<ibv_qp*> sending_qps(const std::string& device);

 private:
  EmulatedFabric() = default;
};

// The table over EmulatedFabric::instance().
const IbvApi* emulated_ibv();

}  // namespace gradsync::verbs
