// A trainer process for the integration tests: joins with the launcher's environment
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GRADSYNC_*), then
//   check COUNTS   allreduce every count (comma list), in-place and out-of-place, checking
//                  exact results (integer-valued floats); prints "PASS" at the end
//   loop COUNT N   N allreduces of COUNT elements (for kill tests), each result checked (a
//                  wrong one prints "WRONG ..."); "ITER n" about every 500 ms; prints a failure
//                  as "FAILED after MS ms (at EPOCH_MS): STATUS"
//   paced COUNT    allreduces of COUNT elements every 10 ms, each checked, "ITER n" every 50,
//                  until aborted (exit 1, the error on stderr) or 120 s (rank 0 decides when,
//                  so every rank makes the same calls; "PASS")
//   idle           rank 0 enters a 1-element allreduce at once; the other ranks first read
//                  stdin to EOF, then enter it too (so the test decides how long rank 0 idles)
//   hold PATH      every rank waits (at most 60 s) until the file PATH exists, then makes a
//                  1-element allreduce: the test decides how long the ranks live (a rank
//                  started by gradsyncrun has /dev/null as stdin, so `idle` cannot hold it)
//   badinput       allreduce calls the library must refuse with INVALID_ARGUMENT before
//                  sending anything (null pointers, overflowing count, misaligned buffer,
//                  unknown type/op), each printed as "refused WHAT: STATUS"; then `check 1000`
//   stall COUNT CALLS RANK
//                  allreduces of COUNT elements; rank RANK makes CALLS of them (collectives
//                  0..CALLS-1 with GRADSYNC_TUNE=0), prints "STALLED" and reads stdin to EOF;
//                  the others print "ENTERING n" before call n and go on until one fails
//                  (flight recorder tests)
//   rawjoin        joins by talking the daemon protocol directly, skipping the library's own
//                  argument checks, to test the daemon's; prints "join: STATUS" on failure
//   calls N R      N allreduces of 1000 elements, checked; rank R makes one call more (the
//                  others leave meanwhile); a failure is printed as "FAILED after MS ms: STATUS"
//   odd N R        allreduces of 4096 elements until one fails; rank R's call number N has 4095
//                  (a different call): every rank prints its "FAILED after MS ms: STATUS"
// Exit code 0 on success, 1 on any failure; errors go to stderr with the Status text
// (e.g. "join: INVALID_ARGUMENT: ...").
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "raw_join.h"  // rawjoin only: the daemon protocol without the library's checks
#include "gradsync/gradsync.h"

namespace {

std::vector<size_t> parse_counts(const std::string& s) {
  std::vector<size_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoull(item));
  return out;
}

float input_value(int rank, size_t i) { return static_cast<float>((rank + 1) * static_cast<int>(i % 7 + 1)); }

float expected_value(int world, size_t i) {
  return static_cast<float>(static_cast<int>(i % 7 + 1) * world * (world + 1) / 2);
}

int check(gradsync::Communicator& comm, const std::vector<size_t>& counts) {
  const int r = comm.rank();
  const int n = comm.world_size();
  for (size_t count : counts) {
    for (bool inplace : {true, false}) {
      std::vector<float> in(count), out(count, -1.0f);
      for (size_t i = 0; i < count; ++i) in[i] = input_value(r, i);
      gradsync::Status s = inplace
          ? comm.allreduce(in.data(), count, gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum)
          : comm.allreduce(in.data(), out.data(), count, gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum);
      if (!s.ok()) {
        std::fprintf(stderr, "allreduce count=%zu inplace=%d failed: %s\n", count, inplace, s.to_string().c_str());
        return 1;
      }
      const std::vector<float>& res = inplace ? in : out;
      for (size_t i = 0; i < count; ++i) {
        if (res[i] != expected_value(n, i)) {
          std::fprintf(stderr, "count=%zu inplace=%d: element %zu is %g, expected %g\n", count, inplace, i,
                       res[i], expected_value(n, i));
          return 1;
        }
      }
      std::printf("count=%zu inplace=%d ok\n", count, inplace);
    }
  }
  std::printf("PASS\n");
  return 0;
}

