// CoordinatorServer in-process on 127.0.0.1:0, driven through a real gRPC stub.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "coordinator.grpc.pb.h"
#include "coordinator/service.h"
#include "daemon/event_stream.h"

namespace gradsync::coordinator {
namespace {

using namespace std::chrono_literals;
using grpc::StatusCode;

// Long enough that no test outlives it, short enough to be seen expiring in one test.
constexpr Millis kTestLease{2000};
constexpr Millis kShortLease{500};
constexpr Millis kTestJoinTimeout{3000};
constexpr auto kRpcDeadline = 5s;  // no call in these tests may hang longer than this

class CoordinatorServiceTest : public ::testing::Test {
 protected:
  void start(Millis lease = kTestLease) {
    CoordinatorOptions options;
    options.lease = lease;
    options.default_join_timeout = kTestJoinTimeout;
    options.streams_per_queue = streams_per_queue_;
    server = std::make_unique<CoordinatorServer>(options);
    ASSERT_TRUE(server->start("127.0.0.1:0").ok());
    ASSERT_GT(server->port(), 0);
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(server->port()),
                                       grpc::InsecureChannelCredentials());
    stub = v1::Coordinator::NewStub(channel);
  }

  static void set_deadline(grpc::ClientContext& ctx) {
    ctx.set_deadline(std::chrono::system_clock::now() + kRpcDeadline);
  }

  std::string register_node(const std::string& host) {
    grpc::ClientContext ctx;
    set_deadline(ctx);
    v1::RegisterNodeRequest req;
    req.mutable_node()->set_hostname(host);
    v1::RegisterNodeResponse resp;
    grpc::Status s = stub->RegisterNode(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.lease_ms(), static_cast<uint32_t>(lease_.count()));
    return resp.node_id();
  }

  // One unary Heartbeat of `node`: its status code.
  StatusCode heartbeat(const std::string& node) {
    grpc::ClientContext ctx;
    set_deadline(ctx);
    v1::HeartbeatRequest req;
    req.set_node_id(node);
    v1::HeartbeatResponse resp;
    return stub->Heartbeat(&ctx, req, &resp).error_code();
  }

  struct JoinOutcome {
    grpc::Status status;
    v1::JoinJobResponse resp;
  };

  JoinOutcome join(const std::string& node, std::vector<uint32_t> ranks, uint32_t world_size,
                   const std::string& token = "secret", uint32_t timeout_ms = 0,
                   std::chrono::milliseconds call_deadline = kRpcDeadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + call_deadline);
    v1::JoinJobRequest req;
    req.set_node_id(node);
    req.set_job_id("train");
    req.set_token(token);
    req.set_world_size(world_size);
    req.set_timeout_ms(timeout_ms);
    for (uint32_t r : ranks) {
      req.add_ranks(r);
      req.add_endpoints("endpoint-of-" + std::to_string(r));
    }
    JoinOutcome out;
    out.status = stub->JoinJob(&ctx, req, &out.resp);
    return out;
  }

  // Joins `a` with ranks 0,1 and `b` with ranks 2,3 concurrently, as two daemons would.
  void join_both(const std::string& a, const std::string& b) {
    auto fa = std::async(std::launch::async, [&] { return join(a, {0, 1}, 4); });
    auto fb = std::async(std::launch::async, [&] { return join(b, {2, 3}, 4); });
    for (auto* f : {&fa, &fb}) {
      JoinOutcome o = f->get();
      ASSERT_TRUE(o.status.ok()) << o.status.error_message();
      EXPECT_EQ(o.resp.generation(), 1u);
      EXPECT_EQ(o.resp.world_size(), 4u);
    }
  }

  // Reads the node's event stream until an event of `kind` arrives (or the stream ends). The
  // stream is half-closed after the message naming the node: events only, no heartbeats.
  std::vector<v1::Event> watch_until(const std::string& node, v1::Event::Kind kind) {
    grpc::ClientContext ctx;
    set_deadline(ctx);
    v1::WatchRequest req;
    req.set_node_id(node);
    auto reader = stub->WatchEvents(&ctx);
    EXPECT_TRUE(reader->Write(req));
    EXPECT_TRUE(reader->WritesDone());
    std::vector<v1::Event> seen;
    v1::Event ev;
    while (reader->Read(&ev)) {
      seen.push_back(ev);
      if (ev.kind() == kind) {
        ctx.TryCancel();
        break;
      }
    }
    reader->Finish().ok();  // CANCELLED after TryCancel; the events are what matters
    return seen;
  }

