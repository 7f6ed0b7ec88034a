// The flight recorder: each rank's last N collectives, in the job's shared memory with its
// daemon, so that gradsyncd can read them while the trainer is stuck or after it died.
//
// Region (one per local rank, after the channels' slot data; ShmLayout::trace_offset):
//
//     [RecorderHeader: magic, capacity, rank, pid, entries written]   64 bytes
//     [RankStats: counters and latency histograms for gradsyncd's /metrics]
//     [RecorderEntry x capacity]                                        64 bytes each
//
// Collective `seq` lives in entry seq % capacity. The trainer is the only writer; each entry
// is a seqlock (odd `version` while written), and the daemon copies an entry and keeps it only
// when the version was even and unchanged. The memory is trainer-writable: the reader trusts
// nothing in it (capacity and rank come from the daemon's own layout, every field is checked)
// and reports what it had to skip instead of failing.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "gradsync/status.h"

namespace gradsync {

constexpr uint32_t kRecorderMagic = 0x47534652;  // "GSFR"
constexpr uint32_t kDefaultRecorderEntries = 2000;
constexpr uint32_t kMaxRecorderEntries = 1u << 20;

enum class RecordState : uint8_t { kQueued = 1, kStarted = 2, kDone = 3, kFailed = 4 };
const char* to_string(RecordState state);

// The data path of a host collective: where its slots go.
enum class RecordPath : uint8_t {
  kLocal = 1,        // every peer on this node: shared-memory channels only
  kRankSockets = 2,  // cross-node slots on TCP sockets the rank moves itself
  kDaemon = 3,       // cross-node slots pumped by gradsyncd (verbs, or TCP with --proxy-tcp)
  kMixed = 4,        // some of each
};
const char* to_string(RecordPath path);

// Entry flags.
constexpr uint8_t kRecordInternal = 1;   // the communicator's own (start-up tuning, agreement)
constexpr uint8_t kRecordGpuStaged = 2;  // the host half of a host-staged GPU collective

struct alignas(64) RecorderHeader {
  uint32_t magic;
  uint32_t capacity;
  uint32_t rank;
  std::atomic<uint32_t> pid;       // the trainer's, written at join
  std::atomic<uint64_t> written;   // highest seq recorded + 1
};
static_assert(sizeof(RecorderHeader) == 64);

struct alignas(64) RecorderEntry {
  std::atomic<uint32_t> version;   // odd while the trainer writes the entry
  uint32_t seq;
  uint8_t kind;                    // CollectiveKind
  uint8_t type;                    // DataType
  uint8_t op;                      // ReduceOp
  uint8_t algorithm;               // Algorithm (ring/tree once started)
  uint8_t state;                   // RecordState
  uint8_t path;                    // RecordPath
  uint8_t flags;
  uint8_t code;                    // gradsync::Code of a failed one
  int32_t root;
  std::atomic<int32_t> waiting_for;  // the peer rank of the channel last waited on, -1 none
  uint64_t count;
  int64_t queued_ns;               // CLOCK_REALTIME
  int64_t started_ns;
  int64_t ended_ns;
};
static_assert(sizeof(RecorderEntry) == 64);

// The rank's counters, which gradsyncd serves on /metrics (trainers open no port): the
// application's collectives (not the communicator's own) by kind and payload size bucket.
constexpr int kStatKinds = 5;                // CollectiveKind 1..5
constexpr int kStatSizes = 6;                // payload bytes up to 1 KiB, 64 KiB, 1 MiB, 16 MiB, 256 MiB, more
constexpr int kStatLatencyBuckets = 10;      // seconds up to 1e-5 .. 1e3 (9 bounds), then more
constexpr int kStatCodes = 16;               // failures by gradsync::Code
extern const uint64_t kStatSizeBounds[kStatSizes - 1];
extern const double kStatLatencyBounds[kStatLatencyBuckets - 1];
struct alignas(64) RankStats {
  std::atomic<uint32_t> path;                // RecordPath of the rank's host collectives
  uint32_t reserved;
  std::atomic<uint64_t> calls[kStatKinds][kStatSizes];
  std::atomic<uint64_t> bytes[kStatKinds][kStatSizes];
  std::atomic<uint64_t> latency_ns[kStatKinds][kStatSizes];          // sum of start-to-end times
  std::atomic<uint64_t> latency[kStatKinds][kStatSizes][kStatLatencyBuckets];  // per bucket, not cumulative
  std::atomic<uint64_t> failures[kStatCodes];
};
int stat_size_bucket(uint64_t bytes);
int stat_latency_bucket(int64_t ns);

inline size_t recorder_bytes(uint32_t capacity) {
  return sizeof(RecorderHeader) + sizeof(RankStats) + size_t{capacity} * sizeof(RecorderEntry);
}

// The parts of a region at `at`.
inline RankStats* recorder_stats(void* at) {
  return reinterpret_cast<RankStats*>(static_cast<char*>(at) + sizeof(RecorderHeader));
}
inline RecorderEntry* recorder_entries(void* at) {
  return reinterpret_cast<RecorderEntry*>(static_cast<char*>(at) + sizeof(RecorderHeader) + sizeof(RankStats));
}

// Writes a fresh region's header (daemon, at job creation; the memory is zero).
void init_recorder(void* at, uint32_t capacity, uint32_t rank);

// One collective as the recorder keeps it (a validated copy).
struct Record {
  uint32_t seq = 0;
  uint8_t kind = 0, type = 0, op = 0, algorithm = 0;
  RecordState state = RecordState::kQueued;
  RecordPath path = RecordPath::kLocal;
  uint8_t flags = 0;
  uint8_t code = 0;
  int32_t root = 0;
  int32_t waiting_for = -1;
  uint64_t count = 0;
  int64_t queued_ns = 0, started_ns = 0, ended_ns = 0;
};

// The trainer's side. Cheap: an entry write is a few stores under a mutex nobody else holds
// in the common case (the caller's thread and the communicator's worker may both record).
class FlightRecorder {
 public:
  FlightRecorder() = default;
  // `at`: this rank's region in the job's memory, laid out by the daemon with `capacity`.
  FlightRecorder(void* at, uint32_t capacity);
  bool enabled() const { return header_ != nullptr; }

