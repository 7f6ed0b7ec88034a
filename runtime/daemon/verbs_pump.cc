#include "daemon/verbs_pump.h"

#include <arpa/inet.h>

#include <chrono>
#include <cstring>
#include <random>

#include "common/framing.h"
#include "common/log.h"
#include "daemon/verbs_wire.h"

namespace gradsync {

namespace {

// Credit writes in flight at once from a receiver (each has its own word in words_).
constexpr uint32_t kCreditRing = 16;
// Completions taken per poll.
constexpr int kPollBatch = 16;
// Back-off of a pump with nothing to do: polls without sleeping, then sleeps growing from
// kMinNap to kMaxNap; after kIdleAfter without progress it naps kIdleNap (an idle job costs
// about 1000 wake-ups a second per pump; see the header about completion channels).
constexpr int kBusyPolls = 64;
constexpr auto kMinNap = std::chrono::microseconds(5);
constexpr auto kMaxNap = std::chrono::microseconds(200);
constexpr auto kIdleAfter = std::chrono::milliseconds(50);
constexpr auto kIdleNap = std::chrono::milliseconds(1);
// How often a busy pump looks at its bootstrap connection (peer daemon gone?).
constexpr auto kSocketCheck = std::chrono::milliseconds(2);
// A receiver told Bye waits at most this long for the slots the sender said it completed.
constexpr auto kByeDrain = std::chrono::seconds(10);
// How long the sender's staging wait sleeps before it looks at `drain` and its socket.
constexpr auto kStagingSlice = std::chrono::milliseconds(50);


uint32_t random_psn() {
  static thread_local std::mt19937 rng(std::random_device{}());
  return rng() & 0xffffff;
}

// Sends our status, then (if OK) our blob.
Status send_blob(int sock, const Status& status, const VerbsBlob& blob) {
  GS_RETURN_IF_ERROR(proxy_reply(sock, status));
  if (!status.ok()) return status;
  return write_all(sock, &blob, sizeof(blob));
}

Result<VerbsBlob> read_blob(int sock, const ShmLayout& layout, bool from_receiver, Deadline deadline) {
  GS_RETURN_IF_ERROR(proxy_read_reply(sock, deadline));
  VerbsBlob b{};
  GS_RETURN_IF_ERROR(read_all(sock, &b, sizeof(b), deadline));
  GS_RETURN_IF_ERROR(check_blob(b, layout, from_receiver));
  return b;
}

verbs::PeerAddress peer_address(const VerbsBlob& b) {
  verbs::PeerAddress p;
  p.qpn = b.qpn;
  p.psn = b.psn;
  p.lid = b.lid;
  std::memcpy(p.gid.raw, b.gid, sizeof(b.gid));
  p.mtu = static_cast<ibv_mtu>(b.mtu);
  return p;
}

// Sleeps a little more each time nothing happened; reset on progress.
class Backoff {
 public:
  void progress() {
    polls_ = 0;
    nap_ = kMinNap;
    last_progress_ = Clock::now();
  }
  void idle() {
    if (++polls_ < kBusyPolls) return;
    if (Clock::now() - last_progress_ > kIdleAfter) {
      std::this_thread::sleep_for(kIdleNap);
      return;
    }
    std::this_thread::sleep_for(nap_);
    nap_ = std::min<std::chrono::microseconds>(nap_ * 2, kMaxNap);
  }