  // What a node's event stream (daemon/event_stream.h) delivered.
  struct Seen {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<v1::Event> events;
    bool over = false;
    grpc::Status status;
  };
  std::shared_ptr<EventStream> open(const std::string& node, Seen& seen, v1::Coordinator::Stub* over = nullptr) {
    return EventStream::open(
        over ? *over : *stub, node, [](grpc::ClientContext&) {},
        [&seen](const v1::Event& ev) {
          std::lock_guard lock(seen.mu);
          seen.events.push_back(ev);
          seen.cv.notify_all();
        },
        [&seen](const grpc::Status& s) {
          std::lock_guard lock(seen.mu);
          seen.over = true;
          seen.status = s;
          seen.cv.notify_all();
        });
  }

  Millis lease_ = kTestLease;
  size_t streams_per_queue_ = 2048;
  std::unique_ptr<CoordinatorServer> server;
  std::unique_ptr<v1::Coordinator::Stub> stub;
};

TEST_F(CoordinatorServiceTest, TwoNodesRendezvousAndGetThePeerTable) {
  start();
  std::string a = register_node("host-a");
  std::string b = register_node("host-b");
  ASSERT_NE(a, b);
  join_both(a, b);

  grpc::ClientContext ctx;
  set_deadline(ctx);
  v1::PeerTableRequest req;
  req.set_job_id("train");
  req.set_node_id(a);
  v1::PeerTableResponse table;
  ASSERT_TRUE(stub->GetPeerTable(&ctx, req, &table).ok());
  EXPECT_EQ(table.generation(), 1u);
  EXPECT_EQ(table.pages(), 1u);
  ASSERT_EQ(table.peers_size(), 4);  // every rank of a 4-rank job is a peer of a's channels
  EXPECT_EQ(table.peers(2).node_id(), b);
  EXPECT_EQ(table.peers(2).hostname(), "host-b");
  EXPECT_EQ(table.peers(3).endpoint(), "endpoint-of-3");
  ASSERT_EQ(table.runs_size(), 1);  // two nodes of two ranks: the ring 0, 1, 2, 3
  EXPECT_EQ(table.runs(0).first_rank(), 0u);
  EXPECT_EQ(table.runs(0).ranks_per_node(), 2u);
  EXPECT_EQ(table.runs(0).nodes(), 2u);

  grpc::ClientContext lctx;
  set_deadline(lctx);
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(stub->ListJobs(&lctx, v1::ListJobsRequest{}, &jobs).ok());
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_EQ(jobs.jobs(0).state(), "active");
  EXPECT_EQ(jobs.jobs(0).joined(), 4u);

  grpc::ClientContext dctx;
  set_deadline(dctx);
  v1::DescribeJobRequest dreq;
  dreq.set_job_id("nope");
  v1::DescribeJobResponse desc;
  EXPECT_EQ(stub->DescribeJob(&dctx, dreq, &desc).error_code(), StatusCode::NOT_FOUND);
}

TEST_F(CoordinatorServiceTest, WatchEventsDeliversAbort) {
  start();
  std::string a = register_node("host-a");
  std::string b = register_node("host-b");
  join_both(a, b);
  auto watched =
      std::async(std::launch::async, [&] { return watch_until(b, v1::Event::JOB_ABORTED); });
  grpc::ClientContext ctx;
  set_deadline(ctx);
  v1::AbortJobRequest req;
  req.set_node_id(a);
  req.set_job_id("train");
  req.set_reason("rank 1 crashed");
  req.set_failed_rank(1);
  v1::AbortJobResponse resp;
  ASSERT_TRUE(stub->AbortJob(&ctx, req, &resp).ok());
  std::vector<v1::Event> events = watched.get();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind(), v1::Event::JOB_READY);
  EXPECT_EQ(events[1].kind(), v1::Event::JOB_ABORTED);
  EXPECT_EQ(events[1].generation(), 1u);
  EXPECT_EQ(events[1].failed_rank(), 1);
  EXPECT_EQ(events[1].failed_node(), a);
  EXPECT_NE(events[1].reason().find("rank 1 crashed"), std::string::npos);
}