// "FAILED after MS ms (at EPOCH_MS): STATUS": how long the call took, and when it returned
// (wall clock, for scripts that compare it with what they did when: scripts/chaos.sh).
void report_failure(double ms, const gradsync::Status& s) {
  const long long at = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count();
  std::fprintf(stderr, "FAILED after %.0f ms (at %lld): %s\n", ms, at, s.to_string().c_str());
}

int loop(gradsync::Communicator& comm, size_t count, int iters) {
  using Clock = std::chrono::steady_clock;
  std::vector<float> buf(count, 1.0f);
  const float want = static_cast<float>(comm.world_size());
  auto printed = Clock::now();
  for (int it = 0; it < iters; ++it) {
    auto t0 = Clock::now();
    gradsync::Status s = comm.allreduce(buf.data(), count, gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum);
    if (!s.ok()) {
      report_failure(std::chrono::duration<double, std::milli>(Clock::now() - t0).count(), s);
      return 1;
    }
    // Chaos trials count silent corruptions: every element of every result is checked.
    auto bad = std::find_if(buf.begin(), buf.end(), [want](float v) { return v != want; });
    if (bad != buf.end()) {
      std::fprintf(stderr, "WRONG at iteration %d: element %zu is %g, expected %g\n", it,
                   static_cast<size_t>(bad - buf.begin()), *bad, want);
      return 1;
    }
    std::fill(buf.begin(), buf.end(), 1.0f);
    if (it == 0) std::printf("LOOPING\n");
    if (Clock::now() - printed > std::chrono::milliseconds(500)) {
      std::printf("ITER %d\n", it);
      printed = Clock::now();
    }
  }
  std::printf("PASS\n");
  return 0;
}