 private:
  int polls_ = 0;
  std::chrono::microseconds nap_ = kMinNap;
  Clock::time_point last_progress_ = Clock::now();
};

}  // namespace

Result<std::shared_ptr<verbs::MemoryRegion>> register_job_memory(const VerbsNode& node, SharedMemory& shm) {
  auto mr = verbs::MemoryRegion::create(node.pd(), shm.data(), shm.size(), IBV_ACCESS_LOCAL_WRITE);
  if (!mr.ok()) return mr.status();
  return std::make_shared<verbs::MemoryRegion>(std::move(mr).value());
}

// ---- VerbsPump ---------------------------------------------------------------------------
Status VerbsPump::create_qp(uint32_t recv_depth) {
  const uint32_t slots = ctx_.layout.slots;
  verbs::QpCaps caps;
  // Sender: a meta write and a payload write per slot, at most `slots` slots in flight.
  // Receiver: kCreditRing credit writes; `recv_depth` receives.
  caps.max_send_wr = sender_ ? 2 * slots : kCreditRing;
  caps.max_recv_wr = std::max<uint32_t>(recv_depth, 1);
  // Every signaled send and every receive can sit in the CQ at once.
  auto cq = verbs::CompletionQueue::create(node_->context(), int(caps.max_send_wr + caps.max_recv_wr));
  if (!cq.ok()) return cq.status();
  cq_ = std::move(cq).value();
  auto qp = verbs::QueuePair::create_rc(node_->pd(), cq_, cq_, caps, ctx_.peer);
  if (!qp.ok()) return qp.status();
  qp_ = std::move(qp).value();
  return qp_.to_init(node_->port(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
}

std::unique_ptr<VerbsPump> VerbsPump::make(std::shared_ptr<VerbsNode> node,
                                           std::shared_ptr<verbs::MemoryRegion> job_mr, PumpContext ctx,
                                           uint32_t tag, Fd sock, bool sender) {
  std::unique_ptr<VerbsPump> p(new VerbsPump());
  p->node_ = std::move(node);
  p->job_mr_ = std::move(job_mr);
  p->ctx_ = std::move(ctx);
  p->tag_ = tag;
  p->sock_ = std::move(sock);
  p->sender_ = sender;
  return p;
}

Status VerbsPump::register_words(size_t n, int access) {
  words_ = std::make_unique<uint32_t[]>(n);
  auto mr = verbs::MemoryRegion::create(node_->pd(), words_.get(), n * sizeof(uint32_t), access);
  if (!mr.ok()) return mr.status();
  words_mr_ = std::move(mr).value();
  return Status::Ok();
}

Status VerbsPump::register_windows(const Channel& ch) {
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  auto slots = verbs::MemoryRegion::create(node_->pd(), ch.slot_data(0),
                                           size_t{ctx_.layout.slots} * ctx_.layout.slot_bytes, access);
  if (!slots.ok()) return slots.status();
  auto metas = verbs::MemoryRegion::create(node_->pd(), ch.slot_meta(0), ctx_.layout.slots * sizeof(SlotMeta), access);
  if (!metas.ok()) return metas.status();
  slots_mr_ = std::move(slots).value();
  metas_mr_ = std::move(metas).value();
  return Status::Ok();
}

VerbsBlob VerbsPump::blob(uint32_t psn, uint32_t rkey, uint64_t addr, uint64_t meta_addr, uint32_t meta_rkey) const {
  const verbs::PortInfo& port = node_->port_info();
  VerbsBlob b{};
  b.magic = kBlobMagic;
  b.qpn = qp_.qpn();
  b.psn = psn;
  b.mtu = uint32_t(port.active_mtu);
  b.lid = port.lid;
  b.link_layer = port.link_layer;
  b.rkey = rkey;
  std::memcpy(b.gid, node_->gid().raw, sizeof(b.gid));
  b.addr = addr;
  b.meta_addr = meta_addr;
  b.meta_rkey = meta_rkey;
  b.slots = ctx_.layout.slots;
  b.slot_bytes = ctx_.layout.slot_bytes;
  return b;
}

Result<std::unique_ptr<VerbsPump>> VerbsPump::start_sender(std::shared_ptr<VerbsNode> node,
                                                           std::shared_ptr<verbs::MemoryRegion> job_mr,
                                                           PumpContext ctx, uint32_t tag, Fd sock,
                                                           PumpFailure on_failure, Deadline deadline) {
  auto p = make(std::move(node), std::move(job_mr), std::move(ctx), tag, std::move(sock), true);
  const int fd = p->sock_.get();
  auto fail = [&](const Status& s) {
    (void)proxy_reply(fd, s);  // tell the receiver why, if it still listens
    return Status(s.code(), "verbs set-up towards " + p->ctx_.peer + ": " + s.message());
  };

  // The credit word the receiver writes (one word; a cache line of room).
  if (Status st = p->register_words(16, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE); !st.ok()) return fail(st);
  if (Status s = p->create_qp(0); !s.ok()) return fail(s);
  const uint32_t psn = random_psn();
  const VerbsBlob mine = p->blob(psn, p->words_mr_.rkey(), p->words_mr_.addr(), 0, 0);
  GS_RETURN_IF_ERROR(send_blob(fd, Status::Ok(), mine));

  auto theirs = read_blob(fd, p->ctx_.layout, /*from_receiver=*/true, deadline);
  if (!theirs.ok()) {
    return Status(theirs.status().code(), "verbs set-up towards " + p->ctx_.peer + ": its gradsyncd: " +
                                              theirs.status().message());
  }
  if (Status s = p->qp_.to_rtr(peer_address(*theirs), p->node_->port_info().active_mtu, p->node_->sgid_index());
      !s.ok()) {
    return fail(s);
  }
  if (Status s = p->qp_.to_rts(psn); !s.ok()) return fail(s);
  p->remote_addr_ = theirs->addr;
  p->remote_meta_ = theirs->meta_addr;
  p->remote_rkey_ = theirs->rkey;
  p->remote_meta_rkey_ = theirs->meta_rkey;
  p->start_thread(std::move(on_failure));
  return p;
}

Result<std::unique_ptr<VerbsPump>> VerbsPump::start_receiver(std::shared_ptr<VerbsNode> node,
                                                             std::shared_ptr<verbs::MemoryRegion> job_mr,
                                                             PumpContext ctx, uint32_t tag, Fd sock,
                                                             PumpFailure on_failure, Deadline deadline) {
  auto p = make(std::move(node), std::move(job_mr), std::move(ctx), tag, std::move(sock), false);
  const int fd = p->sock_.get();
  auto theirs = read_blob(fd, p->ctx_.layout, /*from_receiver=*/false, deadline);
  if (!theirs.ok()) {
    return Status(theirs.status().code(), "verbs set-up from " + p->ctx_.peer + ": its gradsyncd: " +
                                              theirs.status().message());
  }
  auto fail = [&](const Status& s) {
    (void)proxy_reply(fd, s);
    return Status(s.code(), "verbs set-up from " + p->ctx_.peer + ": " + s.message());
  };
  const uint32_t slots = p->ctx_.layout.slots;
  if (Status st = p->register_words(kCreditRing, IBV_ACCESS_LOCAL_WRITE); !st.ok()) return fail(st);
  if (Status s = p->create_qp(slots); !s.ok()) return fail(s);
  // One receive per slot the sender may fill before it hears a credit, posted before RTR so
  // that no write can arrive first.
  for (uint32_t i = 0; i < slots; ++i) {
    if (Status s = p->qp_.post_recv(i); !s.ok()) return fail(s);
  }
  const uint32_t psn = random_psn();
  if (Status s = p->qp_.to_rtr(peer_address(*theirs), p->node_->port_info().active_mtu, p->node_->sgid_index());
      !s.ok()) {
    return fail(s);
  }
  if (Status s = p->qp_.to_rts(psn); !s.ok()) return fail(s);
  if (Status s = p->register_windows(Channel(p->ctx_.shm->data(), p->ctx_.layout, p->ctx_.channel)); !s.ok()) {
    return fail(s);
  }
  const VerbsBlob mine =
      p->blob(psn, p->slots_mr_.rkey(), p->slots_mr_.addr(), p->metas_mr_.addr(), p->metas_mr_.rkey());
  GS_RETURN_IF_ERROR(send_blob(fd, Status::Ok(), mine));
  p->remote_addr_ = theirs->addr;
  p->remote_rkey_ = theirs->rkey;
  p->start_thread(std::move(on_failure));
  return p;
}

void VerbsPump::start_thread(PumpFailure on_failure) {
  thread_ = std::thread([this, on_failure = std::move(on_failure)] {
    if (sender_) send_loop(on_failure); else recv_loop(on_failure);
    finished_.store(true, std::memory_order_release);
  });
}

VerbsPump::~VerbsPump() { stop_and_join(); }

void VerbsPump::stop_and_join() {
  if (thread_.joinable()) thread_.join();  // the loops watch ctx_.stop
}

void VerbsPump::send_loop(const PumpFailure& on_failure) {
  Channel ch(ctx_.shm->data(), ctx_.layout, ctx_.channel);
  auto* base = static_cast<uint8_t*>(ctx_.shm->data());
  const uint32_t slots = ctx_.layout.slots;
  auto fail = [&](const std::string& why) {
    if (!ctx_.stop->load()) on_failure(-1, why);
  };
  WaitContext wait;
  wait.control = static_cast<const JobControl*>(ctx_.shm->data());
  wait.local_abort = ctx_.stop;
  wait.spin = std::chrono::microseconds(0);
  uint32_t next = ch.consumed();  // next staging slot to post
  uint32_t sent = 0;              // slots posted (the receiver's sequence numbers)
  uint32_t completed = 0;         // of those, completed (and released from staging)
  Backoff backoff;
  auto last_socket_check = Clock::now();
  ibv_wc wcs[kPollBatch];
  for (;;) {
    if (ctx_.stop->load(std::memory_order_acquire)) return;
    bool progress = false;
    auto n = cq_.poll(wcs);
    if (!n.ok()) return fail("polling the CQ of the channel to " + ctx_.peer + ": " + n.status().message());
    for (int i = 0; i < *n; ++i) {
      if (Status s = qp_.check(wcs[i]); !s.ok()) {
        return fail("RDMA write to " + ctx_.peer + " failed: " + s.message());
      }
      ch.release();
      ++completed;
      progress = true;
    }
    const uint32_t credit = __atomic_load_n(&words_[0], __ATOMIC_ACQUIRE);
    while (ch.published() != next && sent - credit < slots && sent - completed < slots) {
      SlotMeta* meta = ch.slot_meta(next);
      // The trainer can rewrite its meta at any time: read `bytes` once, check and post that.
      const uint32_t bytes = __atomic_load_n(&meta->bytes, __ATOMIC_RELAXED);
      if (bytes > ch.slot_bytes()) {
        if (!ctx_.stop->load()) on_failure(ctx_.local_rank, oversized_slot(ctx_, bytes));
        return;
      }
      const size_t meta_off = reinterpret_cast<uint8_t*>(meta) - base;
      const size_t data_off = ch.slot_data(next) - base;
      const uint32_t at = sent % slots;
      Status s = qp_.post_write(*job_mr_, meta_off, sizeof(SlotMeta), remote_meta_ + at * sizeof(SlotMeta),
                                remote_meta_rkey_, sent, /*signaled=*/false);
      if (s.ok()) {
        s = qp_.post_write_with_imm(*job_mr_, data_off, bytes,
                                    remote_addr_ + uint64_t(at) * ctx_.layout.slot_bytes, remote_rkey_,
                                    slot_imm(tag_, sent), sent);
      }
      if (!s.ok()) return fail("posting a slot to " + ctx_.peer + ": " + s.message());
      if (ctx_.pumped) ctx_.pumped->fetch_add(bytes, std::memory_order_relaxed);
      ++next;
      ++sent;
      progress = true;
    }
    if (ctx_.drain->load(std::memory_order_acquire) && ch.in_flight() == 0 && sent == completed) {
      SlotMeta bye{};
      bye.bytes = kByeBytes;
      bye.seq = sent;
      (void)write_all(sock_.get(), &bye, sizeof(bye));
      log::get("proxy")->debug("{} verbs sender drained after {} slots, closing", ctx_.ids, sent);
      return;
    }
    auto now = Clock::now();
    if (now - last_socket_check > kSocketCheck) {
      last_socket_check = now;
      // The receiver never writes after set-up: anything readable is EOF or an error.
      if (proxy_readable(sock_.get())) {
        return fail("bootstrap connection from " + ctx_.peer + " closed mid-job: its gradsyncd died");
      }
    }
    if (progress) {
      backoff.progress();
    } else if (ch.published() == next && sent == completed) {
      // Nothing in flight: sleep on the staging channel until the rank publishes.
      wait.deadline = deadline_after(kStagingSlice);
      Status s = ch.wait_published(next, wait);
      if (!s.ok() && s.code() != Code::kDeadlineExceeded) return;  // aborted: whoever did says why
    } else {
      backoff.idle();  // waiting for a credit or a completion
    }
  }
}

void VerbsPump::recv_loop(const PumpFailure& on_failure) {
  Channel ch(ctx_.shm->data(), ctx_.layout, ctx_.channel);
  auto fail = [&](const std::string& why) {
    if (!ctx_.stop->load()) on_failure(-1, why);
  };
  uint32_t arrived = 0;                  // slots published into the incoming channel
  uint32_t credited = ch.consumed();     // the last head value sent as a credit
  uint32_t credit_writes = 0;            // credit writes posted
  uint32_t credit_done = 0;              // and completed
  bool bye = false;
  uint32_t bye_slots = 0;
  Deadline bye_deadline = Deadline::max();
  Backoff backoff;
  auto last_socket_check = Clock::now();
  ibv_wc wcs[kPollBatch];
  for (;;) {
    if (ctx_.stop->load(std::memory_order_acquire)) return;
    bool progress = false;
    auto n = cq_.poll(wcs);
    if (!n.ok()) return fail("polling the CQ of the channel from " + ctx_.peer + ": " + n.status().message());
    for (int i = 0; i < *n; ++i) {
      const ibv_wc& wc = wcs[i];
      if (Status s = qp_.check(wc); !s.ok()) {
        return fail("RDMA channel from " + ctx_.peer + " failed: " + s.message());
      }
      progress = true;
      if (wc.opcode == IBV_WC_RDMA_WRITE) {
        ++credit_done;
        continue;
      }
      if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc.wc_flags & IBV_WC_WITH_IMM)) {
        return fail("protocol error: unexpected completion opcode " + std::to_string(wc.opcode) + " from " +
                    ctx_.peer);
      }
      const uint32_t imm = ntohl(wc.imm_data);
      const SlotMeta meta = *ch.slot_meta(arrived);
      if (Status s = check_landed_slot(imm, tag_, arrived, meta, ch.slot_bytes()); !s.ok()) {
        return fail("protocol error from " + ctx_.peer + ": " + s.message());
      }
      if (ctx_.pumped) ctx_.pumped->fetch_add(meta.bytes, std::memory_order_relaxed);
      ch.publish_landed();
      ++arrived;
      if (Status s = qp_.post_recv(arrived); !s.ok()) {
        return fail("reposting a receive for " + ctx_.peer + ": " + s.message());
      }
    }
    const uint32_t head = ch.consumed();
    if (head != credited && credit_writes - credit_done < kCreditRing) {
      const uint32_t word = credit_writes % kCreditRing;
      words_[word] = head;
      Status s = qp_.post_write(words_mr_, word * sizeof(uint32_t), sizeof(uint32_t), remote_addr_,
                                remote_rkey_, uint64_t(1) << 32 | credit_writes, /*signaled=*/true);
      if (!s.ok()) return fail("returning credits to " + ctx_.peer + ": " + s.message());
      ++credit_writes;
      credited = head;
      progress = true;
    }
    if (bye) {
      if (arrived == bye_slots) return;
      if (Clock::now() >= bye_deadline) {
        return fail("channel from " + ctx_.peer + " said Bye after " + std::to_string(bye_slots) +
                    " slots but only " + std::to_string(arrived) + " arrived");
      }
    } else if (auto now = Clock::now(); now - last_socket_check > kSocketCheck) {
      last_socket_check = now;
      if (proxy_readable(sock_.get())) {
        SlotMeta meta{};
        Status s = read_all(sock_.get(), &meta, sizeof(meta), deadline_after(std::chrono::seconds(5)));
        if (!s.ok() || meta.bytes != kByeBytes) {
          return fail("bootstrap connection from " + ctx_.peer + " closed mid-job (" +
                      (s.ok() ? std::string("unexpected data") : s.message()) + "): its gradsyncd died");
        }
        bye = true;
        bye_slots = meta.seq;
        bye_deadline = deadline_after(kByeDrain);
      }
    }
    if (progress) backoff.progress(); else backoff.idle();
  }
}

}  // namespace gradsync
