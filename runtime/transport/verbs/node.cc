#include "transport/verbs/node.h"

namespace gradsync {

Result<std::shared_ptr<VerbsNode>> VerbsNode::open(const verbs::IbvApi* api, const std::string& device,
                                                   uint8_t port, int gid_index) {
  auto node = std::make_shared<VerbsNode>();
  auto ctx = verbs::Context::open(api, device);
  if (!ctx.ok()) return ctx.status();
  node->ctx_ = std::move(ctx).value();
  auto info = verbs::query_port(node->ctx_, port);
  if (!info.ok()) return info.status();
  if (info->state != IBV_PORT_ACTIVE) {
    return Status(Code::kUnavailable, "verbs device " + node->ctx_.name() + " port " + std::to_string(port) +
                                          " is not ACTIVE (link down or cable?)");
  }
  node->port_ = port;
  node->info_ = *info;
  node->gid_rule_ = gid_index;
  if (info->is_ethernet()) {
    auto gid = verbs::select_gid(node->ctx_, port, gid_index);
    if (!gid.ok()) return gid.status();
    node->sgid_index_ = gid->index;
    node->gid_ = gid->gid;
  } else if (gid_index >= 0) {
    // InfiniBand inside a subnet routes by LID; a GID index asks for a GRH (across subnets).
    auto gid = verbs::select_gid(node->ctx_, port, gid_index);
    if (!gid.ok()) return gid.status();
    node->sgid_index_ = gid->index;
    node->gid_ = gid->gid;
  }
  auto pd = verbs::ProtectionDomain::create(node->ctx_);
  if (!pd.ok()) return pd.status();
  node->pd_ = std::move(pd).value();
  return node;
}

std::string VerbsNode::stand_in_refusal(const std::string& device) const {
  if (device == ctx_.name()) return "";
  auto other = open(ctx_.api(), device, port_, gid_rule_);
  if (!other.ok()) return other.status().message();
  const auto& o = **other;
  if (o.info_.link_layer != info_.link_layer) {
    return "verbs device " + device + " port " + std::to_string(port_) + " is " +
           (o.info_.is_ethernet() ? "RoCE" : "InfiniBand") + ", " + ctx_.name() + " is " +
           (info_.is_ethernet() ? "RoCE" : "InfiniBand");
  }
  if (o.sgid_index_ != sgid_index_) {
    return "verbs device " + device + " port " + std::to_string(port_) + " has GID index " +
           std::to_string(o.sgid_index_) + " where " + ctx_.name() + " has " + std::to_string(sgid_index_);
  }
  return "";
}

std::string VerbsNode::describe() const {
  static const int kMtuBytes[] = {0, 256, 512, 1024, 2048, 4096};
  int mtu = info_.active_mtu >= 1 && info_.active_mtu <= 5 ? kMtuBytes[info_.active_mtu] : 0;
  std::string addr = info_.is_ethernet() ? "RoCE, GID index " + std::to_string(sgid_index_)
                                         : "InfiniBand, LID " + std::to_string(info_.lid);
  return ctx_.name() + " port " + std::to_string(port_) + " (" + addr + ", MTU " + std::to_string(mtu) +
         ", " + ctx_.api()->name + ")";
}

}  // namespace gradsync
