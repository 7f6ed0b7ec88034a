// Allreduce of (rank + 1) over every rank through the node's gradsyncd; checks the sum.
#include <cstdio>
#include <vector>

#include <gradsync/gradsync.h>

int main() {
  auto session = gradsync::Session::connect();
  if (!session.ok()) return std::fprintf(stderr, "%s\n", session.status().to_string().c_str()), 1;
  auto comm = session->join(gradsync::JoinOptions::from_env());
  if (!comm.ok()) return std::fprintf(stderr, "%s\n", comm.status().to_string().c_str()), 1;
  const int n = comm->world_size();
  std::vector<float> v(1 << 16, float(comm->rank() + 1));
  gradsync::Status s = comm->allreduce(v.data(), v.size(), gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum);
  if (!s.ok()) return std::fprintf(stderr, "%s\n", s.to_string().c_str()), 1;
  const float want = n * (n + 1) / 2.0f;
  for (float x : v) {
    if (x != want) return std::fprintf(stderr, "rank %d: got %g, want %g\n", comm->rank(), x, want), 1;
  }
  std::printf("consumer rank %d of %d: allreduce ok (%g)\n", comm->rank(), n, want);
  return comm->leave().ok() ? 0 : 1;
}
