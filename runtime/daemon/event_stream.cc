#include "daemon/event_stream.h"

namespace gradsync {
namespace {

// WatchRequest.sent_ms: this process's monotonic clock; the coordinator compares only
// differences between one stream's messages.
uint64_t now_ms() {
  return uint64_t(std::chrono::duration_cast<std::chrono::milliseconds>(EventStream::Clock::now().time_since_epoch()).count());
}

}  // namespace

grpc::ChannelArguments node_channel_args() {
  grpc::ChannelArguments args;
  // gRPC's default pause between connection attempts grows to 2 minutes.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, int(kNodeMaxReconnect.count()));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  // After a failed connection gRPC asks its resolver again, and the DNS resolver answers at
  // most every 30 s by default: calls failed "Connection refused" for seconds after the
  // coordinator was back (issue 17's 7 s gap of new jobs after a coordinator restart).
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 100);
  // Pings go even while heartbeats flow, and with no call open (node_channel_args' comment).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, int(kNodePingPeriod.count()));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, int(kNodePingTimeout.count()));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  return args;
}

StreamQueues::StreamQueues(size_t count) {
  for (size_t k = 0; k < std::max<size_t>(count, 1); ++k) queues_.push_back(std::make_unique<grpc::CompletionQueue>());
  for (auto& q : queues_) {
    threads_.emplace_back([cq = q.get()] {
      void* tag = nullptr;
      bool ok = false;
      while (cq->Next(&tag, &ok)) {
        auto* t = static_cast<EventStream::Tag*>(tag);
        t->stream->completed(t->op, ok);
      }
    });
  }
}

StreamQueues::~StreamQueues() {
  for (auto& q : queues_) q->Shutdown();
  for (auto& t : threads_) t.join();
}

grpc::CompletionQueue* StreamQueues::next() { return queues_[next_++ % queues_.size()].get(); }

StreamQueues& StreamQueues::shared() {
  static StreamQueues* queues = new StreamQueues(1);  // outlives every stream: never destroyed
  return *queues;
}

std::shared_ptr<EventStream> EventStream::open(v1::Coordinator::Stub& stub, const std::string& node_id,
                                               const std::function<void(grpc::ClientContext&)>& prepare,
                                               EventFn on_event, DoneFn on_done, StreamQueues* queues) {
  auto s = std::make_shared<EventStream>(std::move(on_event), std::move(on_done));
  prepare(s->ctx_);
  s->first_.set_node_id(node_id);
  grpc::CompletionQueue* cq = (queues ? *queues : StreamQueues::shared()).next();
  std::lock_guard lock(s->mu_);  // the completions wait until every operation below began
  s->self_ = s;
  // Corked: the call's metadata leaves with the naming message, so that starting the call is
  // no operation of its own (the asynchronous API allows no write before it completed).
  s->ctx_.set_initial_metadata_corked(true);
  s->io_ = stub.PrepareAsyncWatchEvents(&s->ctx_, cq);
  s->ops_ = 2;
  s->pending_ = Clock::now();
  s->first_.set_sent_ms(now_ms());
  s->io_->StartCall(nullptr);  // corked: no completion
  s->io_->Write(s->first_, s->tag(kWrite));
  s->io_->Read(&s->event_, s->tag(kRead));
  return s;
}

EventStream::Sent EventStream::heartbeat() {
  std::lock_guard lock(mu_);
  if (over_) return Sent::kOver;
  if (pending_ != Clock::time_point{}) return Sent::kBusy;
  pending_ = Clock::now();
  beat_.set_sent_ms(++beats_ % kClockEvery == 0 ? now_ms() : 0);
  ++ops_;
  io_->Write(beat_, tag(kWrite));
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

void EventStream::finish_locked() {
  if (!over_ || finishing_ || pending_ != Clock::time_point{}) return;
  finishing_ = true;
  ++ops_;
  io_->Finish(&status_, tag(kFinish));
}

void EventStream::completed(Op op, bool ok) {
  if (op == kRead && ok) on_event_(event_);  // not under mu_: the owner's callback may take its own locks
  if (op == kFinish) on_done_(status_);
  std::shared_ptr<EventStream> last;  // released after mu_
  std::lock_guard lock(mu_);
  switch (op) {
    case kRead:
      if (ok) {
        ++ops_;
        io_->Read(&event_, tag(kRead));
      } else {
        over_ = true;
        finish_locked();
      }
      break;
    case kWrite:
      pending_ = {};
      if (ok) last_sent_ = Clock::now();
      finish_locked();
      break;
    case kFinish:
    case kOps:
      break;
  }
  if (--ops_ == 0) last = std::move(self_);
}

}  // namespace gradsync