int paced(gradsync::Communicator& comm, size_t count) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<float> buf(count + 1);
  for (int it = 0;; ++it) {
    std::fill(buf.begin(), buf.end(), 1.0f);
    // The last element carries rank 0's decision to stop: the same iteration for every rank.
    buf.back() = comm.rank() == 0 && std::chrono::steady_clock::now() - start > std::chrono::seconds(120) ? 1.0f : 0.0f;
    gradsync::Status s = comm.allreduce(buf.data(), buf.size(), gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum);
    if (!s.ok()) {
      std::fprintf(stderr, "FAILED at iteration %d: %s\n", it, s.to_string().c_str());
      return 1;
    }
    for (size_t i = 0; i < count; ++i) {
      if (buf[i] != static_cast<float>(comm.world_size())) {
        std::fprintf(stderr, "WRONG at iteration %d: element %zu is %g, expected %d\n", it, i, buf[i], comm.world_size());
        return 1;
      }
    }
    if (it % 50 == 0) std::printf("ITER %d\n", it);
    if (buf.back() > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::printf("PASS\n");
  return 0;
}

// One allreduce, timed; a failure is printed the way `loop` prints it.
bool timed_allreduce(gradsync::Communicator& comm, float* buf, size_t count) {
  auto t0 = std::chrono::steady_clock::now();
  gradsync::Status s = comm.allreduce(buf, count, gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum);
  if (s.ok()) return true;
  report_failure(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(), s);
  return false;
}

int calls(gradsync::Communicator& comm, int n, int extra_rank) {
  const int total = n + (comm.rank() == extra_rank ? 1 : 0);
  std::vector<float> buf(1000);
  for (int i = 0; i < total; ++i) {
    std::fill(buf.begin(), buf.end(), 1.0f);
    if (!timed_allreduce(comm, buf.data(), buf.size())) return 1;
    if (buf[0] != static_cast<float>(comm.world_size())) {
      std::fprintf(stderr, "call %d: got %g, expected %d\n", i, buf[0], comm.world_size());
      return 1;
    }
  }
  std::printf("PASS\n");
  return 0;
}

int odd_call(gradsync::Communicator& comm, int at, int odd_rank) {
  std::vector<float> buf(4096, 1.0f);
  for (int i = 0; i < 100000; ++i) {
    const size_t count = (i == at && comm.rank() == odd_rank) ? buf.size() - 1 : buf.size();
    if (!timed_allreduce(comm, buf.data(), count)) return 1;
    if (i == 0) std::printf("LOOPING\n");
  }
  std::printf("never failed\n");
  return 1;
}

int bad_input(gradsync::Communicator& comm) {
  using gradsync::DataType;
  using gradsync::ReduceOp;
  bool ok = true;
  auto expect_invalid = [&](const char* what, const gradsync::Status& s) {
    std::printf("refused %s: %s\n", what, s.to_string().c_str());
    if (s.code() != gradsync::Code::kInvalidArgument) {
      std::fprintf(stderr, "UNEXPECTED: %s returned %s, expected INVALID_ARGUMENT\n", what,
                   s.to_string().c_str());
      ok = false;
    }
  };
  std::vector<float> buf(64, 5.0f);
  float* p = buf.data();
  expect_invalid("null buffer count=5", comm.allreduce(nullptr, 5, DataType::kFloat32, ReduceOp::kSum));
  expect_invalid("count=SIZE_MAX/2",
                 comm.allreduce(p, SIZE_MAX / 2, DataType::kFloat32, ReduceOp::kSum));
  expect_invalid("null send count=5", comm.allreduce(nullptr, p, 5, DataType::kFloat32, ReduceOp::kSum));
  expect_invalid("null recv count=5", comm.allreduce(p, nullptr, 5, DataType::kFloat32, ReduceOp::kSum));
  expect_invalid("misaligned buffer",
                 comm.allreduce(reinterpret_cast<char*>(p) + 1, 5, DataType::kFloat32, ReduceOp::kSum));
  expect_invalid("unknown data type", comm.allreduce(p, 5, static_cast<DataType>(200), ReduceOp::kSum));
  expect_invalid("unknown reduce op", comm.allreduce(p, 5, DataType::kFloat32, static_cast<ReduceOp>(200)));
  expect_invalid("async null buffer",
                 comm.allreduce_async(nullptr, nullptr, 5, DataType::kFloat32, ReduceOp::kSum)
                     .wait(std::chrono::seconds(10)));
  for (float v : buf) {
    if (v != 5.0f) {
      std::fprintf(stderr, "UNEXPECTED: a refused allreduce wrote into the buffer\n");
      return 1;
    }
  }
  if (!ok) return 1;
  // The refused calls sent nothing: the next collective lines up with the peers' exactly.
  return check(comm, {1000});
}

// One rank stops calling collectives; the others go on into the next one and wait there.
int stall(gradsync::Communicator& comm, size_t count, int calls, int stall_rank) {
  std::vector<float> buf(count, 1.0f);
  for (int n = 0;; ++n) {
    if (comm.rank() == stall_rank && n == calls) {
      std::printf("STALLED after %d calls\n", calls);
      char c;
      while (std::fread(&c, 1, 1, stdin) == 1) {}
      return 0;
    }
    if (n >= calls) std::printf("ENTERING %d\n", n);
    gradsync::Status s = comm.allreduce(buf.data(), count, gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum);
    if (!s.ok()) {
      std::printf("FAILED in call %d: %s\n", n, s.to_string().c_str());
      return 1;
    }
  }
}

// Joins without the library's checks (the daemon must refuse bad requests on its own).
int raw_join() { return gradsync::testing::raw_join() ? 0 : 1; }

}  // namespace

