// gradsync-loadgen: plays N node daemons with K ranks each against a real
// gradsync-coordinator process (started here unless --coordinator is given) and measures
// what issue 18 asks: rendezvous time (first JoinJob to the last node holding its peer
// table), the coordinator's CPU beside this process's, the bytes the coordinator sent, its
// memory per node and per rank, idle CPU, and the failure fan-out. docs/benchmarks.md.
//
// Exit status: 0 when every node registered, joined and got its table within the bounds and
// no node was declared lost; 1 otherwise; 2 on bad usage.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <memory>
#include <queue>
#include <random>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "launcher/process.h"
#include "loadgen/proc_sample.h"
#include "loadgen/sim_node.h"

namespace gradsync::loadgen {
namespace {

constexpr const char* kUsage =
    "usage: gradsync-loadgen --nodes N --ranks K [options]\n"
    "  --coordinator-bin PATH  coordinator to start (default: next to this binary)\n"
    "  --coordinator H:P --coordinator-pid PID   use a running coordinator instead\n"
    "  --lease-ms N            passed to the started coordinator (default: its own)\n"
    "  --channels C            gRPC connections shared by the nodes (default min(N, 4096))\n"
    "  --register-rate R       nodes started a second (default 4000; 0: all at once)\n"
    "  --idle-s S              before the join, measure S seconds of idle heartbeating\n"
    "  --fanout                after the rendezvous: abort fan-out, then a node's death\n"
    "  --max-rendezvous-s S    fail (exit 1) when the rendezvous takes longer\n"
    "  --max-table-bytes B     fail (exit 1) when a node's peer table averages more bytes\n";

struct Flags {
  uint32_t nodes = 0, ranks = 0, channels = 0;
  std::string bin, address;
  pid_t pid = 0;
  uint32_t lease_ms = 0;
  double idle_s = 0, max_rendezvous_s = 0, max_table_bytes = 0, register_rate = 4000;
  bool fanout = false;
};

using Seconds = std::chrono::duration<double>;
constexpr int kHeartbeatThreads = 4;
// Completion queues for the simulated nodes' event streams, a thread each, one per this many
// nodes and 8 at most: with gRPC's debug build every completion searches its queue's
// outstanding operations, and one queue holding 16,384 streams made this process, not the
// coordinator, the bottleneck (perf); but each thread waiting on a queue also takes turns at
// polling the connections, so more queues than needed cost wake-ups (as in the coordinator).
constexpr uint32_t kStreamsPerQueue = 2048;
constexpr uint32_t kMaxStreamQueues = 8;

double since(Clock::time_point t) { return Seconds(Clock::now() - t).count(); }

// Waits until `count` reaches `target` or `deadline`; true when it did.
bool wait_for(const std::atomic<uint64_t>& count, uint64_t target, Clock::time_point deadline,
              const std::atomic<uint64_t>* failures = nullptr) {
  while (count.load() < target) {
    if (Clock::now() >= deadline) return false;
    if (failures && failures->load() > 0 && count.load() + failures->load() >= target) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Sends every node's heartbeat every lease/3 from its registration on, as the daemon does
// (add), and runs one-off tasks (later); one thread. The run has two: one for each use.
class Heartbeats {
 public:
  Heartbeats(std::vector<std::unique_ptr<SimNode>>& nodes, std::chrono::milliseconds period)
      : nodes_(nodes), period_(period) {}
  ~Heartbeats() { stop(); }
  void add(uint32_t node) {
    std::lock_guard lock(mu_);
    due_.push({Clock::now() + period_, node});
    cv_.notify_one();
  }
  // A one-off task on this thread (registration retries, staggered starts).
  void later(std::chrono::milliseconds delay, std::function<void()> fn) {
    std::lock_guard lock(mu_);
    tasks_.push_back(std::move(fn));
    due_.push({Clock::now() + delay, kTask + uint32_t(tasks_.size() - 1)});
    cv_.notify_one();
  }
  void start() {
    thread_ = std::thread([this] { run(); });
  }
  void stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  using Due = std::pair<Clock::time_point, uint32_t>;
  void run() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
      if (due_.empty()) {
        cv_.wait(lock);
        continue;
      }
      Due next = due_.top();
      if (next.first > Clock::now()) {
        cv_.wait_until(lock, next.first);
        continue;
      }
      due_.pop();
      if (next.second >= kTask) {
        std::function<void()> fn = std::move(tasks_[next.second - kTask]);
        lock.unlock();
        fn();
        lock.lock();
        continue;
      }
      due_.push({next.first + period_, next.second});
      lock.unlock();
      nodes_[next.second]->heartbeat();
      lock.lock();
    }
  }
  std::vector<std::unique_ptr<SimNode>>& nodes_;
  const std::chrono::milliseconds period_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::priority_queue<Due, std::vector<Due>, std::greater<>> due_;
  static constexpr uint32_t kTask = 1u << 31;  // due_ entries from here index tasks_
  std::vector<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

int parse(int argc, char** argv, Flags& f) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--nodes") f.nodes = uint32_t(std::stoul(value()));
    else if (a == "--ranks") f.ranks = uint32_t(std::stoul(value()));
    else if (a == "--channels") f.channels = uint32_t(std::stoul(value()));
    else if (a == "--coordinator-bin") f.bin = value();
    else if (a == "--coordinator") f.address = value();
    else if (a == "--coordinator-pid") f.pid = pid_t(std::stol(value()));
    else if (a == "--lease-ms") f.lease_ms = uint32_t(std::stoul(value()));
    else if (a == "--idle-s") f.idle_s = std::stod(value());
    else if (a == "--max-rendezvous-s") f.max_rendezvous_s = std::stod(value());
    else if (a == "--max-table-bytes") f.max_table_bytes = std::stod(value());
    else if (a == "--register-rate") f.register_rate = std::stod(value());
    else if (a == "--fanout") f.fanout = true;
    else if (a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    } else {
      std::fprintf(stderr, "gradsync-loadgen: unknown flag '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  if (f.nodes == 0 || f.ranks == 0) {
    std::fprintf(stderr, "gradsync-loadgen: --nodes and --ranks are required\n%s", kUsage);
    return 2;
  }
  if (f.channels == 0) f.channels = std::min<uint32_t>(f.nodes, 4096);
  return -1;
}

// Starts the coordinator on a free loopback port; its address, or "" on failure.
std::string start_coordinator(const Flags& f, const std::string& secret, pid_t* pid) {
  std::string bin = f.bin.empty() ? launcher::self_dir() + "/gradsync-coordinator" : f.bin;
  const std::string port_file = "/tmp/gradsync-loadgen-port." + std::to_string(getpid());
  std::remove(port_file.c_str());
  launcher::Command cmd;
  cmd.path = bin;
  cmd.argv = {bin, "--listen", "127.0.0.1:0", "--port-file", port_file, "--log-level", "warn"};
  if (f.lease_ms) cmd.argv.insert(cmd.argv.end(), {"--lease-ms", std::to_string(f.lease_ms)});
  for (char** e = environ; *e; ++e) cmd.env.push_back(*e);
  cmd.env.push_back("GRADSYNC_CLUSTER_SECRET=" + secret);  // the nodes present it (sim_node.cc)
  cmd.capture_output = false;
  sigset_t none;
  sigemptyset(&none);
  auto spawned = launcher::spawn(cmd, none);
  if (!spawned.ok()) {
    std::fprintf(stderr, "gradsync-loadgen: %s\n", spawned.status().to_string().c_str());
    return "";
  }
  *pid = spawned->pid;
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < deadline) {
    std::ifstream in(port_file);
    int port = 0;
    if (in >> port && port > 0) {
      std::remove(port_file.c_str());
      return "127.0.0.1:" + std::to_string(port);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::fprintf(stderr, "gradsync-loadgen: %s wrote no port file within 20 s\n", bin.c_str());
  return "";
}

struct Phase {  // CPU of both processes over one phase
  ProcSample coord0, self0;
  Clock::time_point t0;
  pid_t pid;
  explicit Phase(pid_t p) : coord0(sample_process(p)), self0(sample_process(0)), t0(Clock::now()), pid(p) {}
  double coordinator_cpu_s() const { return sample_process(pid).cpu_s - coord0.cpu_s; }
  std::string report() const {
    ProcSample c = sample_process(pid), s = sample_process(0);
    const double wall = since(t0);
    char buf[200];
    std::snprintf(buf, sizeof buf, "coordinator %.2f s CPU (%.0f%% of a core), loadgen %.2f s (%.0f%%)",
                  c.cpu_s - coord0.cpu_s, 100 * (c.cpu_s - coord0.cpu_s) / wall, s.cpu_s - self0.cpu_s,
                  100 * (s.cpu_s - self0.cpu_s) / wall);
    return buf;
  }
};

// Joins every node to `job`; the rendezvous time in seconds, or a negative value on failure.
double rendezvous(std::vector<std::unique_ptr<SimNode>>& nodes, Totals& totals, const Flags& f,
                  const std::string& job) {
  const uint64_t tables0 = totals.tables.load(), failures0 = totals.failures.load(), joined0 = totals.joined.load();
  // Shared with the callbacks, which may outlive a failed rendezvous.
  auto last_ns = std::make_shared<std::atomic<int64_t>>(0);
  const auto t0 = Clock::now();
  for (auto& n : nodes) {
    n->join(job, f.nodes * f.ranks, n->index() * f.ranks, f.ranks, [last_ns, t0](bool ok) {
      if (!ok) return;
      const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
      int64_t prev = last_ns->load();
      while (prev < ns && !last_ns->compare_exchange_weak(prev, ns)) {
      }
    });
  }
  const double sent_s = since(t0);  // issuing the calls is this process's own work
  const uint64_t target = tables0 + f.nodes;
  const auto deadline = t0 + std::chrono::seconds(90);
  double joined_s = -1;  // when every JoinJob was answered
  while (totals.tables.load() < target) {
    if (joined_s < 0 && totals.joined.load() >= joined0 + f.nodes) joined_s = since(t0);
    if (Clock::now() >= deadline || totals.failures.load() > failures0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let stragglers report
      std::printf("rendezvous %s: %llu of %u JoinJob calls answered%s\n", job.c_str(),
                  (unsigned long long)(totals.joined.load() - joined0), f.nodes,
                  joined_s < 0 ? "" : (", all by " + std::to_string(joined_s) + " s").c_str());
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (joined_s < 0) joined_s = since(t0);
  std::printf("rendezvous %s: the last JoinJob sent %.3f s after the first, every one answered at %.3f s; the "
              "peer tables took the rest\n", job.c_str(), sent_s, joined_s);
  return double(last_ns->load()) / 1e9;
}

// When every node but `except` saw an event of `kind` for `job`: the latest arrival, or
// nullopt after `deadline`.
std::optional<Clock::time_point> all_saw(const std::vector<std::unique_ptr<SimNode>>& nodes,
                                         v1::Event::Kind kind, const std::string& job, int except,
                                         Clock::time_point deadline) {
  for (;;) {
    Clock::time_point latest{};
    bool all = true;
    for (const auto& n : nodes) {
      if (int(n->index()) == except) continue;
      bool seen = false;
      for (const auto& e : n->events()) {
        if (e.kind == kind && e.job == job) {
          seen = true;
          latest = std::max(latest, e.at);
          break;
        }
      }
      if (!seen) {
        all = false;
        break;
      }
    }
    if (all) return latest;
    if (Clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int run(const Flags& flags) {
  rlimit nofile{};
  getrlimit(RLIMIT_NOFILE, &nofile);
  nofile.rlim_cur = nofile.rlim_max;  // one connection per simulated node (the coordinator inherits it)
  setrlimit(RLIMIT_NOFILE, &nofile);

  Flags f = flags;
  if (nofile.rlim_cur != RLIM_INFINITY && f.channels + 128 > nofile.rlim_cur) {
    f.channels = std::max<uint32_t>(1, uint32_t(nofile.rlim_cur) - 128);  // nodes then share connections
  }
  pid_t pid = f.pid;
  std::string address = f.address;
  // A cluster secret for this run: the coordinator refuses to start without node credentials.
  static Totals totals;  // outlives the callbacks (see the end of run)
  if (const char* given = std::getenv("GRADSYNC_CLUSTER_SECRET")) totals.cluster_secret = given;
  if (totals.cluster_secret.empty()) totals.cluster_secret = "loadgen-" + std::to_string(getpid()) + "-" + std::to_string(std::random_device{}());
  if (address.empty()) address = start_coordinator(f, totals.cluster_secret, &pid);
  if (address.empty()) return 1;
  // Never destroyed: the process ends with _Exit.
  totals.streams = new StreamQueues(std::clamp((f.nodes + kStreamsPerQueue - 1) / kStreamsPerQueue, 1u, kMaxStreamQueues));
  int rc = 0;
  {
    std::vector<std::shared_ptr<v1::Coordinator::Stub>> stubs;
    std::vector<std::shared_ptr<grpc::Channel>> channels;
    const auto connect_t0 = Clock::now();
    for (uint32_t c = 0; c < f.channels; ++c) {
      grpc::ChannelArguments args = node_channel_args();  // the daemon's: its keepalive pings too
      args.SetInt("gradsync.loadgen.connection", int(c));  // a connection of its own
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, -1);
      channels.push_back(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
      channels.back()->GetState(/*try_to_connect=*/true);
      stubs.push_back(v1::Coordinator::NewStub(channels.back()));
    }
    // Each daemon sets up its own channel in its own process. Here one process plays them all:
    // setting up thousands of channels costs it a few ms each, which would delay the nodes'
    // registrations (and their heartbeats) by seconds. So the connections are made first.
    uint32_t connected = 0;
    for (auto& ch : channels) {
      connected += ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30)) ? 1 : 0;
    }
    std::printf("connections: %u of %u ready in %.2f s (before the measurements)\n", connected, f.channels,
                since(connect_t0));
    std::vector<std::unique_ptr<SimNode>> nodes;
    for (uint32_t i = 0; i < f.nodes; ++i) {
      nodes.push_back(std::make_unique<SimNode>(i, stubs[i % f.channels], &totals));
    }
    const ProcSample base = sample_process(pid);
    const uint32_t lease_ms = f.lease_ms ? f.lease_ms : 5000;
    // Heartbeats on several threads: a write from outside gRPC's threads may do the socket write
    // itself (tens of microseconds), and one thread could not keep 16,384 nodes' rate.
    std::vector<std::unique_ptr<Heartbeats>> heartbeats;
    for (int t = 0; t < kHeartbeatThreads; ++t) {
      heartbeats.push_back(std::make_unique<Heartbeats>(nodes, std::chrono::milliseconds(lease_ms / 3)));
      heartbeats.back()->start();
    }
    // Registrations and their retries on a thread of their own: one node's start must not make
    // another's heartbeat late (they are separate daemons).
    Heartbeats tasks(nodes, std::chrono::milliseconds(lease_ms / 3));
    tasks.start();

    std::printf("loadgen: %u nodes x %u ranks = %u ranks, %u connections, coordinator %s (pid %d)\n",
                f.nodes, f.ranks, f.nodes * f.ranks, f.channels, address.c_str(), int(pid));
    Phase reg(pid);
    std::atomic<uint64_t> failed_registrations{0};
    const auto reg_deadline = Clock::now() + std::chrono::seconds(120);
    totals.later = [&tasks](std::chrono::milliseconds d, std::function<void()> fn) { tasks.later(d, std::move(fn)); };
    // Daemons of a large cluster start over some time, not in one instant: --register-rate
    // nodes a second (0: all at once).
    for (auto& n : nodes) {
      SimNode* node = n.get();
      auto start = [&, node] {
        node->start(reg_deadline, [&, node](bool ok) {
          if (ok) heartbeats[node->index() % kHeartbeatThreads]->add(node->index());
          else ++failed_registrations;
        });
      };
      if (f.register_rate > 0) {
        tasks.later(std::chrono::milliseconds(uint64_t(node->index() * 1000.0 / f.register_rate)), start);
      } else {
        start();
      }
    }
    const bool registered =
        wait_for(totals.registered, f.nodes, reg_deadline + std::chrono::seconds(6), &failed_registrations);
    std::printf("registration: %u of %u nodes in %.2f s, %llu retries (%llu refused busy); %s\n",
                unsigned(totals.registered.load()), f.nodes, since(reg.t0),
                (unsigned long long)totals.register_retries.load(),
                (unsigned long long)totals.register_refused.load(), reg.report().c_str());
    if (!registered) rc = 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // streams open
    const ProcSample after_reg = sample_process(pid);
    std::printf("memory: coordinator RSS %.1f MiB at start, %.1f MiB with %u nodes (%.1f KiB per node), %u threads\n",
                base.rss_bytes / 1048576.0, after_reg.rss_bytes / 1048576.0, f.nodes,
                (double(after_reg.rss_bytes) - double(base.rss_bytes)) / 1024.0 / f.nodes, after_reg.threads);

    if (rc == 0 && f.idle_s > 0) {
      const uint64_t hb0 = totals.heartbeats.load();
      Phase idle(pid);
      std::this_thread::sleep_for(Seconds(f.idle_s));
      const uint64_t beats = totals.heartbeats.load() - hb0;
      const double cpu = idle.coordinator_cpu_s();
      std::printf("idle: %.1f s with %u nodes heartbeating on their event streams every %u ms (%llu heartbeats): "
                  "%s; coordinator %.1f us CPU per heartbeat, %.3f%% of a core per idle node\n",
                  f.idle_s, f.nodes, lease_ms / 3, (unsigned long long)beats, idle.report().c_str(),
                  beats ? 1e6 * cpu / double(beats) : 0.0, 100 * cpu / f.idle_s / f.nodes);
    }

    if (rc == 0) {
      const uint64_t bytes0 = totals.bytes_received.load(), table0 = totals.table_bytes.load();
      Phase join(pid);
      const double took = rendezvous(nodes, totals, f, "loadgen-a");
      const ProcSample after_join = sample_process(pid);
      if (took < 0) {
        std::printf("rendezvous: FAILED after %.2f s: %llu of %u nodes joined, %llu hold their table; %s\n",
                    since(join.t0), (unsigned long long)totals.joined.load(), f.nodes,
                    (unsigned long long)totals.tables.load(), join.report().c_str());
        rc = 1;
      } else {
        std::printf("rendezvous: %.3f s; %s\n", took, join.report().c_str());
        std::printf("bytes from the coordinator during the rendezvous: %llu (peer tables %llu in %llu calls, "
                    "%.0f per node)\n",
                    (unsigned long long)(totals.bytes_received.load() - bytes0),
                    (unsigned long long)(totals.table_bytes.load() - table0),
                    (unsigned long long)totals.table_calls.load(),
                    double(totals.table_bytes.load() - table0) / f.nodes);
        std::printf("memory: coordinator RSS %.1f MiB after the rendezvous (%.2f KiB per rank beyond the "
                    "registered nodes), %u threads\n",
                    after_join.rss_bytes / 1048576.0,
                    (double(after_join.rss_bytes) - double(after_reg.rss_bytes)) / 1024.0 / (f.nodes * f.ranks),
                    after_join.threads);
        const double per_node = double(totals.table_bytes.load() - table0) / f.nodes;
        if (f.max_table_bytes > 0 && per_node > f.max_table_bytes) {
          std::printf("FAIL: %.0f peer-table bytes per node, over the bound of %.0f: tables grow with the job\n",
                      per_node, f.max_table_bytes);
          rc = 1;
        }
        if (f.max_rendezvous_s > 0 && took > f.max_rendezvous_s) {
          std::printf("FAIL: the rendezvous took %.3f s, over the bound of %.1f s\n", took, f.max_rendezvous_s);
          rc = 1;
        }
      }
    }

    if (rc == 0 && f.fanout && f.nodes >= 2) {
      const auto sent = Clock::now();
      nodes[0]->abort("loadgen-a", [](bool) {});
      auto latest = all_saw(nodes, v1::Event::JOB_ABORTED, "loadgen-a", -1, sent + std::chrono::seconds(10));
      if (latest) std::printf("abort fan-out: every node's stream had JOB_ABORTED %.3f s after AbortJob\n",
                              Seconds(*latest - sent).count());
      else {
        std::printf("abort fan-out: FAILED: not every node saw JOB_ABORTED within 10 s\n");
        rc = 1;
      }
      const double again = rendezvous(nodes, totals, f, "loadgen-b");
      std::printf("second rendezvous (job loadgen-b): %.3f s\n", again);
      if (again < 0) rc = 1;
      SimNode& victim = *nodes.back();
      victim.silence();
      const auto expiry = victim.last_heartbeat_ok() + std::chrono::milliseconds(lease_ms);
      latest = all_saw(nodes, v1::Event::NODE_LOST, "loadgen-b", int(victim.index()),
                       expiry + std::chrono::seconds(15));
      if (latest) std::printf("node-loss fan-out: every other node's stream had NODE_LOST %.3f s after the "
                              "silent node's lease expired\n",
                              Seconds(*latest - expiry).count());
      else {
        std::printf("node-loss fan-out: FAILED: not every node saw NODE_LOST within 15 s of lease expiry\n");
        rc = 1;
      }
      totals.lost -= totals.lost.load() > 0 ? 1 : 0;  // the silenced node's own NOT_FOUND, if it asked
    }

    for (auto& h : heartbeats) h->stop();
    tasks.stop();
    std::printf("heartbeats: %llu sent, %llu not sent (%llu of them: the previous one still pending); nodes "
                "declared lost: %llu\n",
                (unsigned long long)totals.heartbeats.load(), (unsigned long long)totals.heartbeat_failures.load(),
                (unsigned long long)totals.heartbeats_busy.load(),
                (unsigned long long)totals.lost.load());
    if (totals.lost.load() > 0) rc = 1;
    if (!totals.first_error.empty()) std::printf("first error: %s\n", totals.first_error.c_str());
    std::fflush(stdout);
    // Calls still in flight hold pointers into the nodes: let them end before anything goes.
    const auto quiet = Clock::now() + std::chrono::seconds(20);
    while (totals.in_flight.load() > 0 && Clock::now() < quiet) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    for (auto& n : nodes) n->stop();
    if (f.address.empty()) {
      kill(pid, SIGTERM);
      int status = 0;
      waitpid(pid, &status, 0);
    }
  }
  // gRPC's callback threads may still hold the stubs; the process ends here without
  // unwinding them (everything it measured is printed).
  std::fflush(stdout);
  std::_Exit(rc);
}

}  // namespace
}  // namespace gradsync::loadgen

int main(int argc, char** argv) {
  // As in the coordinator (coordinator/main.cc): Debian's abseil checks every lock of gRPC's
  // mutexes against a global lock graph, 13% of this process's CPU with 8,192 nodes (perf).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  gradsync::loadgen::Flags flags;
  if (int rc = gradsync::loadgen::parse(argc, argv, flags); rc >= 0) return rc;
  return gradsync::loadgen::run(flags);
}