TEST_F(CoordinatorServiceTest, LeaseExpiryAbortsTheJobForSurvivors) {
  lease_ = kShortLease;
  start(kShortLease);
  std::string a = register_node("host-a");
  std::string b = register_node("host-b");
  const auto b_silent_since = std::chrono::steady_clock::now();
  std::atomic<bool> stop{false};
  std::thread heartbeats([&] {  // a stays alive; b never heartbeats
    while (!stop) {
      EXPECT_EQ(heartbeat(a), StatusCode::OK);
      std::this_thread::sleep_for(kShortLease / 4);
    }
  });
  join_both(a, b);
  std::vector<v1::Event> events = watch_until(a, v1::Event::JOB_ABORTED);
  const auto detected_after = std::chrono::steady_clock::now() - b_silent_since;
  stop = true;
  heartbeats.join();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[1].kind(), v1::Event::NODE_LOST);
  EXPECT_EQ(events[2].kind(), v1::Event::JOB_ABORTED);
  EXPECT_EQ(events[2].failed_node(), b);
  EXPECT_EQ(events[2].failed_rank(), 2);
  EXPECT_NE(events[2].reason().find("host host-b"), std::string::npos) << events[2].reason();
  // Detection is bounded by the lease plus a tick (100 ms), with slack for a loaded machine.
  EXPECT_LT(detected_after, kShortLease + 1s);

  EXPECT_EQ(heartbeat(b), StatusCode::NOT_FOUND);
}

// gradsyncd's liveness: heartbeats on the node's event stream (daemon/event_stream.h), no
// unary call. Node a heartbeats on its stream for several leases and stays; node b keeps its
// stream open but sends nothing (a paused daemon) and is lost within its lease, its stream
// ended NOT_FOUND, and a's stream carries the abort.
TEST_F(CoordinatorServiceTest, StreamHeartbeatsKeepANodeAndASilentStreamIsLost) {
  lease_ = kShortLease;
  start(kShortLease);
  std::string a = register_node("host-a");
  std::string b = register_node("host-b");
  Seen seen_a, seen_b;
  auto stream_a = open(a, seen_a);
  const auto b_silent_since = std::chrono::steady_clock::now();  // its stream's first message is its last
  auto stream_b = open(b, seen_b);
  std::atomic<bool> stop{false};
  std::thread heartbeats([&] {
    while (!stop) {
      EXPECT_NE(stream_a->heartbeat(), EventStream::Sent::kOver);
      std::this_thread::sleep_for(kShortLease / 4);
    }
  });
  join_both(a, b);
  {
    std::unique_lock lock(seen_b.mu);
    ASSERT_TRUE(seen_b.cv.wait_for(lock, 5s, [&] { return seen_b.over; }));
    EXPECT_EQ(seen_b.status.error_code(), StatusCode::NOT_FOUND) << seen_b.status.error_message();
  }
  const auto detected_after = std::chrono::steady_clock::now() - b_silent_since;
  EXPECT_LT(detected_after, kShortLease + 1s);
  {
    std::unique_lock lock(seen_a.mu);
    ASSERT_TRUE(seen_a.cv.wait_for(lock, 5s, [&] {
      return !seen_a.events.empty() && seen_a.events.back().kind() == v1::Event::JOB_ABORTED;
    }));
    EXPECT_EQ(seen_a.events.back().failed_node(), b);
    EXPECT_NE(seen_a.events.back().reason().find("host host-b"), std::string::npos);
  }
  std::this_thread::sleep_for(kShortLease * 3);  // a lives on through three more leases
  stop = true;
  heartbeats.join();
  {
    std::lock_guard lock(seen_a.mu);
    EXPECT_FALSE(seen_a.over) << seen_a.status.error_message();
  }
  EXPECT_EQ(heartbeat(a), StatusCode::OK);
  stream_a->cancel();
  std::unique_lock lock(seen_a.mu);
  EXPECT_TRUE(seen_a.cv.wait_for(lock, 5s, [&] { return seen_a.over; }));
}

