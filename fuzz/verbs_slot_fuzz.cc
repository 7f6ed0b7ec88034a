// libFuzzer target: what a receiving gradsyncd checks of a verbs channel's peer
// (daemon/verbs_wire.h): the peer's set-up blob, then slots as the peer's RDMA writes leave
// them in the incoming channel (the metadata it wrote, the immediate of the payload write),
// published and consumed as the rank would when the check passes.
//
// Input: a VerbsBlob, then records of {imm (4 bytes), SlotMeta} for consecutive slots.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "daemon/verbs_wire.h"
#include "fuzz_input.h"

namespace {

constexpr uint32_t kTag = 7;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static gradsync::fuzz::Region region(4, 4096);
  if (!region.shm || size < sizeof(gradsync::VerbsBlob)) return 0;
  gradsync::VerbsBlob blob;
  std::memcpy(&blob, data, sizeof(blob));
  data += sizeof(blob);
  size -= sizeof(blob);
  const bool from_receiver = blob.reserved & 1;
  if (gradsync::check_blob(blob, region.layout, from_receiver).ok()) {
    // What the sender then relies on: the receiver's geometry is its own.
    if (blob.slots != region.layout.slots || blob.slot_bytes != region.layout.slot_bytes) __builtin_trap();
    if (blob.qpn > 0xffffff || blob.psn > 0xffffff) __builtin_trap();
  }

  std::memset(region.shm->data(), 0, region.layout.total_bytes());
  gradsync::init_job_control(region.shm->data(), region.layout);
  gradsync::Channel ch(region.shm->data(), region.layout, 0);
  gradsync::WaitContext wait;
  wait.control = static_cast<const gradsync::JobControl*>(region.shm->data());
  wait.deadline = gradsync::Clock::now();
  constexpr size_t kRecord = sizeof(uint32_t) + sizeof(gradsync::SlotMeta);
  for (uint32_t seq = 0; size >= kRecord; ++seq, data += kRecord, size -= kRecord) {
    uint32_t imm;
    std::memcpy(&imm, data, sizeof(imm));
    std::memcpy(ch.slot_meta(seq), data + sizeof(imm), sizeof(gradsync::SlotMeta));  // as the NIC placed it
    const gradsync::SlotMeta meta = *ch.slot_meta(seq);
    if (!gradsync::check_landed_slot(imm, kTag, seq, meta, ch.slot_bytes()).ok()) break;
    ch.publish_landed();
    gradsync::SlotMeta got{};
    auto slot = ch.acquire_recv(wait, &got);
    if (!slot.ok()) __builtin_trap();  // a published slot is always there
    if (got.bytes > region.layout.slot_bytes) __builtin_trap();
    uint8_t sum = 0;  // read every payload byte the metadata claims (ASan checks the bounds)
    for (uint32_t b = 0; b < got.bytes; ++b) sum = static_cast<uint8_t>(sum ^ (*slot)[b]);
    asm volatile("" : : "r"(sum));
    ch.release();
  }
  return 0;
}
