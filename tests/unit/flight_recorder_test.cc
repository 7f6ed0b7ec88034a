// The flight recorder's shared-memory format (channel/flight_recorder.h): what the trainer
// writes the daemon reads back; memory a hostile or broken trainer scribbled on is skipped,
// never trusted; and the diagnosis gradsyncctl trace prints (trace/trace_report.h).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "channel/flight_recorder.h"
#include "trace/trace_report.h"

namespace gradsync {
namespace {

struct Region {
  explicit Region(uint32_t capacity, uint32_t rank = 1) : capacity(capacity), bytes(recorder_bytes(capacity) / 8 + 1) {
    init_recorder(bytes.data(), capacity, rank);
  }
  void* data() { return bytes.data(); }
  RecorderEntry* entries() { return recorder_entries(data()); }
  uint32_t capacity;
  std::vector<uint64_t> bytes;  // 8-byte aligned, zeroed
};

Record call(uint32_t seq) {
  Record r;
  r.seq = seq;
  r.kind = 1;  // allreduce
  r.type = 0;  // float32
  r.op = 0;
  r.count = 1000 + seq;
  r.path = RecordPath::kRankSockets;
  return r;
}

TEST(FlightRecorder, KeepsTheLastNWithTheirStates) {
  Region region(4);
  FlightRecorder rec(region.data(), 4);
  for (uint32_t s = 0; s < 6; ++s) {
    rec.queued(call(s));
    rec.started(s, 1);
    if (s < 5) rec.ended(s, s != 3, s == 3 ? uint8_t(Code::kDeadlineExceeded) : 0);
  }
  rec.waiting_slot(5)->store(2);
  RecorderSnapshot snap = read_recorder(region.data(), 4, 1, 4);
  EXPECT_TRUE(snap.problem.empty()) << snap.problem;
  EXPECT_EQ(snap.written, 6u);
  EXPECT_EQ(snap.skipped, 0u);
  ASSERT_EQ(snap.records.size(), 4u);
  EXPECT_EQ(snap.records[0].seq, 2u);
  EXPECT_EQ(snap.records[1].state, RecordState::kFailed);
  EXPECT_EQ(snap.records[1].code, uint8_t(Code::kDeadlineExceeded));
  EXPECT_EQ(snap.records[2].state, RecordState::kDone);
  EXPECT_EQ(snap.records[3].state, RecordState::kStarted);
  EXPECT_EQ(snap.records[3].waiting_for, 2);
  EXPECT_EQ(snap.records[3].count, 1005u);
  EXPECT_EQ(snap.records[3].path, RecordPath::kRankSockets);
  EXPECT_GT(snap.records[2].ended_ns, 0);
}

TEST(FlightRecorder, HeaderTheTrainerChangedIsNotTrusted) {
  Region region(4, 3);
  auto* h = static_cast<RecorderHeader*>(region.data());
  h->capacity = 1u << 30;  // would make the reader walk far past the region
  RecorderSnapshot snap = read_recorder(region.data(), 4, 3, 8);
  EXPECT_TRUE(snap.records.empty());
  EXPECT_NE(snap.problem.find("overwritten"), std::string::npos);
  h->capacity = 4;
  h->rank = 5;  // another rank's recorder
  EXPECT_FALSE(read_recorder(region.data(), 4, 3, 8).problem.empty());
}

TEST(FlightRecorder, BadEntriesAreSkippedAndCounted) {
  Region region(8);
  FlightRecorder rec(region.data(), 8);
  for (uint32_t s = 0; s < 8; ++s) rec.queued(call(s));
  RecorderEntry* e = region.entries();
  e[1].kind = 99;                 // no such collective
  e[2].waiting_for.store(1000);   // a rank outside the world
  e[3].seq = 12;                  // in the slot of 4
  e[4].version.store(7);          // a write that never finished
  e[5].state = 0;
  e[6].root = -4;
  RecorderSnapshot snap = read_recorder(region.data(), 8, 1, 4);
  EXPECT_EQ(snap.skipped, 6u);
  ASSERT_EQ(snap.records.size(), 2u);
  EXPECT_EQ(snap.records[0].seq, 0u);
  EXPECT_EQ(snap.records[1].seq, 7u);
}

TEST(FlightRecorder, RandomBytesNeverYieldAnInvalidRecord) {
  std::mt19937_64 rng(19);
  for (int round = 0; round < 200; ++round) {
    Region region(16, 0);
    auto* raw = reinterpret_cast<uint8_t*>(region.entries());
    for (size_t i = 0; i < 16 * sizeof(RecorderEntry); ++i) raw[i] = uint8_t(rng());
    if (round % 2) {  // even versions, so that some entries get as far as the checks
      for (uint32_t i = 0; i < 16; ++i) region.entries()[i].version.store(uint32_t(rng()) & ~1u);
    }
    RecorderSnapshot snap = read_recorder(region.data(), 16, 0, 4);
    EXPECT_LE(snap.records.size() + snap.skipped, 16u);
    uint32_t last_slot = 0;
    for (const Record& r : snap.records) {
      // Sorted by seq, each from its own slot: no slot twice.
      EXPECT_TRUE(&r == &snap.records.front() || r.seq % 16 != last_slot);
      last_slot = r.seq % 16;
      EXPECT_GE(r.kind, 1);
      EXPECT_LE(r.kind, 5);
      EXPECT_LT(r.waiting_for, 4);
      EXPECT_GE(r.root, 0);
      EXPECT_LT(r.root, 4);
    }
  }
}

TEST(FlightRecorder, CountsTheApplicationsCollectivesForMetrics) {
  Region region(8, 0);
  FlightRecorder rec(region.data(), 8);
  rec.set_path(RecordPath::kDaemon);
  for (uint32_t s = 0; s < 5; ++s) {
    Record r = call(s);
    r.count = 262144;  // 1 MiB of float32
    if (s == 0) r.flags = kRecordInternal;  // the communicator's own: not counted
    rec.queued(r);
    rec.started(s, 1);
    rec.ended(s, s != 4, s == 4 ? uint8_t(Code::kAborted) : 0);
  }
  StatsCopy st;
  ASSERT_TRUE(read_stats(region.data(), 8, 0, &st));
  EXPECT_TRUE(st.path_known);
  EXPECT_EQ(st.path, RecordPath::kDaemon);
  const int z = stat_size_bucket(1 << 20);
  EXPECT_EQ(z, 2);  // up to 1 MiB
  EXPECT_EQ(st.calls[0][z], 3u);
  EXPECT_EQ(st.bytes[0][z], 3u << 20);
  uint64_t in_histogram = 0;
  for (int b = 0; b < kStatLatencyBuckets; ++b) in_histogram += st.latency[0][z][b];
  EXPECT_EQ(in_histogram, 3u);
  EXPECT_EQ(st.failures[int(Code::kAborted)], 1u);
  EXPECT_FALSE(read_stats(region.data(), 8, 1, &st)) << "another rank's region";
  EXPECT_EQ(stat_latency_bucket(5'000), 0);        // 5 us <= 10 us
  EXPECT_EQ(stat_latency_bucket(2'000'000), 3);    // 2 ms <= 10 ms
  EXPECT_EQ(stat_latency_bucket(int64_t(5e12)), kStatLatencyBuckets - 1);
}

v1::RankTrace rank_trace(uint32_t rank, uint32_t last, bool inside_next, int waiting_for) {
  v1::RankTrace t;
  t.set_rank(rank);
  t.set_host("h" + std::to_string(rank / 2));
  t.set_node_id("n" + std::to_string(rank / 2));
  t.set_connected(true);
  t.set_read_ns(10'000'000'000);
  const uint32_t end = inside_next ? last + 1 : last;
  t.set_recorded(end + 1);
  for (uint32_t s = 0; s <= end; ++s) {
    v1::TraceRecord* r = t.add_records();
    r->set_seq(s);
    r->set_kind("allreduce");
    r->set_count(1024);
    r->set_type("float32");
    r->set_op("sum");
    r->set_algorithm("ring");
    r->set_path("shm");
    r->set_queued_ns(1'000'000'000 + s * 1000);
    r->set_started_ns(1'000'000'000 + s * 1000);
    const bool open = inside_next && s == end;
    r->set_state(open ? "started" : "done");
    r->set_ended_ns(open ? 0 : 1'000'000'000 + s * 1000 + 500);
    r->set_waiting_for(open ? waiting_for : -1);
  }
  return t;
}

TEST(TraceReport, NamesTheRankBehindAndWhoWaitsForIt) {
  std::vector<v1::RankTrace> ranks = {rank_trace(3, 57, true, 2), rank_trace(0, 57, true, 3),
                                      rank_trace(2, 57, false, -1), rank_trace(1, 57, true, 0)};
  trace::Diagnosis d = trace::diagnose(ranks, 4);
  EXPECT_EQ(d.behind, std::vector<uint32_t>({2}));
  EXPECT_EQ(d.never_entered, 58);
  EXPECT_EQ(d.waiting, std::vector<uint32_t>({0, 1, 3}));
  std::string text = trace::render(ranks, 4, 2);
  EXPECT_NE(text.find("rank 2 is behind: last entered #57 allreduce count=1024 float32 sum ring shm: done"),
            std::string::npos) << text;
  EXPECT_NE(text.find("never entered collective #58"), std::string::npos) << text;
  EXPECT_NE(text.find("ranks 0, 1, 3 wait in collective #58 for rank 2"), std::string::npos) << text;
  EXPECT_NE(text.find("0 -> 3, 1 -> 0, 3 -> 2"), std::string::npos) << text;
  EXPECT_NE(text.find("#58 allreduce count=1024 float32 sum ring shm: started 9.0 s ago, waiting for rank 2"),
            std::string::npos) << text;
}

TEST(TraceReport, MissingRanksAndAQuietJob) {
  std::vector<v1::RankTrace> ranks = {rank_trace(0, 9, false, -1), rank_trace(1, 9, false, -1)};
  trace::Diagnosis d = trace::diagnose(ranks, 3);
  EXPECT_TRUE(d.behind.empty());
  EXPECT_EQ(d.unknown, std::vector<uint32_t>({2}));
  std::string text = trace::render(ranks, 3, 1);
  EXPECT_NE(text.find("no flight recorder from rank(s) 2"), std::string::npos) << text;
  EXPECT_NE(text.find("no rank is behind: every rank finished collective #9"), std::string::npos) << text;
}

}  // namespace
}  // namespace gradsync