// The event streams spread over several completion queues (coordinator/service_internal.h,
// kStreamQueues): with one stream per queue, five nodes' streams take five queues into use,
// and a second stream of each node, on its own connection, lands on one of them (gRPC picks
// the queue to try first per connection). Every node's stream carries JOB_READY, heartbeats on every queue keep every
// node through three leases, and the server shuts down promptly with the streams open.
TEST_F(CoordinatorServiceTest, StreamsOnSeveralQueuesCarryEventsAndHeartbeats) {
  lease_ = kShortLease;
  streams_per_queue_ = 1;
  start(kShortLease);
  constexpr uint32_t kNodes = 5;
  std::vector<std::string> ids;
  std::vector<Seen> seen(kNodes);
  // First a stream per node on the shared connection: they start the queues (a queue takes
  // new streams only once started), then each node's own stream on its own connection
  // replaces that one, so the connections find every queue started.
  std::vector<Seen> first(kNodes);
  std::vector<std::shared_ptr<EventStream>> firsts;
  for (uint32_t i = 0; i < kNodes; ++i) {
    ids.push_back(register_node("host-" + std::to_string(i)));
    firsts.push_back(open(ids.back(), first[i]));
  }
  std::vector<std::shared_ptr<EventStream>> streams;
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> own;  // a connection per node
  const auto named_by = std::chrono::steady_clock::now() + 5s;  // each named before it is replaced
  for (uint32_t i = 0; i < kNodes; ++i) {
    while (firsts[i]->last_sent() == EventStream::Clock::time_point{}) {
      ASSERT_LT(std::chrono::steady_clock::now(), named_by) << "node " << i << "'s first stream";
      std::this_thread::sleep_for(5ms);
    }
  }
  for (uint32_t i = 0; i < kNodes; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    own.push_back(v1::Coordinator::NewStub(grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(server->port()), grpc::InsecureChannelCredentials(), args)));
    streams.push_back(open(ids[i], seen[i], own.back().get()));
  }
  for (uint32_t i = 0; i < kNodes; ++i) {  // replaced: the node's own stream is its watcher now
    std::unique_lock lock(first[i].mu);
    ASSERT_TRUE(first[i].cv.wait_for(lock, 5s, [&] { return first[i].over; })) << "node " << i;
    EXPECT_EQ(first[i].status.error_code(), StatusCode::ABORTED) << first[i].status.error_message();
  }
  std::atomic<bool> stop{false};
  std::thread heartbeats([&] {
    while (!stop) {
      for (auto& st : streams) EXPECT_NE(st->heartbeat(), EventStream::Sent::kOver);
      std::this_thread::sleep_for(kShortLease / 4);
    }
  });
  std::vector<std::future<JoinOutcome>> joins;
  for (uint32_t i = 0; i < kNodes; ++i) {
    joins.push_back(std::async(std::launch::async, [&, i] { return join(ids[i], {i}, kNodes); }));
  }
  for (auto& j : joins) {
    JoinOutcome o = j.get();
    EXPECT_TRUE(o.status.ok()) << o.status.error_message();
  }
  for (uint32_t i = 0; i < kNodes; ++i) {
    std::unique_lock lock(seen[i].mu);
    EXPECT_TRUE(seen[i].cv.wait_for(lock, 5s, [&] {
      return std::any_of(seen[i].events.begin(), seen[i].events.end(),
                         [](const v1::Event& e) { return e.kind() == v1::Event::JOB_READY; });
    })) << "node " << i << " got no JOB_READY on its stream";
  }
  std::this_thread::sleep_for(kShortLease * 3);
  stop = true;
  heartbeats.join();
  for (uint32_t i = 0; i < kNodes; ++i) {
    std::lock_guard lock(seen[i].mu);
    EXPECT_FALSE(seen[i].over) << "node " << i << ": " << seen[i].status.error_message();
    EXPECT_EQ(heartbeat(ids[i]), StatusCode::OK) << "node " << i << " was lost";
  }
  const auto t0 = std::chrono::steady_clock::now();
  server->shutdown();
  server->wait();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  for (uint32_t i = 0; i < kNodes; ++i) {
    std::unique_lock lock(seen[i].mu);
    EXPECT_TRUE(seen[i].cv.wait_for(lock, 5s, [&] { return seen[i].over; })) << "node " << i;
  }
}

