// What two gradsyncds tell each other to run a channel over RDMA (docs/wire.md, "verbs"), and
// the checks a receiving daemon makes on what a peer's RDMA writes left in its memory. Kept
// apart from the pumps (verbs_pump.h) so that the fuzz target fuzz/verbs_slot_fuzz.cc runs
// these very checks on a buffer, without a device or a socket.
#pragma once

#include <cstdint>
#include <string>

#include "channel/channel.h"
#include "gradsync/status.h"

namespace gradsync {

constexpr uint32_t kBlobMagic = 0x47535632;  // "GSV2": per-channel regions with their own keys

// What each side sends, after the authenticated Hello, on the channel's bootstrap connection.
struct VerbsBlob {
  uint32_t magic;
  uint32_t qpn;         // 24 bits
  uint32_t psn;         // 24 bits
  uint32_t mtu;         // ibv_mtu: 1 (256) .. 5 (4096)
  uint16_t lid;         // InfiniBand; 0 on RoCE
  uint8_t link_layer;   // IBV_LINK_LAYER_*
  uint8_t reserved;
  uint32_t rkey;        // sender: its credit word's; receiver: its channel's receive slots'
  uint8_t gid[16];
  uint64_t addr;        // sender: its credit word; receiver: slot 0 of its incoming channel
  uint64_t meta_addr;   // receiver: meta[0] of its incoming channel; sender: 0
  uint32_t meta_rkey;   // receiver: its channel's metadata array's key; sender: 0
  uint32_t slots;
  uint32_t slot_bytes;
  uint32_t reserved2;
};
static_assert(sizeof(VerbsBlob) == 72, "VerbsBlob is a wire format: no padding");

// Whether a peer's blob can be used: magic, 24-bit QPN and PSN, an MTU the verbs enum knows,
// the channel geometry this side runs with, and addresses that are not zero (a receiver's
// slots and metadata; a sender offers no metadata). The error says which field is wrong; the caller names the peer.
Status check_blob(const VerbsBlob& b, const ShmLayout& layout, bool from_receiver);

// The immediate of a slot's payload write: the channel's tag (low 8 bits) and the slot's
// sequence number (24 bits).
inline uint32_t slot_imm(uint32_t tag, uint32_t seq) { return (tag & 0xff) << 24 | (seq & 0xffffff); }

// A receiving daemon's check of slot `seq`'s arrival: its immediate (host order) must be the
// one due, and the metadata the peer wrote must fit a slot (`meta`: one read of it). The error
// says what arrived; the caller names the peer.
Status check_landed_slot(uint32_t imm, uint32_t tag, uint32_t seq, const SlotMeta& meta, uint32_t slot_bytes);

}  // namespace gradsync
