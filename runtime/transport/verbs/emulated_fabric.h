// EmulatedFabric: an in-process RDMA fabric behind the IbvApi table — a TEST DOUBLE.
//
// Nothing here has run on a real NIC; it models the parts of RC verbs semantics our transport
// relies on, so that transport logic and error handling are testable on machines without an
// RDMA device (CI, the H200 VM). What is modelled:
//   * devices / ports (state, active MTU, LID, GID table with RoCE v1/v2 types laid out like
//     mlx5: 0 fe80 v1, 1 fe80 v2, 2 ::ffff:a.b.c.d v1, 3 ::ffff:a.b.c.d v2);
//   * PDs, MRs (lkey/rkey, bounds, access flags), CQs, RC QPs with the state machine
//     RESET->INIT->RTR->RTS (required attribute masks checked) and ERROR;
//   * RDMA WRITE / WRITE_WITH_IMM (memcpy into the peer's MR) and SEND / SEND_WITH_IMM,
//     addressed by the dest QPN + GID (RoCE) or LID (IB) given at RTR;
//   * error completions: REM_ACCESS_ERR (rkey/bounds/access), LOC_PROT_ERR (lkey),
//     RNR_RETRY_EXC_ERR (no posted receive), RETRY_EXC_ERR (link down / peer gone),
//     WR_FLUSH_ERR (everything posted to, or pending on, a QP in ERROR).
// Not modelled: timing (all work completes synchronously inside post_send, there is no
// background thread), RNR/transport retries (an RNR is an error at once), CQ overrun,
// async events, SRQs, READ/atomics, completion channels, PSN checks, max_send_wr limits.
// Thread-safe: one mutex guards the whole fabric.
#pragma once

#include <cstdint>
#include <string>

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
  // Moves a QP to ERROR as a fatal NIC event would; its receives are flushed.
  void force_qp_error(ibv_qp* qp);
  // The QP's current state, including transitions the fabric made (errors).
  ibv_qp_state qp_state(ibv_qp* qp);
  // Removes all devices. Every object opened on them must have been destroyed already.
  void reset();

 private:
  EmulatedFabric() = default;
};

// The table over EmulatedFabric::instance().
const IbvApi* emulated_ibv();

}  // namespace gradsync::verbs
