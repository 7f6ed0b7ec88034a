// Collective agreements of the GradientReducer (reducer_agreement.h).
#include "client/reducer_agreement.h"

#include <algorithm>

#include "client/bucket_plan.h"

namespace gradsync {
namespace {

std::string who(Communicator& comm) {
  return "job=" + comm.job() + " rank " + std::to_string(comm.rank());
}

// One rank's registration summary: what must be equal on every rank.
enum Summary : int { kGradients, kCap, kFirstCap, kOp, kCompression, kRebuild, kObjection, kSummaryLen };

// A gradient as the ranks compare it: its count, and type, host/GPU, maybe_unused packed in
// one word (the GPU ordinal may differ between ranks).
int64_t describe_kind(const GradientSpec& g) {
  return int64_t(g.type) | (int64_t(g.device != kHostDevice) << 8) | (int64_t(g.maybe_unused) << 9);
}

std::string kind_text(int64_t count, int64_t kind) {
  std::string s = std::to_string(count) + " x " + to_string(DataType(kind & 0xff));
  s += (kind >> 8) & 1 ? " on a GPU" : " on the host";
  if ((kind >> 9) & 1) s += ", maybe unused";
  return s;
}

const char* const kSummaryName[] = {"gradients",   "bucket_cap_bytes",         "first_bucket_bytes", "op",
                                    "compression", "rebuild_after_first_step", "objection"};

}  // namespace

Status agree_on_registrations(Communicator& comm, const std::vector<GradientSpec>& gradients,
                              const ReducerOptions& options, const Status& local_problem) {
  const int n = comm.world_size();
  std::vector<int64_t> mine = {int64_t(gradients.size()),
                               int64_t(options.bucket_cap_bytes),
                               int64_t(options.first_bucket_bytes),
                               int64_t(options.op),
                               int64_t(options.compression),
                               int64_t(options.rebuild_after_first_step),
                               int64_t(!local_problem.ok())};
  std::vector<int64_t> all(size_t(n) * kSummaryLen);
  GS_RETURN_IF_ERROR(comm.all_gather(mine.data(), all.data(), kSummaryLen, DataType::kInt64));
  const std::string head = who(comm) + ": gradient reducer: ";
  auto at = [&](int r, int f) { return all[size_t(r) * kSummaryLen + size_t(f)]; };
  for (int r = 0; r < n; ++r) {
    if (at(r, kObjection) != 0) {
      return r == comm.rank() ? local_problem
                              : Status(Code::kInvalidArgument,
                                       head + "rank " + std::to_string(r) +
                                           " refused its own registration (its log says why)");
    }
  }
  for (int r = 1; r < n; ++r) {
    for (int f = 0; f < kSummaryLen; ++f) {
      if (at(r, f) == at(0, f)) continue;
      return {Code::kMismatch, head + "registrations differ across ranks: " + kSummaryName[f] + " is " +
                                   std::to_string(at(0, f)) + " on rank 0 but " + std::to_string(at(r, f)) +
                                   " on rank " + std::to_string(r) +
                                   " (every rank must register the same gradients, in the same order, "
                                   "with the same options)"};
    }
  }
  // Same number of gradients everywhere: compare them one by one.
  const size_t len = 2 * gradients.size();
  if (len == 0) return Status::Ok();
  std::vector<int64_t> desc(len), every(size_t(n) * len);
  for (size_t i = 0; i < gradients.size(); ++i) {
    desc[2 * i] = int64_t(gradients[i].count);
    desc[2 * i + 1] = describe_kind(gradients[i]);
  }
  GS_RETURN_IF_ERROR(comm.all_gather(desc.data(), every.data(), len, DataType::kInt64));
  for (int r = 1; r < n; ++r) {
    for (size_t i = 0; i < gradients.size(); ++i) {
      const int64_t* a = &every[2 * i];
      const int64_t* b = &every[size_t(r) * len + 2 * i];
      if (a[0] == b[0] && a[1] == b[1]) continue;
      return {Code::kMismatch, head + "registrations differ across ranks: gradient " + std::to_string(i) +
                                   " is " + kind_text(a[0], a[1]) + " on rank 0 but " + kind_text(b[0], b[1]) +
                                   " on rank " + std::to_string(r) +
                                   " (every rank must register the same gradients, in the same order)"};
    }
  }
  return Status::Ok();
}

Status agree_on_step(Communicator& comm, const StepReport& report, int64_t step) {
  const int n = comm.world_size();
  constexpr size_t kLen = 3;
  const int64_t mine[kLen] = {int64_t(!report.error.ok()), report.unmarked, report.first_unmarked};
  std::vector<int64_t> all(size_t(n) * kLen);
  GS_RETURN_IF_ERROR(comm.all_gather(mine, all.data(), kLen, DataType::kInt64));
  std::string failed;
  for (int r = 0; r < n; ++r) {
    const int64_t* row = &all[size_t(r) * kLen];
    if (row[0] == 0 && row[1] == 0) continue;
    failed += failed.empty() ? "" : "; ";
    failed += "rank " + std::to_string(r) + ": ";
    if (row[1] > 0) {
      failed += "gradient " + std::to_string(row[2]) + " never became ready (" + std::to_string(row[1]) +
                " unmarked gradient(s) not declared maybe_unused: a parameter outside the loss, or a hook "
                "that did not fire)";
    }
    if (row[0] != 0) {
      failed += row[1] > 0 ? ", and " : "";
      failed += r == comm.rank() ? report.error.message() : std::string("an error (that rank's log says which)");
    }
  }
  if (failed.empty()) return Status::Ok();
  const Code code = report.error.ok() ? Code::kFailedPrecondition : report.error.code();
  return {code, who(comm) + ": gradient reducer: step " + std::to_string(step) + " failed: " + failed};
}

Status agree_on_order(Communicator& comm, std::vector<int>& order) {
  const int count = int(order.size());
  std::vector<int32_t> wire(order.begin(), order.end());
  GS_RETURN_IF_ERROR(comm.broadcast(wire.data(), wire.size(), DataType::kInt32, 0));
  std::vector<int> got(wire.begin(), wire.end());
  if (!is_permutation_of(got, count)) {
    return {Code::kInternal, who(comm) + ": gradient reducer: rank 0's gradient order for the rebuild is not "
                                         "a permutation of the " + std::to_string(count) + " gradients"};
  }
  order = std::move(got);
  return Status::Ok();
}

}  // namespace gradsync
