// GradientReducer (gradsync/gradient_reducer.h): the step's state machine. Buckets start
// strictly in plan order: bucket b starts when its pending count reaches zero and every
// bucket before it started, so every rank issues the same allreduces in the same order
// whatever order its hooks fire in. The plan (bucket_plan.h), the buffers (bucket_memory.h)
// and the collective agreements (reducer_agreement.h) live in their own files.
#include <algorithm>
#include <atomic>
#include <mutex>

#include "client/bucket_memory.h"
#include "client/bucket_plan.h"
#include "client/reducer_agreement.h"
#include "common/log.h"
#include "kernels/half.h"

namespace gradsync {

const char* to_string(Compression c) {
  switch (c) {
    case Compression::kNone: return "none";
    case Compression::kFloat16: return "float16";
    case Compression::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

namespace {

size_t bytes_of(const GradientSpec& g) { return g.count * element_size(g.type); }

// float32 -> 16 bits (scaled), and back, for the compression of float32 buckets.
void pack16(Compression c, const float* in, uint16_t* out, size_t n, float scale) {
  if (c == Compression::kFloat16) {
    for (size_t i = 0; i < n; ++i) out[i] = kernels::float_to_half_rne(in[i] * scale);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = kernels::float_to_bf16_rne(in[i] * scale);
  }
}
void unpack16(Compression c, const uint16_t* in, float* out, size_t n) {
  if (c == Compression::kFloat16) {
    for (size_t i = 0; i < n; ++i) out[i] = kernels::half_to_float(in[i]);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = kernels::bf16_to_float(in[i]);
  }
}

}  // namespace

class GradientReducer::Impl {
 public:
  Impl(Communicator& comm, std::vector<GradientSpec> gradients, ReducerOptions options)
      : comm_(comm),
        grads_(std::move(gradients)),
        opts_(std::move(options)),
        who_("job=" + comm.job() + " rank " + std::to_string(comm.rank())),
        log_(log::get("reducer")),
        ready_(grads_.size(), 0) {}

  // This rank's own objections to its registration (before the ranks compare them).
  Status validate() const {
    const std::string head = who_ + ": gradient reducer refused: ";
    auto bad = [&](const std::string& m) { return Status(Code::kInvalidArgument, head + m); };
    if (opts_.op != ReduceOp::kAvg && opts_.op != ReduceOp::kSum) {
      return bad(std::string("op ") + to_string(opts_.op) + " (avg or sum)");
    }
    if (opts_.bucket_cap_bytes == 0 || opts_.first_bucket_bytes == 0) return bad("a bucket cap of 0 bytes");
    for (size_t i = 0; i < grads_.size(); ++i) {
      const GradientSpec& g = grads_[i];
      const std::string name = "gradient " + std::to_string(i) + ": ";
      const size_t es = element_size(g.type);
      if (es == 0) return bad(name + "unknown type " + std::to_string(int(g.type)));
      if (g.count == 0) return bad(name + "0 elements");
      if (g.count > SIZE_MAX / es) return bad(name + "count overflows");
      if (g.data != nullptr && reinterpret_cast<uintptr_t>(g.data) % es != 0) {
        return bad(name + "buffer not aligned to its " + std::to_string(es) + "-byte elements");
      }
      if (g.device != kHostDevice && g.device != comm_.device()) {
        return bad(name + "on GPU " + std::to_string(g.device) + ", but the communicator's device is " +
                   (comm_.device() == JoinOptions::kNoDevice ? std::string("none (join with a device)")
                                                             : std::to_string(comm_.device())));
      }
      if (g.device != kHostDevice && opts_.compression != Compression::kNone && g.type == DataType::kFloat32) {
        return {Code::kUnimplemented, head + name + "compression of GPU buckets is not built (host buckets only)"};
      }
    }
    return Status::Ok();
  }

  // Allocates the buckets of `plan`; views of gradients without a buffer of their own move
  // into them with their current values (the rebuild after the first step).
  Status install(std::vector<BucketInfo> plan, bool keep_values) {
    std::vector<Bucket> fresh(plan.size());
    std::vector<int> bucket_of(grads_.size(), -1);
    std::vector<size_t> offset_of(grads_.size(), 0);
    for (size_t b = 0; b < plan.size(); ++b) {
      Bucket& k = fresh[b];
      k.info = std::move(plan[b]);
      auto mem = BucketMemory::allocate(k.info.count * element_size(k.info.type), k.info.device);
      if (!mem.ok()) return mem.status();
      k.memory = std::move(mem).value();
      if (compressed(k)) {
        auto packed = BucketMemory::allocate(k.info.count * sizeof(uint16_t), kHostDevice);
        if (!packed.ok()) return packed.status();
        k.packed = std::move(packed).value();
      }
      for (size_t j = 0; j < k.info.gradients.size(); ++j) {
        bucket_of[size_t(k.info.gradients[j])] = int(b);
        offset_of[size_t(k.info.gradients[j])] = k.info.offsets[j];
      }
    }
    std::vector<int> moved;
    if (keep_values) {
      for (size_t i = 0; i < grads_.size(); ++i) {
        if (grads_[i].data != nullptr) continue;
        void* to = static_cast<char*>(fresh[size_t(bucket_of[i])].memory.data()) +
                   offset_of[i] * element_size(grads_[i].type);
        void* from = view(int(i));
        if (to == from) continue;
        GS_RETURN_IF_ERROR(copy_bytes(to, from, bytes_of(grads_[i]), grads_[i].device, opts_.stream));
        moved.push_back(int(i));
      }
    }
    buckets_ = std::move(fresh);
    bucket_of_ = std::move(bucket_of);
    offset_of_ = std::move(offset_of);
    reset_step();
    if (opts_.on_view_moved) {
      for (int i : moved) opts_.on_view_moved(i, view(i));
    }
    return Status::Ok();
  }

  void* view(int i) const {
    if (i < 0 || size_t(i) >= grads_.size() || bucket_of_.empty()) return nullptr;
    const Bucket& k = buckets_[size_t(bucket_of_[size_t(i)])];
    return static_cast<char*>(k.memory.data()) + offset_of_[size_t(i)] * element_size(grads_[size_t(i)].type);
  }

  Status mark_ready(int i) {
    if (i < 0 || size_t(i) >= grads_.size()) {
      Status s(Code::kInvalidArgument, who_ + ": gradient reducer: mark_ready(" + std::to_string(i) +
                                           ") outside the " + std::to_string(grads_.size()) + " gradients");
      std::lock_guard lock(mu_);
      note(s);
      return s;
    }
    {
      std::lock_guard lock(mu_);
      if (ready_[size_t(i)]) {
        Status s(Code::kFailedPrecondition, who_ + ": gradient reducer: gradient " + std::to_string(i) +
                                                " marked ready twice in step " + std::to_string(steps_ + 1));
        note(s);
        return s;
      }
      ready_[size_t(i)] = 1;
      if (steps_ == 0) observed_.push_back(i);
    }
    // The copy into the bucket runs outside the lock: other hooks go on meanwhile.
    const GradientSpec& g = grads_[size_t(i)];
    Status copied = g.data ? copy_bytes(view(i), g.data, bytes_of(g), g.device, opts_.stream) : Status::Ok();
    std::lock_guard lock(mu_);
    if (!copied.ok()) note(copied);
    --buckets_[size_t(bucket_of_[size_t(i)])].pending;
    start_ready_buckets();
    return copied;
  }

  Status finish() {
    StepReport report;
    {
      std::lock_guard lock(mu_);
      // Unmarked gradients go in as zeros, so that every bucket starts on every rank.
      for (size_t i = 0; i < grads_.size(); ++i) {
        if (ready_[i]) continue;
        if (!grads_[i].maybe_unused && report.unmarked++ == 0) report.first_unmarked = int64_t(i);
        ready_[i] = 1;
        if (Status z = zero_bytes(view(int(i)), bytes_of(grads_[i]), grads_[i].device, opts_.stream); !z.ok()) note(z);
        --buckets_[size_t(bucket_of_[i])].pending;
      }
      start_ready_buckets();
    }
    // Every bucket started; mark_ready does not touch them until reset_step().
    Status comm_failure;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& k = buckets_[b];
      Status s = k.launch;
      if (s.ok() && k.info.device == kHostDevice) s = k.work.wait();
      if (!s.ok()) {
        if (comm_failure.ok()) comm_failure = s;
        continue;
      }
      if (compressed(k)) {
        unpack16(opts_.compression, static_cast<const uint16_t*>(k.packed.data()), static_cast<float*>(k.memory.data()),
                 k.info.count);
      }
      if (opts_.post_hook) {
        if (Status h = opts_.post_hook(bucket_view(b)); !h.ok()) note(h);
      }
      for (size_t j = 0; j < k.info.gradients.size(); ++j) {
        const GradientSpec& g = grads_[size_t(k.info.gradients[j])];
        if (g.data == nullptr) continue;
        if (Status c = copy_bytes(g.data, view(k.info.gradients[j]), bytes_of(g), g.device, opts_.stream); !c.ok()) {
          note(c);
        }
      }
    }
    if (comm_failure.ok()) comm_failure = comm_.async_error();
    if (!comm_failure.ok()) {
      // The communicator failed and stays failed: no agreement is possible any more.
      reset_step();
      return comm_failure;
    }
    report.error = local_error_;
    Status agreed = agree_on_step(comm_, report, steps_ + 1);
    std::vector<int> order = observed_;
    reset_step();
    if (!agreed.ok()) {
      log_->error("{}", agreed.to_string());
      return agreed;
    }
    ++steps_;
    if (steps_ == 1 && opts_.rebuild_after_first_step) GS_RETURN_IF_ERROR(rebuild(std::move(order)));
    return Status::Ok();
  }

  std::vector<BucketInfo> buckets() const {
    std::vector<BucketInfo> out;
    for (const Bucket& k : buckets_) out.push_back(k.info);
    return out;
  }
  int started() const { return started_.load(); }
  const std::vector<GradientSpec>& grads() const { return grads_; }
  const ReducerOptions& options() const { return opts_; }
  int64_t steps() const { return steps_; }
  bool rebuilt() const { return rebuilt_; }

  Status plan_initial() {
    return install(plan_buckets(grads_, reverse_registration_order(int(grads_.size())), opts_.first_bucket_bytes,
                                opts_.bucket_cap_bytes),
                   /*keep_values=*/false);
  }

 private:
  struct Bucket {
    BucketInfo info;
    BucketMemory memory;
    BucketMemory packed;  // the 16-bit copy of a compressed float32 bucket
    int pending = 0;      // gradients of this step not marked ready yet
    Work work;            // host buckets
    Status launch;        // what starting it returned (GPU: the whole queued allreduce)
  };

  bool compressed(const Bucket& k) const {
    return opts_.compression != Compression::kNone && k.info.type == DataType::kFloat32 &&
           k.info.device == kHostDevice;
  }

  BucketView bucket_view(size_t b) const {
    const Bucket& k = buckets_[b];
    return {int(b), k.memory.data(), k.info.count, k.info.type, k.info.device, opts_.stream};
  }

  // The first error of this step on this rank (mu_ held).
  void note(const Status& s) {
    if (local_error_.ok()) local_error_ = s;
  }

  // Starts, in plan order, every bucket that can start (mu_ held). A bucket starts even when a
  // hook failed: its peers are waiting for it; finish() reports the failure on every rank.
  void start_ready_buckets() {
    while (next_start_ < buckets_.size() && buckets_[next_start_].pending == 0) {
      const size_t b = next_start_++;
      Bucket& k = buckets_[b];
      if (opts_.pre_hook) {
        if (Status h = opts_.pre_hook(bucket_view(b)); !h.ok()) note(h);
      }
      void* buf = k.memory.data();
      if (compressed(k)) {
        const float scale = opts_.op == ReduceOp::kAvg ? 1.0f / float(comm_.world_size()) : 1.0f;
        pack16(opts_.compression, static_cast<const float*>(buf), static_cast<uint16_t*>(k.packed.data()),
               k.info.count, scale);
        const DataType wire = opts_.compression == Compression::kFloat16 ? DataType::kFloat16 : DataType::kBFloat16;
        k.work = comm_.allreduce_async(k.packed.data(), k.packed.data(), k.info.count, wire, ReduceOp::kSum);
      } else if (k.info.device == kHostDevice) {
        k.work = comm_.allreduce_async(buf, buf, k.info.count, k.info.type, opts_.op);
      } else {
        k.launch = comm_.allreduce(buf, buf, k.info.count, k.info.type, opts_.op, opts_.stream);
      }
      started_.fetch_add(1);
    }
  }

  void reset_step() {
    std::fill(ready_.begin(), ready_.end(), 0);
    for (Bucket& k : buckets_) {
      k.pending = int(k.info.gradients.size());
      k.work = Work();
      k.launch = Status::Ok();
    }
    next_start_ = 0;
    started_ = 0;
    local_error_ = Status::Ok();
    observed_.clear();
  }

  // Plans again from rank 0's ready order of the first step (gradients it never marked go
  // last, in reverse registration order), agreed by a broadcast.
  Status rebuild(std::vector<int> order) {
    std::vector<bool> seen(grads_.size(), false);
    for (int i : order) seen[size_t(i)] = true;
    for (int i : reverse_registration_order(int(grads_.size()))) {
      if (!seen[size_t(i)]) order.push_back(i);
    }
    GS_RETURN_IF_ERROR(agree_on_order(comm_, order));
    rebuilt_ = true;
    auto plan = plan_buckets(grads_, order, opts_.first_bucket_bytes, opts_.bucket_cap_bytes);
    bool same = plan.size() == buckets_.size();
    for (size_t b = 0; same && b < plan.size(); ++b) same = plan[b].gradients == buckets_[b].info.gradients;
    if (same) return Status::Ok();
    log_->info("{}: gradient reducer: {} bucket(s) rebuilt from rank 0's ready order of step 1", who_, plan.size());
    return install(std::move(plan), /*keep_values=*/true);
  }

  Communicator& comm_;
  const std::vector<GradientSpec> grads_;
  const ReducerOptions opts_;
  const std::string who_;
  std::shared_ptr<spdlog::logger> log_;

  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;      // gradient -> bucket
  std::vector<size_t> offset_of_;   // gradient -> element offset in its bucket

  std::mutex mu_;  // the step's state below, and starting buckets
  std::vector<uint8_t> ready_;
  size_t next_start_ = 0;
  std::vector<int> observed_;  // ready order of the first step
  Status local_error_;
  std::atomic<int> started_{0};
  int64_t steps_ = 0;
  bool rebuilt_ = false;
};

Result<std::unique_ptr<GradientReducer>> GradientReducer::create(Communicator& comm,
                                                                 std::vector<GradientSpec> gradients,
                                                                 ReducerOptions options) {
  auto impl = std::make_unique<Impl>(comm, std::move(gradients), std::move(options));
  // Every rank takes part in the comparison, also one that objects to its own arguments, so
  // that no rank is left waiting in it.
  GS_RETURN_IF_ERROR(agree_on_registrations(comm, impl->grads(), impl->options(), impl->validate()));
  GS_RETURN_IF_ERROR(impl->plan_initial());
  return std::unique_ptr<GradientReducer>(new GradientReducer(std::move(impl)));
}

GradientReducer::GradientReducer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GradientReducer::~GradientReducer() = default;
void* GradientReducer::view(int i) const { return impl_->view(i); }
Status GradientReducer::mark_ready(int i) { return impl_->mark_ready(i); }
Status GradientReducer::finish() { return impl_->finish(); }
std::vector<BucketInfo> GradientReducer::buckets() const { return impl_->buckets(); }
int GradientReducer::buckets_started() const { return impl_->started(); }
int64_t GradientReducer::steps() const { return impl_->steps(); }
bool GradientReducer::rebuilt() const { return impl_->rebuilt(); }

}  // namespace gradsync
