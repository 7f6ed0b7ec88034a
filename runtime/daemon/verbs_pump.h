// Cross-node channels over RDMA verbs (design §3, issue 5): the daemon's pumps, with the same
// shape as the TCP ones (proxy.h) but moving slots with one-sided writes on an RC QP.
//
// Per cross-node channel there is one RC QP pair, set up through the channel's TCP bootstrap
// connection (the peer daemon's address comes from the coordinator's peer table; QPN, PSN,
// GID/LID, MTU and the memory keys of this one channel travel over that connection, as NCCL's
// bootstrap does, because they exist only once both daemons created the QP). After set-up:
//
//   sender daemon (staging channel, its shm)          receiver daemon (incoming channel, its shm)
//     RDMA WRITE   SlotMeta -> meta[seq % slots]  ──►   (placed by the NIC)
//     WRITE_WITH_IMM payload -> slot[seq % slots] ──►   recv completion, imm = tag<<24 | seq:
//                                                       checked, then tail++ (publish_landed)
//     credit word  ◄── RDMA WRITE of `head` ────────    when the local rank released slots
//
// RC delivers the meta before the payload's completion, so a published slot is complete. The
// sender posts a slot only while `sent - credit < slots` (a free slot at the receiver) and
// `sent - completed < slots` (send queue: 2 WRs per slot, sized for it); the receiver keeps one
// receive posted per slot it can be sent (`slots`), reposting as each arrives, so a correct
// peer never meets an RNR. Every completion is checked: an error completion fails the channel
// with the peer's name and ibv_wc_status_str, and the daemon aborts the job (as a lost TCP
// connection does). The bootstrap connection stays open: the sender says Bye on it (with its
// slot count, so the receiver drains its CQ first); EOF without Bye means the peer daemon died.
//
// The pumps poll their CQ (and the credit word) with a short back-off to a 1 ms sleep when
// idle: the emulated fabric has no completion channels (emulated_fabric.h). With a real NIC an
// ibv_comp_channel would let an idle pump block; that has not been built.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "daemon/proxy.h"
#include "daemon/verbs_wire.h"
#include "transport/verbs/node.h"

namespace gradsync {


// Registers a job's shared memory (every channel's counters, metas and slots) for local use
// only: the source of the sending pumps' writes. What a peer may write is registered per
// channel by its receiving pump (VerbsPump::register_windows).
Result<std::shared_ptr<verbs::MemoryRegion>> register_job_memory(const VerbsNode& node,
                                                                  SharedMemory& shm);

class VerbsPump : public ChannelPump {
 public:
  // `sock` is the channel's bootstrap connection whose Hello (transport kVerbs) was accepted
  // (sender) or has just been read and answered OK (receiver). Each call exchanges endpoint
  // blobs over it, takes the QP to RTS and starts the pump's thread. `tag` is the channel tag
  // carried in every immediate.
  static Result<std::unique_ptr<VerbsPump>> start_sender(std::shared_ptr<VerbsNode> node,
                                                         std::shared_ptr<verbs::MemoryRegion> job_mr,
                                                         PumpContext ctx, uint32_t tag, Fd sock,
                                                         PumpFailure on_failure, Deadline deadline);
  static Result<std::unique_ptr<VerbsPump>> start_receiver(std::shared_ptr<VerbsNode> node,
                                                           std::shared_ptr<verbs::MemoryRegion> job_mr,
                                                           PumpContext ctx, uint32_t tag, Fd sock,
                                                           PumpFailure on_failure, Deadline deadline);
  ~VerbsPump() override;

  void stop_and_join() override;
  bool is_sender() const override { return sender_; }
  bool finished() const override { return finished_.load(std::memory_order_acquire); }

  // The QP, for fault-injection tests.
  ibv_qp* qp() const { return qp_.get(); }

 private:
  VerbsPump() = default;
  static std::unique_ptr<VerbsPump> make(std::shared_ptr<VerbsNode> node,
                                         std::shared_ptr<verbs::MemoryRegion> job_mr, PumpContext ctx,
                                         uint32_t tag, Fd sock, bool sender);
  Status register_words(size_t n, int access);
  // Receiver: the only memory a peer may write, this channel's receive slots and their
  // metadata, each its own region with keys made for this pump (so for this generation of the
  // job; deregistered with it) and sent to the peer after the authenticated Hello.
  Status register_windows(const Channel& ch);
  // This end's set-up blob: its QP, `rkey` over `addr` (and `meta_rkey` over `meta_addr`),
  // the geometry.
  VerbsBlob blob(uint32_t psn, uint32_t rkey, uint64_t addr, uint64_t meta_addr, uint32_t meta_rkey) const;
  Status create_qp(uint32_t recv_depth);
  void start_thread(PumpFailure on_failure);
  void send_loop(const PumpFailure& on_failure);
  void recv_loop(const PumpFailure& on_failure);

  std::shared_ptr<VerbsNode> node_;
  std::shared_ptr<verbs::MemoryRegion> job_mr_;
  PumpContext ctx_;
  uint32_t tag_ = 0;
  Fd sock_;
  bool sender_ = false;
  // Small registered buffer: the sender's credit word (the peer writes it), or the receiver's
  // ring of credit values being written (each must stay put until its write completes).
  std::unique_ptr<uint32_t[]> words_;
  verbs::MemoryRegion words_mr_;
  verbs::MemoryRegion slots_mr_;  // receiver: its channel's slots, remote-writable
  verbs::MemoryRegion metas_mr_;  // receiver: their SlotMetas, remote-writable
  // The peer's side: sender -> the receiver's slot 0 and meta 0; receiver -> the credit word.
  uint64_t remote_addr_ = 0;
  uint64_t remote_meta_ = 0;
  uint32_t remote_rkey_ = 0;
  uint32_t remote_meta_rkey_ = 0;  // sender: the key of the receiver's metadata window
  verbs::CompletionQueue cq_;
  verbs::QueuePair qp_;  // declared after cq_: destroyed before it
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

}  // namespace gradsync