  // The collective was queued (or, for a blocking call, is about to start).
  void queued(const Record& r);
  // It started / ended: rewrites entry `seq` with the new state (and the resolved algorithm).
  void started(uint32_t seq, uint8_t algorithm);
  void ended(uint32_t seq, bool ok, uint8_t code);
  // Where a channel wait stores the peer it waits for (WaitContext::waiting_for); null when off.
  std::atomic<int32_t>* waiting_slot(uint32_t seq);
  // The path of this rank's host collectives, for the counters.
  void set_path(RecordPath path);

 private:
  RecorderEntry* entry(uint32_t seq) const { return &entries_[seq % capacity_]; }
  void write(RecorderEntry* e, const Record& r);

  void count(const Record& r);  // adds an ended application collective to the counters

  RecorderHeader* header_ = nullptr;
  RankStats* stats_ = nullptr;
  RecorderEntry* entries_ = nullptr;
  uint32_t capacity_ = 0;
  std::mutex mu_;
};

// What the daemon could read of one rank's recorder.
struct RecorderSnapshot {
  uint32_t pid = 0;
  uint64_t written = 0;             // collectives recorded over the job (as the trainer says)
  std::vector<Record> records;      // valid entries, by seq
  uint32_t skipped = 0;             // entries torn or invalid
  std::string problem;              // non-empty when the header itself was not trustworthy
};

// Reads a region of `capacity` entries that the daemon laid out for `rank` of a world of
// `world_size`. Never reads outside recorder_bytes(capacity) from `at`.
RecorderSnapshot read_recorder(const void* at, uint32_t capacity, uint32_t rank, uint32_t world_size);

// A plain copy of a rank's counters (the daemon's, for /metrics), kept after the job is gone.
struct StatsCopy {
  RecordPath path = RecordPath::kLocal;
  bool path_known = false;
  uint64_t calls[kStatKinds][kStatSizes] = {};
  uint64_t bytes[kStatKinds][kStatSizes] = {};
  uint64_t latency_ns[kStatKinds][kStatSizes] = {};
  uint64_t latency[kStatKinds][kStatSizes][kStatLatencyBuckets] = {};
  uint64_t failures[kStatCodes] = {};
};
// Copies the counters of the region at `at` (the recorder's header must be the daemon's,
// else false). Values are whatever the trainer wrote: counters, not proofs.
bool read_stats(const void* at, uint32_t capacity, uint32_t rank, StatsCopy* out);

// CLOCK_REALTIME in nanoseconds.
int64_t wall_clock_ns();

}  // namespace gradsync
