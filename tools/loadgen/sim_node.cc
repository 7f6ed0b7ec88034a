#include "loadgen/sim_node.h"

#include "common/call_auth.h"

#include <algorithm>
#include <cstdlib>

namespace gradsync::loadgen {
namespace {

// The daemon's deadline for a short control call and its pause between registrations.
constexpr std::chrono::milliseconds kCallTimeout{5'000};
// The daemon's deadline for one peer-table page (kTablePageTimeout in coordinator_link.cc):
// when thousands of nodes ask at once the coordinator queues them rather than failing.
constexpr std::chrono::milliseconds kTablePageTimeout{20'000};
constexpr std::chrono::milliseconds kRetryPause{500};

template <class Req, class Resp>
struct Call {
  grpc::ClientContext ctx;
  Req req;
  Resp resp;
  std::atomic<int64_t>* in_flight;
  Call(std::chrono::milliseconds timeout, std::atomic<int64_t>* count) : in_flight(count) {
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    ++*in_flight;
  }
  ~Call() { --*in_flight; }
};

std::string describe(const grpc::Status& s) {
  return std::to_string(int(s.error_code())) + " " + s.error_message();
}

}  // namespace

constexpr const char* kToken = "loadgen-token";

void SimNode::credentials(grpc::ClientContext& ctx, bool job_call) const {
  if (!totals_->cluster_secret.empty()) ctx.AddMetadata(kClusterSecretHeader, totals_->cluster_secret);
  if (!node_id_.empty()) ctx.AddMetadata(kNodeIdHeader, node_id_);
  if (!node_key_.empty()) ctx.AddMetadata(kNodeKeyHeader, node_key_);
  if (job_call) ctx.AddMetadata(kJobTokenHeader, kToken);
}

void Totals::error(const std::string& what) {
  std::lock_guard lock(mu);
  if (first_error.empty()) first_error = what;
}

SimNode::SimNode(uint32_t index, std::shared_ptr<v1::Coordinator::Stub> stub, Totals* totals)
    : index_(index), stub_(std::move(stub)), totals_(totals) {}

SimNode::~SimNode() { stop(); }

void SimNode::stop() {
  std::shared_ptr<EventStream> stream;
  {
    std::lock_guard lock(mu_);
    stream = stream_;
  }
  if (!stream) return;
  stream->cancel();  // not under mu_: the stream's callbacks take it
  std::unique_lock lock(mu_);
  stream_cv_.wait_for(lock, std::chrono::seconds(10), [this] { return stream_over_; });
}

void SimNode::start(Clock::time_point deadline, std::function<void(bool)> done) {
  auto* c = new Call<v1::RegisterNodeRequest, v1::RegisterNodeResponse>(kCallTimeout, &totals_->in_flight);
  v1::NodeInfo* info = c->req.mutable_node();
  info->set_hostname("sim" + std::to_string(index_));
  info->set_node_name("sim" + std::to_string(index_));
  info->set_cpus(2);
  info->set_data_endpoint("127.0.0.1:" + std::to_string(20000 + index_ % 40000));
  info->set_pid(100000 + index_);
  info->set_transport("tcp");
  info->set_incarnation(0x5eed0000ull + index_);
  credentials(c->ctx);
  stub_->async()->RegisterNode(&c->ctx, &c->req, &c->resp, [this, c, deadline, done](grpc::Status s) {
    if (s.ok()) {
      totals_->bytes_received += c->resp.ByteSizeLong();
      node_id_ = c->resp.node_id();
      const auto& md = c->ctx.GetServerInitialMetadata();
      if (auto key = md.find(kNodeKeyHeader); key != md.end()) node_key_.assign(key->second.data(), key->second.size());
      {
        std::lock_guard lock(mu_);
        registered_at_ = Clock::now();
      }
      delete c;
      ++totals_->registered;
      watch();
      done(true);
      return;
    }
    // A busy coordinator refuses with a hint of when to come back (RESOURCE_EXHAUSTED).
    const auto hint = retry_hint(c->ctx);
    delete c;
    const auto base = hint.count() > 0 ? hint : kRetryPause;
    if (Clock::now() + base / 2 >= deadline) {
      totals_->error("RegisterNode of sim" + std::to_string(index_) + ": " + describe(s));
      done(false);
      return;
    }
    ++totals_->register_retries;
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++totals_->register_refused;
    // As the daemon: jittered backoff, so retries spread out instead of arriving together.
    const auto pause = base / 2 + std::chrono::milliseconds(std::rand() % int(base.count()));
    totals_->later(pause, [this, deadline, done] { start(deadline, done); });
  });
}

void SimNode::watch() {
  auto stream = EventStream::open(
      *stub_, node_id_, [this](grpc::ClientContext& ctx) { credentials(ctx); },
      [this](const v1::Event& ev) {
        totals_->bytes_received += ev.ByteSizeLong();
        std::lock_guard lock(mu_);
        events_.push_back({ev.kind(), ev.job_id(), Clock::now()});
      },
      [this](const grpc::Status& s) {
        if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
          ++totals_->lost;
          totals_->error("sim" + std::to_string(index_) + " was declared lost: " + s.error_message());
        } else if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED) {
          totals_->error("event stream of sim" + std::to_string(index_) + ": " + describe(s));
        }
        std::lock_guard lock(mu_);
        stream_over_ = true;
        stream_cv_.notify_all();
      },
      totals_->streams);
  std::lock_guard lock(mu_);
  stream_ = std::move(stream);
}

void SimNode::heartbeat() {
  if (silent_) return;
  std::shared_ptr<EventStream> stream;
  {
    std::lock_guard lock(mu_);
    stream = stream_;
  }
  const auto sent = stream ? stream->heartbeat() : EventStream::Sent::kOver;
  if (sent == EventStream::Sent::kSent) {
    ++totals_->heartbeats;
  } else {
    ++totals_->heartbeat_failures;
    if (sent == EventStream::Sent::kBusy) ++totals_->heartbeats_busy;
  }
}

void SimNode::join(const std::string& job, uint32_t world, uint32_t first, uint32_t count,
                   std::function<void(bool)> done) {
  // The daemon's JoinJob deadline is the join timeout plus its 5 s backstop.
  auto* c = new Call<v1::JoinJobRequest, v1::JoinJobResponse>(std::chrono::milliseconds(65'000), &totals_->in_flight);
  c->req.set_node_id(node_id_);
  c->req.set_job_id(job);
  c->req.set_token(kToken);
  credentials(c->ctx);
  c->req.set_world_size(world);
  c->req.set_timeout_ms(60'000);
  v1::ChannelOffer* offer = c->req.mutable_offer();
  offer->set_rings(1);
  offer->set_rings_chosen(true);
  offer->set_slots(8);
  offer->set_slot_bytes(1 << 20);
  // What a daemon sends: one ChannelEndpoint per rank, the same for all of its ranks.
  const std::string endpoint(40, char('a' + index_ % 26));
  for (uint32_t r = first; r < first + count; ++r) {
    c->req.add_ranks(r);
    c->req.add_endpoints(endpoint);
  }
  stub_->async()->JoinJob(&c->ctx, &c->req, &c->resp, [this, c, job, done](grpc::Status s) {
    if (!s.ok()) {
      ++totals_->failures;
      totals_->error("JoinJob of sim" + std::to_string(index_) + ": " + describe(s));
      delete c;
      done(false);
      return;
    }
    ++totals_->joined;
    totals_->bytes_received += c->resp.ByteSizeLong();
    generation_ = c->resp.generation();
    delete c;
    fetch_table(job, generation_, 0, done);
  });
}

void SimNode::fetch_table(const std::string& job, uint64_t generation, uint32_t page,
                          std::function<void(bool)> done) {
  auto* c = new Call<v1::PeerTableRequest, v1::PeerTableResponse>(kTablePageTimeout, &totals_->in_flight);
  c->req.set_job_id(job);
  c->req.set_generation(generation);
  c->req.set_node_id(node_id_);
  c->req.set_page(page);
  credentials(c->ctx, true);
  stub_->async()->GetPeerTable(&c->ctx, &c->req, &c->resp, [this, c, job, generation, page, done](grpc::Status s) {
    ++totals_->table_calls;
    if (!s.ok()) {
      ++totals_->failures;
      totals_->error("GetPeerTable of sim" + std::to_string(index_) + ": " + describe(s));
      delete c;
      done(false);
      return;
    }
    const uint64_t bytes = c->resp.ByteSizeLong();
    totals_->bytes_received += bytes;
    totals_->table_bytes += bytes;
    const uint32_t pages = c->resp.pages();
    delete c;
    if (page + 1 < pages) {  // a coordinator without pages answers 0
      fetch_table(job, generation, page + 1, done);
      return;
    }
    ++totals_->tables;
    done(true);
  });
}

void SimNode::abort(const std::string& job, std::function<void(bool)> done) {
  auto* c = new Call<v1::AbortJobRequest, v1::AbortJobResponse>(kCallTimeout, &totals_->in_flight);
  c->req.set_node_id(node_id_);
  c->req.set_job_id(job);
  c->req.set_reason("loadgen: failure fan-out measurement");
  credentials(c->ctx, true);
  c->req.set_failed_rank(-1);
  stub_->async()->AbortJob(&c->ctx, &c->req, &c->resp, [this, c, done](grpc::Status s) {
    if (!s.ok()) totals_->error("AbortJob of sim" + std::to_string(index_) + ": " + describe(s));
    delete c;
    done(s.ok());
  });
}

Clock::time_point SimNode::last_heartbeat_ok() const {
  std::lock_guard lock(mu_);
  return stream_ ? std::max(stream_->last_sent(), registered_at_) : registered_at_;
}

std::vector<SeenEvent> SimNode::events() const {
  std::lock_guard lock(mu_);
  return events_;
}

}  // namespace gradsync::loadgen
