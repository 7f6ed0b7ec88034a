// gradsyncctl: an operator's view into the coordinator.
//
//   gradsyncctl [--coordinator HOST:PORT[,HOST:PORT...]] [TLS flags: --tls-ca F --tls-cert F --tls-key F]
//               [--operator-token-file F] jobs
//   gradsyncctl [--coordinator HOST:PORT] describe JOB
//   gradsyncctl [--coordinator HOST:PORT] abort JOB [--reason TEXT]
//   gradsyncctl [--coordinator HOST:PORT] trace JOB [--last N] [--wait-ms MS]
//   gradsyncctl [--coordinator HOST:PORT] top [--once] [--interval-ms N] [JOB]
//   gradsyncctl doctor [--require-gdr] [--sysfs-root DIR]   (no coordinator needed)
//   gradsyncctl topology [--topo-file PATH]                   (no coordinator needed)
//
// The address defaults to $GRADSYNC_COORDINATOR, else 127.0.0.1:29500; the operator credential
// to $GRADSYNC_OPERATOR_TOKEN.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/call_auth.h"
#include "common/grpc_security.h"
#include "common/memory_text.h"
#include "coordinator.grpc.pb.h"
#include "doctor/doctor.h"
#include "top/top.h"
#include "topology/topology_summary.h"
#include "trace/trace_report.h"

namespace {

constexpr std::chrono::seconds kCallTimeout{10};

int usage(FILE* out, int rc) {
  std::fprintf(out,
               "usage: gradsyncctl [--coordinator HOST:PORT[,HOST:PORT...]] COMMAND\n"
               "  jobs                      list jobs: id, generation, state, joined/world, reason\n"
               "  describe JOB              ring order, ranks with their nodes, node details (GPU topology)\n"
               "  abort JOB [--reason TEXT] abort the job's current generation\n"
               "  trace JOB [--last N] [--wait-ms MS]\n"
               "                            every rank's flight recorder, through the daemons: the ranks\n"
               "                            behind, the collective they never entered, who waits for them,\n"
               "                            and each rank's last N collectives (default 8); each daemon also\n"
               "                            writes its ranks' recorders to its log directory\n"
               "  top [--once] [--interval-ms N] [JOB]\n"
               "                            running jobs (or JOB): each rank's path, collectives and MB per\n"
               "                            second, and its last collective, refreshed (--once: one screen)\n"
               "  topology [--topo-file F]  this node's GPUs, links, NICs and rails (no coordinator)\n"
               "%s  --operator-token-file F   the operator credential ($GRADSYNC_OPERATOR_TOKEN); jobs,\n"
               "                            describe and abort need it\n%s",
               gradsync::TlsOptions::usage(), gradsync::doctor::usage_text());
  return rc;
}

int fail(const std::string& what, const grpc::Status& s, const std::string& address) {
  std::fprintf(stderr, "gradsyncctl: %s: %s%s\n", what.c_str(), s.error_message().c_str(),
               s.error_code() == grpc::StatusCode::UNAVAILABLE
                   ? (" (is gradsync-coordinator running at " + address + "?)").c_str()
                   : "");
  return 1;
}

void with_deadline(grpc::ClientContext& ctx) {
  ctx.set_deadline(std::chrono::system_clock::now() + kCallTimeout);
}

// --coordinator a:1,b:2 (coordinators elected through etcd): the one that serves. A standby
// names the leader in its UNAVAILABLE answer; a dead one is skipped. None: the first, whose
// error the command then reports.
std::string find_leader(const std::string& list, const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                        const std::shared_ptr<gradsync::CallAuth>& auth) {
  std::vector<std::string> all;
  for (size_t start = 0; start <= list.size();) {
    size_t comma = std::min(list.find(',', start), list.size());
    if (comma > start) all.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  for (const auto& address : all) {
    auto stub = gradsync::v1::Coordinator::NewStub(
        gradsync::coordinator_channel(address, credentials, grpc::ChannelArguments(), auth));
    grpc::ClientContext ctx;
    with_deadline(ctx);
    gradsync::v1::ListJobsResponse resp;
    grpc::Status s = stub->ListJobs(&ctx, {}, &resp);
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE) return address;  // it serves (or refuses us itself)
    const std::string& msg = s.error_message();
    if (size_t at = msg.find(gradsync::kLeaderIsPhrase); at != std::string::npos) {
      at += std::string(gradsync::kLeaderIsPhrase).size();
      return msg.substr(at, msg.find_first_of(" ,;)", at) - at);
    }
  }
  return all.empty() ? list : all.front();
}

// gradsyncctl topology [--topo-file PATH]: this node's GPU topology as gradsyncd finds it at
// start (NVML, else CUDA peer access, else PCIe paths; or the file), without a coordinator.
int topology_command(const std::vector<std::string>& args) {
  std::string file;
  if (const char* env = std::getenv("GRADSYNC_TOPO_FILE"); env && *env) file = env;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--topo-file" && i + 1 < args.size()) file = args[++i];
    else return usage(stderr, 2);
  }
  auto topo = gradsync::topology::node_gpu_topology(file);
  if (!topo.ok()) {
    std::fprintf(stderr, "gradsyncctl topology: %s\n", topo.status().message().c_str());
    return 1;
  }
  std::fputs(gradsync::topology::render_summary(gradsync::topology::summarize(*topo), "").c_str(), stdout);
  return 0;
}