TEST_F(CoordinatorServiceTest, WrongTokenIsDeniedToEveryNodeAtOnce) {
  start();
  std::string a = register_node("host-a");
  std::string b = register_node("host-b");
  auto waiting =
      std::async(std::launch::async, [&] { return join(a, {0}, 4, "secret", /*timeout_ms=*/5000); });
  // Wait until a's rank is in, so b's join meets a's token.
  for (int i = 0; i < 200; ++i) {
    grpc::ClientContext ctx;
    set_deadline(ctx);
    v1::DescribeJobRequest req;
    req.set_job_id("train");
    v1::DescribeJobResponse desc;
    if (stub->DescribeJob(&ctx, req, &desc).ok() && desc.summary().joined() == 1) break;
    std::this_thread::sleep_for(5ms);
  }
  JoinOutcome denied = join(b, {1}, 4, "guess");
  EXPECT_EQ(denied.status.error_code(), StatusCode::PERMISSION_DENIED);
  EXPECT_NE(denied.status.error_message().find("wrong token for job train"), std::string::npos);

  // The node already waiting hears it at once, not at its join deadline.
  JoinOutcome refused = waiting.get();
  EXPECT_EQ(refused.status.error_code(), StatusCode::PERMISSION_DENIED);
  EXPECT_NE(refused.status.error_message().find("refused for every node"), std::string::npos)
      << refused.status.error_message();
}

TEST_F(CoordinatorServiceTest, CancelledJoinWithdrawsItsRanks) {
  start();
  std::string a = register_node("host-a");
  std::string b = register_node("host-b");
  JoinOutcome gave_up = join(a, {0}, 2, "secret", 0, /*call_deadline=*/200ms);
  EXPECT_EQ(gave_up.status.error_code(), StatusCode::DEADLINE_EXCEEDED);
  // The server notices the cancelled call within a tick and releases rank 0.
  JoinOutcome retry;
  for (int i = 0; i < 100; ++i) {
    retry = join(b, {0, 1}, 2);
    if (retry.status.error_code() != StatusCode::ALREADY_EXISTS) break;
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(retry.status.ok()) << retry.status.error_message();
  EXPECT_EQ(retry.resp.generation(), 1u);
}

TEST_F(CoordinatorServiceTest, UnknownNodesAndBadRequests) {
  start();
  EXPECT_EQ(heartbeat("ghost-1"), StatusCode::NOT_FOUND);

  grpc::ClientContext wctx;
  set_deadline(wctx);
  v1::WatchRequest w;
  w.set_node_id("ghost-1");
  auto reader = stub->WatchEvents(&wctx);
  reader->Write(w);  // may fail: the coordinator can end the stream first
  v1::Event ev;
  EXPECT_FALSE(reader->Read(&ev));
  EXPECT_EQ(reader->Finish().error_code(), StatusCode::NOT_FOUND);

  // A stream that ends before a message names its node.
  grpc::ClientContext nctx;
  set_deadline(nctx);
  auto nameless = stub->WatchEvents(&nctx);
  nameless->WritesDone();
  EXPECT_FALSE(nameless->Read(&ev));
  grpc::Status s = nameless->Finish();
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT) << s.error_message();

  std::string a = register_node("host-a");
  JoinOutcome bad = join(a, {5}, 4);
  EXPECT_EQ(bad.status.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.status.error_message().find("rank 5 is out of range"), std::string::npos);
}

TEST_F(CoordinatorServiceTest, ShutdownEndsBlockedCallsPromptly) {
  start();
  std::string a = register_node("host-a");
  auto waiting = std::async(std::launch::async, [&] { return join(a, {0}, 2); });
  std::this_thread::sleep_for(100ms);  // let the join block (if it has not, it fails the same)
  const auto t = std::chrono::steady_clock::now();
  server->shutdown();
  server->wait();
  EXPECT_LT(std::chrono::steady_clock::now() - t, 1s);
  EXPECT_EQ(waiting.get().status.error_code(), StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace gradsync::coordinator
