// A trainer process for the integration tests: joins with the launcher's environment
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GRADSYNC_*), then
//   check COUNTS   allreduce every count (comma list), in-place and out-of-place, checking
//                  exact results (integer-valued floats); prints "PASS" at the end
//   loop COUNT N   N allreduces of COUNT elements (for kill tests); prints each failure
//   idle           allreduce of 1 element only on rank 0... every rank blocks in it
// Exit code 0 on success, 1 on any failure; errors go to stderr with the Status text.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

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

int loop(gradsync::Communicator& comm, size_t count, int iters) {
  std::vector<float> buf(count, 1.0f);
  for (int it = 0; it < iters; ++it) {
    auto t0 = std::chrono::steady_clock::now();
    gradsync::Status s = comm.allreduce(buf.data(), count, gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum);
    if (!s.ok()) {
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "FAILED after %.0f ms: %s\n", ms, s.to_string().c_str());
      return 1;
    }
    std::fill(buf.begin(), buf.end(), 1.0f);
    if (it == 0) std::printf("LOOPING\n");
    std::fflush(stdout);
  }
  std::printf("PASS\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: allreduce_worker check COUNTS | loop COUNT ITERS | idle\n");
    return 2;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string mode = argv[1];
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
  else if (mode == "idle") {
    // Rank 0 enters a 1-element allreduce that nobody else joins until stdin closes.
    float x = 1;
    if (comm->rank() == 0) {
      rc = comm->allreduce(&x, 1, gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum).ok() ? 0 : 1;
    } else {
      char c;
      while (std::fread(&c, 1, 1, stdin) == 1) {}
      rc = comm->allreduce(&x, 1, gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum).ok() ? 0 : 1;
    }
  }
  gradsync::Status s = comm->leave();
  if (!s.ok() && rc == 0) {
    std::fprintf(stderr, "leave: %s\n", s.to_string().c_str());
    rc = 1;
  }
  return rc;
}
