#include "trace/trace_report.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

namespace gradsync::trace {
namespace {

bool open_state(const v1::TraceRecord& r) { return r.state() == "queued" || r.state() == "started"; }

std::string seconds(int64_t ns) {
  char buf[32];
  if (ns < 0) ns = 0;
  if (ns < 1'000'000) std::snprintf(buf, sizeof buf, "%.0f us", double(ns) / 1e3);
  else if (ns < 1'000'000'000) std::snprintf(buf, sizeof buf, "%.1f ms", double(ns) / 1e6);
  else std::snprintf(buf, sizeof buf, "%.1f s", double(ns) / 1e9);
  return buf;
}

std::string call_text(const v1::TraceRecord& r) {
  std::string s = "#" + std::to_string(r.seq()) + " " + r.kind() + " count=" + std::to_string(r.count()) + " " +
                  r.type();
  if (r.kind() == "allreduce" || r.kind() == "reduce_scatter") s += " " + r.op();
  if (r.kind() == "broadcast") s += " root=" + std::to_string(r.root());
  s += " " + r.algorithm() + " " + r.path();
  if (r.internal()) s += " (start-up tuning)";
  if (r.gpu_staged()) s += " (GPU, host-staged)";
  return s;
}

const v1::TraceRecord* find_seq(const v1::RankTrace& t, uint64_t seq) {
  for (const auto& r : t.records()) {
    if (r.seq() == seq) return &r;
  }
  return nullptr;
}

// The record with the highest seq, or null.
const v1::TraceRecord* last_record(const v1::RankTrace& t) {
  const v1::TraceRecord* best = nullptr;
  for (const auto& r : t.records()) {
    if (!best || r.seq() > best->seq()) best = &r;
  }
  return best;
}

}  // namespace

std::string join_ranks(const std::vector<uint32_t>& ranks) {
  std::string s;
  for (uint32_t r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

std::string render_record(const v1::TraceRecord& r, int64_t now_ns) {
  std::string s = call_text(r) + ": " + r.state();
  if (r.state() == "queued") {
    s += " " + seconds(now_ns - r.queued_ns()) + " ago";
  } else if (r.state() == "started") {
    s += " " + seconds(now_ns - r.started_ns()) + " ago";
    if (r.waiting_for() >= 0) s += ", waiting for rank " + std::to_string(r.waiting_for());
  } else {
    s += " in " + seconds(r.ended_ns() - r.started_ns()) + ", " + seconds(now_ns - r.ended_ns()) + " ago";
    if (r.state() == "failed") {
      s += " (" + r.error() + (r.waiting_for() >= 0 ? ", last waited for rank " + std::to_string(r.waiting_for()) : "") +
           ")";
    }
  }
  return s;
}

Diagnosis diagnose(const std::vector<v1::RankTrace>& ranks, uint32_t world_size) {
  Diagnosis d;
  std::map<uint32_t, const v1::RankTrace*> by_rank;
  for (const auto& t : ranks) {
    if (t.rank() < world_size) by_rank[t.rank()] = &t;
  }
  for (uint32_t r = 0; r < world_size; ++r) {
    if (!by_rank.count(r)) d.unknown.push_back(r);
  }
  if (!d.unknown.empty()) {
    d.lines.push_back("no flight recorder from rank(s) " + join_ranks(d.unknown) +
                      " (their node did not answer, or they never joined)");
  }
  // The last collective each rank entered (queued or later), -1 for none.
  std::map<uint32_t, int64_t> last;
  int64_t front = -1;
  for (const auto& [r, t] : by_rank) {
    if (!t->problem().empty()) d.lines.push_back("rank " + std::to_string(r) + ": " + t->problem());
    const v1::TraceRecord* l = last_record(*t);
    int64_t seq = l ? int64_t(l->seq()) : -1;
    // A recorder that wrapped keeps only the last N: `recorded` still counts every one.
    if (t->recorded() > 0) seq = std::max(seq, int64_t(t->recorded()) - 1);
    last[r] = seq;
    front = std::max(front, seq);
  }
  if (by_rank.empty()) return d;
  for (const auto& [r, seq] : last) {
    if (seq < front) d.behind.push_back(r);
  }
  // Failures first: they usually explain the rest.
  for (const auto& [r, t] : by_rank) {
    for (const auto& rec : t->records()) {
      if (rec.state() == "failed") {
        d.lines.push_back("rank " + std::to_string(r) + ": " + render_record(rec, t->read_ns()));
        break;
      }
    }
  }
  if (d.behind.empty()) {
    std::vector<uint32_t> inside;
    for (const auto& [r, t] : by_rank) {
      const v1::TraceRecord* l = last_record(*t);
      if (l && open_state(*l)) inside.push_back(r);
    }
    if (front < 0) d.lines.push_back("no collective recorded yet on any rank");
    else if (inside.empty()) d.lines.push_back("no rank is behind: every rank finished collective #" + std::to_string(front));
    else d.lines.push_back("no rank is behind: every rank entered collective #" + std::to_string(front) +
                           "; rank(s) " + join_ranks(inside) + " still inside it");
    return d;
  }
  int64_t lowest = front;
  for (uint32_t b : d.behind) lowest = std::min(lowest, last[b]);
  d.never_entered = lowest + 1;
  // The behind ranks, grouped by where they stopped.
  std::map<int64_t, std::vector<uint32_t>> stopped;
  for (uint32_t b : d.behind) stopped[last[b]].push_back(b);
  for (const auto& [seq, group] : stopped) {
    const v1::RankTrace& t = *by_rank.at(group.front());
    std::string who = (group.size() == 1 ? "rank " : "ranks ") + join_ranks(group);
    std::string line = who + (group.size() == 1 ? " is" : " are") + " behind: ";
    const v1::TraceRecord* l = seq >= 0 ? find_seq(t, uint64_t(seq)) : nullptr;
    if (seq < 0) line += "no collective recorded";
    else if (l) line += "last entered " + render_record(*l, t.read_ns());
    else line += "last entered collective #" + std::to_string(seq);
    line += "; never entered collective #" + std::to_string(seq + 1);
    if (!t.connected()) line += " (its process is no longer connected to gradsyncd: exited or killed)";
    d.lines.push_back(line);
  }
  // Who waits for them: the ranks inside a collective some behind rank never entered.
  std::map<int64_t, std::vector<uint32_t>> inside;
  std::map<int64_t, const v1::TraceRecord*> sample;
  std::map<int64_t, std::pair<int64_t, int64_t>> since;  // oldest, newest start (ns ago)
  for (const auto& [r, t] : by_rank) {
    for (const auto& rec : t->records()) {
      if (!open_state(rec) || int64_t(rec.seq()) < d.never_entered) continue;
      inside[rec.seq()].push_back(r);
      sample[rec.seq()] = &rec;
      int64_t ago = t->read_ns() - (rec.state() == "started" ? rec.started_ns() : rec.queued_ns());
      auto& s = since.try_emplace(rec.seq(), ago, ago).first->second;
      s.first = std::max(s.first, ago);
      s.second = std::min(s.second, ago);
      break;  // the first open one is where the rank is
    }
  }
  for (const auto& [seq, group] : inside) {
    std::vector<uint32_t> absent;
    for (const auto& [r, l] : last) {
      if (l < seq) absent.push_back(r);
    }
    std::string line = (group.size() == 1 ? "rank " : "ranks ") + join_ranks(group) + (group.size() == 1 ? " waits" : " wait") +
                       " in collective #" + std::to_string(seq) + " for " +
                       (absent.size() == 1 ? "rank " : "ranks ") + join_ranks(absent) + ": " + call_text(*sample[seq]) +
                       ", entered " + seconds(since[seq].second) +
                       (since[seq].first != since[seq].second ? " to " + seconds(since[seq].first) : "") + " ago";
    if (seq == d.never_entered) d.waiting = group;
    d.lines.push_back(line);
    std::string direct;
    for (uint32_t r : group) {
      const v1::TraceRecord* rec = find_seq(*by_rank.at(r), uint64_t(seq));
      if (rec && rec->waiting_for() >= 0) {
        direct += (direct.empty() ? "" : ", ") + std::to_string(r) + " -> " + std::to_string(rec->waiting_for());
      }
    }
    if (!direct.empty()) d.lines.push_back("  each waits on the channel from/to (rank -> rank it waits for): " + direct);
  }
  return d;
}

std::string render_rank(const v1::RankTrace& t, size_t last_n) {
  std::string s = "rank " + std::to_string(t.rank()) + " (host " + t.host() + ", node " + t.node_id() + ", pid " +
                  std::to_string(t.pid()) + "): " + std::to_string(t.recorded()) + " collectives recorded" +
                  (t.connected() ? "" : ", process no longer connected") +
                  (t.skipped() ? ", " + std::to_string(t.skipped()) + " entries unreadable" : "") + "\n";
  if (!t.problem().empty()) s += "  " + t.problem() + "\n";
  const int n = t.records_size();
  for (int i = std::max(0, n - int(last_n)); i < n; ++i) s += "  " + render_record(t.records(i), t.read_ns()) + "\n";
  return s;
}

std::string render(const std::vector<v1::RankTrace>& ranks, uint32_t world_size, size_t last_n) {
  Diagnosis d = diagnose(ranks, world_size);
  std::string s;
  for (const auto& line : d.lines) s += line + "\n";
  std::vector<const v1::RankTrace*> sorted;
  for (const auto& t : ranks) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->rank() < b->rank(); });
  for (const auto* t : sorted) s += "\n" + render_rank(*t, last_n);
  return s;
}

}  // namespace gradsync::trace
