// An opened RDMA device port: context, protection domain, and the address (LID or GID) this
// process uses on it. The daemons' verbs channels (daemon/verbs_pump.h) and the GPU
// communicator's GPUDirect ring (gpu/gdr_channels.h) both start from one.
#pragma once

#include <memory>
#include <string>

#include "gradsync/status.h"
#include "transport/verbs/verbs.h"

namespace gradsync {

class VerbsNode {
 public:
  // Opens `device` (first device when empty) on `port`; gid_index < 0 picks a RoCE v2
  // IPv4-mapped GID (verbs::select_gid), else takes it as given (GRADSYNC_IB_GID_INDEX).
  static Result<std::shared_ptr<VerbsNode>> open(const verbs::IbvApi* api, const std::string& device,
                                                 uint8_t port, int gid_index);
  // "mlx5_0 port 1 (RoCE, GID index 3, MTU 4096)" for logs.
  std::string describe() const;
  // Why another process of this node cannot use `device` in this one's place (a GPU rank's
  // own NIC, topology/rail_devices.h); "" when it can: it opens through the same library, its
  // port of the same number is ACTIVE, with the same link layer, and the GID rule this node
  // was opened with picks the same GID index on it, so peers address both alike.
  std::string stand_in_refusal(const std::string& device) const;

  const verbs::ProtectionDomain& pd() const { return pd_; }
  const verbs::Context& context() const { return ctx_; }
  uint8_t port() const { return port_; }
  const verbs::PortInfo& port_info() const { return info_; }
  int sgid_index() const { return sgid_index_; }  // -1 on InfiniBand (LID routing)
  const ibv_gid& gid() const { return gid_; }

 private:
  verbs::Context ctx_;
  verbs::ProtectionDomain pd_;  // declared after ctx_: released before it
  uint8_t port_ = 1;
  verbs::PortInfo info_;
  int sgid_index_ = -1;
  int gid_rule_ = -1;  // open's gid_index
  ibv_gid gid_{};
};

}  // namespace gradsync
