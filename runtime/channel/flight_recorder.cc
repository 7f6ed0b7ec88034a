#include "channel/flight_recorder.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "gradsync/gradsync.h"

namespace gradsync {
namespace {

// How often the reader retries an entry the trainer is writing at that moment.
constexpr int kReadTries = 4;

// The largest valid values of the enums stored as bytes (gradsync.h, collective.h).
constexpr uint8_t kMaxKind = 5;       // CollectiveKind::kBarrier
constexpr uint8_t kMaxType = 7;       // DataType::kInt64
constexpr uint8_t kMaxOp = 4;         // ReduceOp::kAvg
constexpr uint8_t kMaxAlgorithm = 2;  // Algorithm::kTree
constexpr uint8_t kMaxCode = 11;      // Code::kUnimplemented

// A plain copy of an entry's fields (the reader checks them afterwards).
Record copy_entry(const RecorderEntry* e) {
  Record r;
  r.seq = e->seq;
  r.kind = e->kind;
  r.type = e->type;
  r.op = e->op;
  r.algorithm = e->algorithm;
  r.state = RecordState(e->state);
  r.path = RecordPath(e->path);
  r.flags = e->flags;
  r.code = e->code;
  r.root = e->root;
  r.waiting_for = e->waiting_for.load(std::memory_order_relaxed);
  r.count = e->count;
  r.queued_ns = e->queued_ns;
  r.started_ns = e->started_ns;
  r.ended_ns = e->ended_ns;
  return r;
}

}  // namespace

const char* to_string(RecordState state) {
  switch (state) {
    case RecordState::kQueued: return "queued";
    case RecordState::kStarted: return "started";
    case RecordState::kDone: return "done";
    case RecordState::kFailed: return "failed";
  }
  return "unknown";
}

const char* to_string(RecordPath path) {
  switch (path) {
    case RecordPath::kLocal: return "shm";
    case RecordPath::kRankSockets: return "rank-sockets";
    case RecordPath::kDaemon: return "daemon";
    case RecordPath::kMixed: return "mixed";
  }
  return "unknown";
}

const uint64_t kStatSizeBounds[kStatSizes - 1] = {1u << 10, 64u << 10, 1u << 20, 16u << 20, 256u << 20};
const double kStatLatencyBounds[kStatLatencyBuckets - 1] = {1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1, 10, 100, 1000};

int stat_size_bucket(uint64_t bytes) {
  int z = 0;
  while (z < kStatSizes - 1 && bytes > kStatSizeBounds[z]) ++z;
  return z;
}

int stat_latency_bucket(int64_t ns) {
  int b = 0;
  while (b < kStatLatencyBuckets - 1 && double(ns) > kStatLatencyBounds[b] * 1e9) ++b;
  return b;
}

bool read_stats(const void* at, uint32_t capacity, uint32_t rank, StatsCopy* out) {
  const auto* h = static_cast<const RecorderHeader*>(at);
  if (h->magic != kRecorderMagic || h->capacity != capacity || h->rank != rank) return false;
  const RankStats* s = recorder_stats(const_cast<void*>(at));
  const uint32_t path = s->path.load(std::memory_order_relaxed);
  out->path_known = path >= 1 && path <= 4;
  out->path = out->path_known ? RecordPath(path) : RecordPath::kLocal;
  for (int k = 0; k < kStatKinds; ++k) {
    for (int z = 0; z < kStatSizes; ++z) {
      out->calls[k][z] = s->calls[k][z].load(std::memory_order_relaxed);
      out->bytes[k][z] = s->bytes[k][z].load(std::memory_order_relaxed);
      out->latency_ns[k][z] = s->latency_ns[k][z].load(std::memory_order_relaxed);
      for (int b = 0; b < kStatLatencyBuckets; ++b) out->latency[k][z][b] = s->latency[k][z][b].load(std::memory_order_relaxed);
    }
  }
  for (int c = 0; c < kStatCodes; ++c) out->failures[c] = s->failures[c].load(std::memory_order_relaxed);
  return true;
}

int64_t wall_clock_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

void init_recorder(void* at, uint32_t capacity, uint32_t rank) {
  auto* h = new (at) RecorderHeader{};
  h->capacity = capacity;
  h->rank = rank;
  new (recorder_stats(at)) RankStats{};
  RecorderEntry* entries = recorder_entries(at);
  for (uint32_t i = 0; i < capacity; ++i) new (&entries[i]) RecorderEntry{};
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kRecorderMagic;
}

FlightRecorder::FlightRecorder(void* at, uint32_t capacity) {
  if (at == nullptr || capacity == 0) return;
  header_ = static_cast<RecorderHeader*>(at);
  stats_ = recorder_stats(at);
  entries_ = recorder_entries(at);
  capacity_ = capacity;
  header_->pid.store(uint32_t(::getpid()), std::memory_order_relaxed);
}

void FlightRecorder::write(RecorderEntry* e, const Record& r) {
  const uint32_t v = e->version.load(std::memory_order_relaxed);
  e->version.store(v | 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  e->seq = r.seq;
  e->kind = r.kind;
  e->type = r.type;
  e->op = r.op;
  e->algorithm = r.algorithm;
  e->state = uint8_t(r.state);
  e->path = uint8_t(r.path);
  e->flags = r.flags;
  e->code = r.code;
  e->root = r.root;
  e->waiting_for.store(r.waiting_for, std::memory_order_relaxed);
  e->count = r.count;
  e->queued_ns = r.queued_ns;
  e->started_ns = r.started_ns;
  e->ended_ns = r.ended_ns;
  e->version.store((v | 1) + 1, std::memory_order_release);
}

void FlightRecorder::queued(const Record& r) {
  if (!enabled()) return;
  std::lock_guard lock(mu_);
  Record copy = r;
  copy.state = RecordState::kQueued;
  copy.waiting_for = -1;
  if (copy.queued_ns == 0) copy.queued_ns = wall_clock_ns();
  write(entry(r.seq), copy);
  uint64_t next = uint64_t(r.seq) + 1;
  if (header_->written.load(std::memory_order_relaxed) < next) header_->written.store(next, std::memory_order_release);
}

void FlightRecorder::started(uint32_t seq, uint8_t algorithm) {
  if (!enabled()) return;
  std::lock_guard lock(mu_);
  RecorderEntry* e = entry(seq);
  if (e->seq != seq) return;  // overwritten by a later call already (a queue deeper than N)
  Record r = copy_entry(e);
  r.state = RecordState::kStarted;
  r.algorithm = algorithm;
  r.started_ns = wall_clock_ns();
  write(e, r);
}

void FlightRecorder::ended(uint32_t seq, bool ok, uint8_t code) {
  if (!enabled()) return;
  std::lock_guard lock(mu_);
  RecorderEntry* e = entry(seq);
  if (e->seq != seq) return;
  Record r = copy_entry(e);
  r.state = ok ? RecordState::kDone : RecordState::kFailed;
  r.code = code;
  r.ended_ns = wall_clock_ns();
  write(e, r);
  if (!(r.flags & kRecordInternal)) count(r);
}

void FlightRecorder::set_path(RecordPath path) {
  if (enabled()) stats_->path.store(uint32_t(path), std::memory_order_relaxed);
}

void FlightRecorder::count(const Record& r) {
  // One writer at a time (mu_): plain increments the daemon reads with relaxed loads.
  auto bump = [](std::atomic<uint64_t>& c, uint64_t by) { c.store(c.load(std::memory_order_relaxed) + by, std::memory_order_relaxed); };
  if (r.state == RecordState::kFailed) {
    bump(stats_->failures[r.code < kStatCodes ? r.code : kStatCodes - 1], 1);
    return;
  }
  if (r.kind < 1 || r.kind > kStatKinds) return;
  const int k = r.kind - 1;
  const uint64_t bytes = r.count * element_size(DataType(r.type));
  const int z = stat_size_bucket(bytes);
  const int64_t ns = std::max<int64_t>(0, r.ended_ns - r.started_ns);
  bump(stats_->calls[k][z], 1);
  bump(stats_->bytes[k][z], bytes);
  bump(stats_->latency_ns[k][z], uint64_t(ns));
  bump(stats_->latency[k][z][stat_latency_bucket(ns)], 1);
}

std::atomic<int32_t>* FlightRecorder::waiting_slot(uint32_t seq) {
  if (!enabled()) return nullptr;
  return &entry(seq)->waiting_for;
}

RecorderSnapshot read_recorder(const void* at, uint32_t capacity, uint32_t rank, uint32_t world_size) {
  RecorderSnapshot out;
  const auto* h = static_cast<const RecorderHeader*>(at);
  // The daemon wrote magic, capacity and rank; a trainer that changed them is broken or hostile.
  if (h->magic != kRecorderMagic || h->capacity != capacity || h->rank != rank) {
    out.problem = "the recorder's header was overwritten (magic/capacity/rank differ from what gradsyncd wrote)";
    return out;
  }
  out.pid = h->pid.load(std::memory_order_relaxed);
  out.written = h->written.load(std::memory_order_acquire);
  const RecorderEntry* entries = recorder_entries(const_cast<void*>(at));
  for (uint32_t i = 0; i < capacity; ++i) {
    const RecorderEntry* e = &entries[i];
    bool got = false;
    Record r;
    uint32_t v1 = 0;
    for (int t = 0; t < kReadTries && !got; ++t) {
      v1 = e->version.load(std::memory_order_acquire);
      if (v1 & 1) continue;
      r = copy_entry(e);
      std::atomic_thread_fence(std::memory_order_acquire);
      got = e->version.load(std::memory_order_relaxed) == v1;
    }
    if (v1 == 0 && got) continue;  // never written
    const uint8_t st = uint8_t(r.state), pa = uint8_t(r.path);
    const bool valid = got && r.seq % capacity == i && r.kind >= 1 && r.kind <= kMaxKind && r.type <= kMaxType &&
                       r.op <= kMaxOp && r.algorithm <= kMaxAlgorithm && st >= 1 && st <= 4 && pa >= 1 &&
                       pa <= 4 && r.code <= kMaxCode && r.waiting_for >= -1 &&
                       (r.waiting_for < 0 || uint32_t(r.waiting_for) < world_size) &&
                       (r.root >= 0 && uint32_t(r.root) < std::max(world_size, 1u)) && r.queued_ns >= 0 &&
                       r.started_ns >= 0 && r.ended_ns >= 0;
    if (!valid) {
      ++out.skipped;
      continue;
    }
    out.records.push_back(r);
  }
  std::sort(out.records.begin(), out.records.end(), [](const Record& a, const Record& b) { return a.seq < b.seq; });
  return out;
}

}  // namespace gradsync