// gradsyncctl trace JOB: the coordinator asks the job's daemons for their ranks' flight
// recorders and answers with what came within `wait_ms`.
int trace_command(gradsync::v1::Coordinator::Stub& stub, const std::string& job, size_t last, uint32_t wait_ms,
                  const std::string& address) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(wait_ms) + kCallTimeout);
  gradsync::v1::TraceJobRequest req;
  req.set_job_id(job);
  req.set_timeout_ms(wait_ms);
  gradsync::v1::TraceJobResponse resp;
  const auto t0 = std::chrono::steady_clock::now();
  grpc::Status s = stub.TraceJob(&ctx, req, &resp);
  if (!s.ok()) return fail("trace " + job, s, address);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const auto& j = resp.summary();
  std::printf("job %s generation %llu: %s, %u ranks; flight recorders of %d rank(s) gathered in %.0f ms\n",
              j.job_id().c_str(), static_cast<unsigned long long>(j.generation()), j.state().c_str(), j.world_size(),
              resp.ranks_size(), ms);
  for (const auto& m : resp.missing_nodes()) std::printf("missing: %s\n", m.c_str());
  std::vector<gradsync::v1::RankTrace> ranks(resp.ranks().begin(), resp.ranks().end());
  std::fputs(gradsync::trace::render(ranks, j.world_size(), last).c_str(), stdout);
  if (resp.dumps_size() > 0) std::printf("\n");
  for (const auto& d : resp.dumps()) std::printf("dump: %s\n", d.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // doctor reads sysfs/procfs only: dispatch before any coordinator option or stub.
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "doctor") {
      return gradsync::doctor::run(std::vector<std::string>(argv + i + 1, argv + argc), stdout,
                                   stderr);
    }
    if (a == "topology") return topology_command(std::vector<std::string>(argv + i + 1, argv + argc));
    if (a == "--coordinator") ++i;  // skip its value
    else if (a.rfind("--", 0) != 0) break;
  }
  std::string address = "127.0.0.1:29500";
  if (const char* env = std::getenv("GRADSYNC_COORDINATOR"); env && *env) address = env;
  std::vector<std::string> args;
  std::string reason = "aborted by an operator (gradsyncctl)";
  gradsync::TlsOptions tls;
  gradsync::AuthOptions auth;
  size_t last = 8;
  uint32_t wait_ms = 3000;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string tls_error;
    if (tls.take_flag(argc, argv, &i, &tls_error) || auth.take_flag(argc, argv, &i, &tls_error)) {
      if (!tls_error.empty()) {
        std::fprintf(stderr, "gradsyncctl: %s\n", tls_error.c_str());
        return 2;
      }
      continue;
    }
    if (a == "--coordinator" && i + 1 < argc) address = argv[++i];
    else if (a == "--reason" && i + 1 < argc) reason = argv[++i];
    else if (a == "--last" && i + 1 < argc) last = std::strtoul(argv[++i], nullptr, 10);
    else if (a == "--wait-ms" && i + 1 < argc) wait_ms = uint32_t(std::strtoul(argv[++i], nullptr, 10));
    else if (a == "--once") args.push_back(a);  // top's
    else if (a == "--interval-ms" && i + 1 < argc) {
      args.push_back(a);
      args.push_back(argv[++i]);
    }
    else if (a == "--help" || a == "-h") return usage(stdout, 0);
    else if (a.rfind("--", 0) == 0) return usage(stderr, 2);
    else args.push_back(a);
  }
  if (args.empty()) return usage(stderr, 2);
  tls.add_env();
  auto credentials = gradsync::channel_credentials(tls, address);
  if (!credentials.ok()) {
    std::fprintf(stderr, "gradsyncctl: %s\n", credentials.status().message().c_str());
    return 2;
  }
  // The operator credential goes with every call (jobs, describe and abort need it).
  auto operator_token = auth.operator_token();
  if (!operator_token.ok()) {
    std::fprintf(stderr, "gradsyncctl: %s\n", operator_token.status().message().c_str());
    return 2;
  }
  auto call_auth = std::make_shared<gradsync::CallAuth>("", *operator_token);
  if (address.find(',') != std::string::npos) address = find_leader(address, *credentials, call_auth);
  auto stub = gradsync::v1::Coordinator::NewStub(
      gradsync::coordinator_channel(address, *credentials, grpc::ChannelArguments(), call_auth));

  if (args[0] == "jobs" && args.size() == 1) {
    grpc::ClientContext ctx;
    with_deadline(ctx);
    gradsync::v1::ListJobsResponse resp;
    grpc::Status s = stub->ListJobs(&ctx, {}, &resp);
    if (!s.ok()) return fail("jobs", s, address);
    std::printf("%-24s %5s %-9s %9s  %s\n", "JOB", "GEN", "STATE", "JOINED", "REASON");
    for (const auto& j : resp.jobs()) {
      std::printf("%-24s %5llu %-9s %4u/%-4u  %s\n", j.job_id().c_str(),
                  static_cast<unsigned long long>(j.generation()), j.state().c_str(), j.joined(),
                  j.world_size(), j.reason().c_str());
    }
    return 0;
  }
  if (args[0] == "describe" && args.size() == 2) {
    // Paged by the coordinator (no message grows with the job): gather every page first.
    gradsync::v1::DescribeJobResponse resp;
    for (uint32_t page = 0, pages = 1; page < pages && page < 1024; ++page) {
      grpc::ClientContext ctx;
      with_deadline(ctx);
      gradsync::v1::DescribeJobRequest req;
      req.set_job_id(args[1]);
      req.set_page(page);
      gradsync::v1::DescribeJobResponse part;
      grpc::Status s = stub->DescribeJob(&ctx, req, &part);
      if (!s.ok()) return fail("describe " + args[1], s, address);
      pages = part.pages();
      if (page == 0) {
        resp = std::move(part);
        continue;
      }
      resp.mutable_peers()->MergeFrom(part.peers());
      resp.mutable_ring()->MergeFrom(part.ring());
      resp.mutable_nodes()->MergeFrom(part.nodes());
      resp.mutable_paths()->MergeFrom(part.paths());
    }
    const auto& j = resp.summary();
    std::printf("job %s generation %llu: %s, %u of %u ranks joined%s%s\n", j.job_id().c_str(),
                static_cast<unsigned long long>(j.generation()), j.state().c_str(), j.joined(),
                j.world_size(), j.reason().empty() ? "" : "; ", j.reason().c_str());
    std::printf("ring:");
    for (uint32_t r : resp.ring()) std::printf(" %u", r);
    std::printf("\n%-6s %-16s %-20s %s\n", "RANK", "NODE", "HOST", "ENDPOINT");
    for (const auto& p : resp.peers()) {
      std::printf("%-6u %-16s %-20s %s\n", p.rank(), p.node_id().c_str(), p.hostname().c_str(),
                  p.endpoint().c_str());
    }
    for (const auto& n : resp.nodes()) {
      std::printf("node %s host %s: %u cpus, %d gpus, %d nics, proxy %s, channels over %s (%s)\n",
                  n.node_name().c_str(), n.hostname().c_str(), n.cpus(), n.gpus_size(), n.nics_size(),
                  n.data_endpoint().c_str(), n.transport().empty() ? "tcp" : n.transport().c_str(),
                  n.transport_why().c_str());
      std::fputs(gradsync::topology::render_summary(n.gpu_topology(), "  ").c_str(), stdout);
    }
    for (const auto& p : resp.paths()) {
      std::printf("rank %u data path: %s (%s)%s\n", p.rank(), p.path().c_str(), p.why().c_str(),
                  gradsync::memory_text(p.gpu_memory_bytes(), p.pinned_host_bytes()).c_str());
    }
    return 0;
  }
  if (args[0] == "abort" && args.size() == 2) {
    grpc::ClientContext ctx;
    with_deadline(ctx);
    gradsync::v1::AbortJobRequest req;
    req.set_job_id(args[1]);
    req.set_reason(reason);
    req.set_failed_rank(-1);
    gradsync::v1::AbortJobResponse resp;
    grpc::Status s = stub->AbortJob(&ctx, req, &resp);
    if (!s.ok()) return fail("abort " + args[1], s, address);
    std::printf("aborted job %s\n", args[1].c_str());
    return 0;
  }
  if (args[0] == "top") {
    return gradsync::top::run(*stub, std::vector<std::string>(args.begin() + 1, args.end()), stdout, stderr);
  }
  if (args[0] == "trace" && args.size() == 2) return trace_command(*stub, args[1], last, wait_ms, address);
  return usage(stderr, 2);
}