// Rank 0 aborts the job after a few allreduces; every rank (rank 0 included) must then see
// its allreduce fail with ABORTED naming rank 0 and the reason. Prints ABORT-SEEN and exits 0
// when it did.
int abort_job(gradsync::Communicator& comm) {
  std::vector<float> buf(1 << 20, 1.0f);
  for (int it = 0; it < 100000; ++it) {
    if (comm.rank() == 0 && it == 5) {
      gradsync::Status a = comm.abort("testing Communicator::abort");
      if (!a.ok()) {
        std::fprintf(stderr, "abort: %s\n", a.to_string().c_str());
        return 1;
      }
    }
    gradsync::Status s = comm.allreduce(buf.data(), buf.size(), gradsync::DataType::kFloat32,
                                        gradsync::ReduceOp::kSum);
    if (!s.ok()) {
      bool named = s.code() == gradsync::Code::kAborted &&
                   s.message().find("rank 0") != std::string::npos &&
                   s.message().find("aborted the job") != std::string::npos;
      std::printf("%s: %s\n", named ? "ABORT-SEEN" : "WRONG-ERROR", s.to_string().c_str());
      return named ? 0 : 1;
    }
  }
  std::printf("never aborted\n");
  return 1;
}

// `idle` and `hold` after their wait: a 1-element sum of 1 per rank, checked ("PASS").
int one_element_sum(gradsync::Communicator& comm, const char* mode) {
  float x = 1;
  gradsync::Status s = comm.allreduce(&x, 1, gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum);
  if (!s.ok()) {
    std::fprintf(stderr, "%s allreduce failed: %s\n", mode, s.to_string().c_str());
    return 1;
  }
  if (x != static_cast<float>(comm.world_size())) {
    std::fprintf(stderr, "%s allreduce: got %g, expected %d\n", mode, x, comm.world_size());
    return 1;
  }
  std::printf("PASS\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: allreduce_worker check COUNTS | loop COUNT ITERS | paced COUNT | idle | hold PATH | badinput | rawjoin\n");
    return 2;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string mode = argv[1];
  if (mode == "rawjoin") return raw_join();
  auto session = gradsync::Session::connect();
  if (!session.ok()) {
    std::fprintf(stderr, "connect: %s\n", session.status().to_string().c_str());
    return 1;
  }
  auto comm = session->join(gradsync::JoinOptions::from_env());
  if (!comm.ok()) {
    std::fprintf(stderr, "join: %s\n", comm.status().to_string().c_str());
    return 1;
  }
  std::printf("JOINED rank=%d world=%d gen=%llu\n", comm->rank(), comm->world_size(),
              static_cast<unsigned long long>(comm->generation()));
  int rc = 2;
  if (mode == "check" && argc >= 3) rc = check(*comm, parse_counts(argv[2]));
  else if (mode == "loop" && argc >= 4) rc = loop(*comm, std::stoull(argv[2]), std::atoi(argv[3]));
  else if (mode == "paced" && argc >= 3) rc = paced(*comm, std::stoull(argv[2]));
  else if (mode == "badinput") rc = bad_input(*comm);
  else if (mode == "calls" && argc >= 4) rc = calls(*comm, std::atoi(argv[2]), std::atoi(argv[3]));
  else if (mode == "odd" && argc >= 4) rc = odd_call(*comm, std::atoi(argv[2]), std::atoi(argv[3]));
  else if (mode == "stall" && argc >= 5) rc = stall(*comm, std::stoull(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]));
  else if (mode == "abort") rc = abort_job(*comm);
  else if (mode == "hold" && argc >= 3) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (;;) {
      if (std::FILE* f = std::fopen(argv[2], "r")) {
        std::fclose(f);
        break;
      }
      if (std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    rc = one_element_sum(*comm, "hold");
  }
  else if (mode == "idle") {
    // Rank 0 enters a 1-element allreduce that nobody else joins until stdin closes.
    if (comm->rank() != 0) {
      char c;
      while (std::fread(&c, 1, 1, stdin) == 1) {}
    }
    rc = one_element_sum(*comm, "idle");
  }
  gradsync::Status s = comm->leave();
  if (!s.ok() && rc == 0) {
    std::fprintf(stderr, "leave: %s\n", s.to_string().c_str());
    rc = 1;
  }
  return rc;
}
