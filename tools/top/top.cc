#include "top/top.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <map>
#include <thread>

namespace gradsync::top {
namespace {

constexpr std::chrono::milliseconds kGatherWait{2000};
constexpr std::chrono::seconds kCallSlack{5};

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

std::map<uint32_t, RankSample> gather(v1::Coordinator::Stub& stub, const std::string& job, std::string* error) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kGatherWait + kCallSlack);
  v1::TraceJobRequest req;
  req.set_job_id(job);
  req.set_max_records(1);
  req.set_timeout_ms(uint32_t(kGatherWait.count()));
  req.set_quiet(true);
  v1::TraceJobResponse resp;
  grpc::Status s = stub.TraceJob(&ctx, req, &resp);
  std::map<uint32_t, RankSample> out;
  if (!s.ok()) {
    *error = s.error_message();
    return out;
  }
  for (const auto& t : resp.ranks()) {
    RankSample r;
    r.rank = t.rank();
    r.host = t.host();
    r.path = t.path().empty() ? "?" : t.path();
    r.calls = t.calls_total();
    r.bytes = t.bytes_total();
    r.read_ns = t.read_ns();
    if (t.records_size() > 0) {
      const auto& last = t.records(t.records_size() - 1);
      r.last = "#" + std::to_string(last.seq()) + " " + last.kind() + " " + last.state();
      if (last.state() == "started" && last.waiting_for() >= 0) r.last += " (waiting for " + std::to_string(last.waiting_for()) + ")";
    }
    if (!t.connected()) r.last += " [exited]";
    out[r.rank] = r;
  }
  for (const auto& m : resp.missing_nodes()) *error += (error->empty() ? "" : "; ") + m;
  return out;
}

std::vector<RankSample> values(const std::map<uint32_t, RankSample>& m) {
  std::vector<RankSample> v;
  for (const auto& [r, s] : m) v.push_back(s);
  return v;
}

}  // namespace

std::string render_job(const v1::JobSummary& job, const std::vector<RankSample>& before,
                       const std::vector<RankSample>& after) {
  char line[512];
  std::snprintf(line, sizeof line, "job %s generation %llu: %s, %u/%u ranks\n", job.job_id().c_str(),
                static_cast<unsigned long long>(job.generation()), job.state().c_str(), job.joined(), job.world_size());
  std::string s = line;
  std::snprintf(line, sizeof line, "  %5s %-16s %-13s %10s %10s %10s  %s\n", "RANK", "HOST", "PATH", "CALLS/S", "MB/S",
                "CALLS", "LAST");
  s += line;
  std::map<uint32_t, const RankSample*> prev;
  for (const auto& r : before) prev[r.rank] = &r;
  for (const auto& r : after) {
    double calls_rate = 0, mb_rate = 0;
    auto p = prev.find(r.rank);
    if (p != prev.end() && r.read_ns > p->second->read_ns) {
      const double secs = double(r.read_ns - p->second->read_ns) / 1e9;
      calls_rate = double(r.calls - std::min(r.calls, p->second->calls)) / secs;
      mb_rate = double(r.bytes - std::min(r.bytes, p->second->bytes)) / secs / 1e6;
    }
    std::snprintf(line, sizeof line, "  %5u %-16s %-13s %10.1f %10.1f %10llu  %s\n", r.rank, r.host.c_str(),
                  r.path.c_str(), calls_rate, mb_rate, static_cast<unsigned long long>(r.calls), r.last.c_str());
    s += line;
  }
  return s;
}

int run(v1::Coordinator::Stub& stub, const std::vector<std::string>& args, FILE* out, FILE* err) {
  bool once = false;
  long interval_ms = 1000;
  std::string only;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--once") once = true;
    else if (args[i] == "--interval-ms" && i + 1 < args.size()) interval_ms = std::max(100L, std::atol(args[++i].c_str()));
    else if (args[i].rfind("--", 0) != 0 && only.empty()) only = args[i];
    else {
      std::fprintf(err, "usage: gradsyncctl top [--once] [--interval-ms N] [JOB]\n");
      return 2;
    }
  }
  if (!once) {
    ::signal(SIGINT, on_signal);
    ::signal(SIGTERM, on_signal);
  }
  std::map<std::string, std::map<uint32_t, RankSample>> previous;
  for (int round = 0; !g_stop.load(); ++round) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kCallSlack);
    v1::ListJobsResponse jobs;
    grpc::Status s = stub.ListJobs(&ctx, {}, &jobs);
    if (!s.ok()) {
      std::fprintf(err, "gradsyncctl top: jobs: %s\n", s.error_message().c_str());
      return 1;
    }
    std::vector<v1::JobSummary> shown;
    for (const auto& j : jobs.jobs()) {
      if (only.empty() ? j.state() == "active" : j.job_id() == only) shown.push_back(j);
    }
    std::map<std::string, std::map<uint32_t, RankSample>> now;
    std::map<std::string, std::string> errors;
    for (const auto& j : shown) now[j.job_id()] = gather(stub, j.job_id(), &errors[j.job_id()]);
    // The first round only takes the first gathering: rates need two.
    if (round > 0 || !once) {
      std::string screen;
      std::time_t t = std::time(nullptr);
      char when[32];
      std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
      screen += std::string("gradsyncctl top  ") + when + "  " + std::to_string(shown.size()) + " job(s)" +
                (once ? "" : ", every " + std::to_string(interval_ms) + " ms (Ctrl-C ends)") + "\n\n";
      for (const auto& j : shown) {
        screen += render_job(j, values(previous[j.job_id()]), values(now[j.job_id()]));
        if (!errors[j.job_id()].empty()) screen += "  (" + errors[j.job_id()] + ")\n";
        screen += "\n";
      }
      if (shown.empty()) screen += only.empty() ? "no active job\n" : "no job " + only + "\n";
      if (!once) std::fputs("\033[H\033[2J", out);
      std::fputs(screen.c_str(), out);
      std::fflush(out);
      if (once) return 0;
    }
    previous = std::move(now);
    for (long waited = 0; waited < interval_ms && !g_stop.load(); waited += 50) {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50L, interval_ms - waited)));
    }
  }
  return 0;
}

}  // namespace gradsync::top
