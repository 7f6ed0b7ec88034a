#include "daemon/trace_dump.h"

#include <sys/stat.h>

#include <cstdio>
#include <ctime>
#include <fstream>

#include "channel/flight_recorder.h"
#include "collectives/collective.h"
#include "trace/trace_report.h"

namespace gradsync {
namespace {

v1::TraceRecord to_proto(const Record& r) {
  v1::TraceRecord p;
  p.set_seq(r.seq);
  p.set_kind(to_string(CollectiveKind(r.kind)));
  p.set_count(r.count);
  p.set_type(to_string(DataType(r.type)));
  p.set_op(to_string(ReduceOp(r.op)));
  p.set_algorithm(to_string(Algorithm(r.algorithm)));
  p.set_path(to_string(r.path));
  p.set_state(to_string(r.state));
  p.set_queued_ns(r.queued_ns);
  p.set_started_ns(r.started_ns);
  p.set_ended_ns(r.ended_ns);
  p.set_waiting_for(r.waiting_for);
  p.set_root(r.root);
  if (r.state == RecordState::kFailed) p.set_error(code_name(Code(r.code)));
  p.set_internal(r.flags & kRecordInternal);
  p.set_gpu_staged(r.flags & kRecordGpuStaged);
  return p;
}

// Job ids allow [A-Za-z0-9._:@+-] (common/limits.h); keep file names to the portable part.
std::string file_safe(const std::string& s) {
  std::string out;
  for (char c : s) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_') ? c : '_';
  return out;
}

}  // namespace

std::vector<v1::RankTrace> read_local_traces(const LocalJob& job, const std::string& host, const std::string& node_id,
                                             uint32_t max_records) {
  std::vector<v1::RankTrace> out;
  if (!job.shm || job.layout.recorders == 0) return out;
  const int64_t now = wall_clock_ns();
  for (uint32_t i = 0; i < job.local_ranks.size() && i < job.layout.recorders; ++i) {
    const uint32_t rank = job.local_ranks[i];
    const void* at = static_cast<const char*>(job.shm->data()) + job.layout.recorder_offset(i);
    RecorderSnapshot snap = read_recorder(at, job.layout.recorder_entries, rank, job.world_size);
    v1::RankTrace t;
    t.set_rank(rank);
    auto m = job.members.find(rank);
    // The pid the daemon saw on the socket, not the one the trainer wrote.
    t.set_pid(m != job.members.end() ? m->second.pid : snap.pid);
    t.set_connected(m != job.members.end() && m->second.connected);
    t.set_host(host);
    t.set_node_id(node_id);
    t.set_recorded(snap.written);
    t.set_skipped(snap.skipped);
    t.set_problem(snap.problem);
    t.set_read_ns(now);
    StatsCopy stats;
    if (read_stats(at, job.layout.recorder_entries, rank, &stats)) {
      uint64_t calls = 0, bytes = 0;
      for (int k = 0; k < kStatKinds; ++k) {
        for (int z = 0; z < kStatSizes; ++z) {
          calls += stats.calls[k][z];
          bytes += stats.bytes[k][z];
        }
      }
      t.set_calls_total(calls);
      t.set_bytes_total(bytes);
      t.set_path(stats.path_known ? to_string(stats.path) : "unknown");
    }
    const size_t first = snap.records.size() > max_records ? snap.records.size() - max_records : 0;
    for (size_t k = first; k < snap.records.size(); ++k) *t.add_records() = to_proto(snap.records[k]);
    out.push_back(std::move(t));
  }
  return out;
}

Result<std::string> dump_traces(const std::string& dir, const LocalJob& job, const std::string& node_id,
                                const std::vector<v1::RankTrace>& traces, const std::string& why) {
  ::mkdir(dir.c_str(), 0750);
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char when[32];
  std::strftime(when, sizeof when, "%Y%m%dT%H%M%SZ", &tm);
  static std::atomic<uint32_t> serial{0};
  const std::string path = dir + "/trace-" + file_safe(job.id) + "-gen" + std::to_string(job.generation) + "-" +
                           file_safe(node_id) + "-" + when + "-" + std::to_string(serial++) + ".txt";
  std::ofstream f(path);
  f << "flight recorders of job " << job.id << " generation " << job.generation << " on node " << node_id
    << " (" << traces.size() << " local rank(s) of " << job.world_size << "), written because: " << why << "\n";
  f << "only this node's ranks are here: `gradsyncctl trace " << job.id << "` gathers every node's\n\n";
  f << trace::render(traces, job.world_size, SIZE_MAX);
  f.close();
  if (!f) return Status(Code::kInternal, "cannot write the flight recorder dump " + path + ": " + errno_string("write"));
  return path;
}

}  // namespace gradsync
