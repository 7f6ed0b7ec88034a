#include "daemon/verbs_wire.h"

namespace gradsync {

Status check_blob(const VerbsBlob& b, const ShmLayout& layout, bool from_receiver) {
  auto bad = [](const std::string& what) {
    return Status(Code::kInvalidArgument, "malformed verbs endpoint blob: " + what);
  };
  if (b.magic != kBlobMagic) return bad("magic " + std::to_string(b.magic) + " (a gradsyncd of another version?)");
  if (b.qpn == 0 || b.qpn > 0xffffff) return bad("queue pair number " + std::to_string(b.qpn));
  if (b.psn > 0xffffff) return bad("packet sequence number " + std::to_string(b.psn));
  if (b.mtu < 1 || b.mtu > 5) return bad("mtu " + std::to_string(b.mtu));
  if (b.slots != layout.slots || b.slot_bytes != layout.slot_bytes) {
    return Status(Code::kInvalidArgument, "channel geometry differs (slots/slot_bytes " + std::to_string(b.slots) +
                                              "/" + std::to_string(b.slot_bytes) + " against " +
                                              std::to_string(layout.slots) + "/" +
                                              std::to_string(layout.slot_bytes) + ")");
  }
  if (b.addr == 0) return bad("no remote address");
  if (from_receiver && b.meta_addr == 0) return bad("no metadata address");
  if (!from_receiver && (b.meta_addr != 0 || b.meta_rkey != 0)) return bad("a sender offers metadata memory");
  return Status::Ok();
}

Status check_landed_slot(uint32_t imm, uint32_t tag, uint32_t seq, const SlotMeta& meta, uint32_t slot_bytes) {
  if (imm != slot_imm(tag, seq)) {
    return {Code::kInternal, "immediate " + std::to_string(imm >> 24) + "/" + std::to_string(imm & 0xffffff) +
                                 " where tag " + std::to_string(tag & 0xff) + " slot " +
                                 std::to_string(seq & 0xffffff) + " was due"};
  }
  if (meta.bytes > slot_bytes) {
    return {Code::kInternal, "a slot of " + std::to_string(meta.bytes) + " bytes into slots of " +
                                 std::to_string(slot_bytes)};
  }
  return Status::Ok();
}

}  // namespace gradsync
