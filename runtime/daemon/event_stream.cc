#include "daemon/event_stream.h"

namespace gradsync {
namespace {

// WatchRequest.sent_ms: this process's monotonic clock; the coordinator compares only
// differences between one stream's messages.
uint64_t now_ms() {
  return uint64_t(std::chrono::duration_cast<std::chrono::milliseconds>(EventStream::Clock::now().time_since_epoch()).count());
}

}  // namespace

std::shared_ptr<EventStream> EventStream::open(v1::Coordinator::Stub& stub, const std::string& node_id,
                                               const std::function<void(grpc::ClientContext&)>& prepare,
                                               EventFn on_event, DoneFn on_done) {
  auto s = std::make_shared<EventStream>(std::move(on_event), std::move(on_done));
  prepare(s->ctx_);
  s->first_.set_node_id(node_id);
  s->self_ = s;
  stub.async()->WatchEvents(&s->ctx_, s.get());
  // heartbeat() writes from outside the reactions: the hold keeps the call open for them until
  // the reads end (OnReadDone(false)).
  s->AddHold();
  {
    std::lock_guard lock(s->mu_);
    s->pending_ = Clock::now();
  }
  s->first_.set_sent_ms(now_ms());
  s->StartWrite(&s->first_);
  s->StartRead(&s->event_);
  s->StartCall();
  return s;
}

EventStream::Sent EventStream::heartbeat() {
  std::lock_guard lock(mu_);
  if (over_) return Sent::kOver;
  if (pending_ != Clock::time_point{}) return Sent::kBusy;
  pending_ = Clock::now();
  beat_.set_sent_ms(now_ms());
  StartWrite(&beat_);  // under mu_: over_ (and so the hold) cannot change meanwhile
  return Sent::kSent;
}

EventStream::Clock::time_point EventStream::pending_since() const {
  std::lock_guard lock(mu_);
  return pending_;
}

EventStream::Clock::time_point EventStream::last_sent() const {
  std::lock_guard lock(mu_);
  return last_sent_;
}

void EventStream::OnWriteDone(bool ok) {
  std::lock_guard lock(mu_);
  pending_ = {};
  if (ok) last_sent_ = Clock::now();
}

void EventStream::OnReadDone(bool ok) {
  if (ok) {
    on_event_(event_);
    StartRead(&event_);
    return;
  }
  {
    std::lock_guard lock(mu_);
    over_ = true;
  }
  RemoveHold();
}

void EventStream::OnDone(const grpc::Status& s) {
  auto keep = std::move(self_);  // the owner may have dropped it: this lives until the end here
  on_done_(s);
}

}  // namespace gradsync
