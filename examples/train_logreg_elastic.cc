// Elastic data-parallel logistic regression (gradsync/elastic.h): one rank is killed
// (SIGKILL, by itself) at --kill-step; the survivors shrink to a communicator of the
// survivors and redo that step; at --grow-step they grow back, admitting the replacement
// process gradsyncrun started (--replace-failed), and send it the weights. Every rank then
// checks its weights against a reference computed here in one process that switches from
// N to N-1 ranks at --kill-step and back to N at --grow-step.
//
//   gradsyncrun --standalone -n 4 --replace-failed 1 build/bin/train_logreg_elastic
//       [--steps 40] [--kill-step 20] [--grow-step 30] [--kill-rank N-1] [--batch 128]
//       [--samples 8192] [--features 64] [--slow-rank R --slow-ms 2500 --shrink-wait-ms 5000]
//       [--ahead-rank R]
//
// Each step takes a mini-batch of --batch samples per rank from a cursor that advances by
// the world's batch, so the world size changes the training: a run that did not shrink or
// grow where the reference does ends with other weights (checked too). Host tensors only.
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/elastic.h"
#include "gradsync/gradsync.h"
#include "logreg.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Plan {
  int steps = 40;
  int kill_step = 20;
  int grow_step = 30;
  int kill_rank = -1;  // default: the last rank
  // A survivor that calls shrink() --slow-ms late, past the others' --shrink-wait-ms: it is
  // left out, its shrink fails naming the set it missed, and it exits 3 (gradsyncrun
  // --replace-failed 2 then replaces it too, and the grow admits both replacements).
  int slow_rank = -1;
  int slow_ms = 2500;
  int shrink_wait_ms = 5000;
  // Test only: forces the race the step agreement exists for. The dying rank's last allreduce
  // (step kill-step - 1) completes on rank R, while every other survivor takes it as lost, as
  // when the abort of the rank's death reaches it inside that call: they redo the step, R goes
  // on to the next. The dying rank kills itself right after that allreduce, so both calls
  // fail, the survivors shrink one step apart, and R must take its last update back.
  int ahead_rank = -1;
  int batch = 128;
};

// The training state a newcomer receives: step, cursor, the initial world size, and the step
// from which the survivors ran in the smaller world (for the reference).
struct State {
  int64_t step = 0;
  int64_t cursor = 0;
  int64_t initial_world = 0;
  int64_t shrunk_at = -1;
};

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The samples of one step: rank r of n takes [cursor + r*batch, cursor + (r+1)*batch).
int64_t next_cursor(const logreg::Config& c, const Plan& p, int64_t cursor, int world, int max_world) {
  int64_t next = cursor + int64_t(world) * p.batch;
  return next + int64_t(max_world) * p.batch > c.samples ? 0 : next;
}

void apply(const logreg::Config& c, const Plan& p, int world, std::vector<float>& w, const std::vector<float>& grad) {
  const float scale = c.lr / float(world * p.batch);
  for (int j = 0; j < c.features; ++j) w[j] -= scale * grad[size_t(j)];
}

// The run in one process, with the world size of each step given by `world_at`: each rank's
// partial gradient as that rank computes it, summed in rank order.
template <typename WorldAt>
std::vector<float> reference(const logreg::Config& c, const Plan& p, const logreg::Dataset& d, int max_world,
                             WorldAt world_at) {
  std::vector<float> w(size_t(c.features), 0.0f), sum(size_t(c.features) + 1), part(size_t(c.features) + 1);
  int64_t cursor = 0;
  for (int s = 0; s < p.steps; ++s) {
    const int n = world_at(s);
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int r = 0; r < n; ++r) {
      const int begin = int(cursor) + r * p.batch;
      logreg::accumulate(c, d, w, begin, begin + p.batch, part);
      for (size_t j = 0; j < sum.size(); ++j) sum[j] += part[j];
    }
    apply(c, p, n, w, sum);
    cursor = next_cursor(c, p, cursor, n, max_world);
  }
  return w;
}

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, size = 0;
  for (size_t j = 0; j < a.size(); ++j) {
    diff = std::max(diff, double(std::fabs(a[j] - b[j])));
    size = std::max(size, double(std::fabs(b[j])));
  }
  return diff / std::max(size, 1e-12);
}

int fail(const std::string& what) {
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  logreg::Config c;
  c.features = 64;
  c.samples = logreg::arg_int(argc, argv, "--samples", c.samples);
  c.features = logreg::arg_int(argc, argv, "--features", c.features);
  // Only the order of 3 or 4 partial sums differs from the reference (no regrouping of
  // samples): float32 rounding of that, far below the effect of a wrong world size.
  c.tolerance = 1e-5;
  Plan p;
  p.steps = logreg::arg_int(argc, argv, "--steps", p.steps);
  p.kill_step = logreg::arg_int(argc, argv, "--kill-step", p.kill_step);
  p.grow_step = logreg::arg_int(argc, argv, "--grow-step", p.grow_step);
  p.kill_rank = logreg::arg_int(argc, argv, "--kill-rank", p.kill_rank);
  p.slow_rank = logreg::arg_int(argc, argv, "--slow-rank", p.slow_rank);
  p.slow_ms = logreg::arg_int(argc, argv, "--slow-ms", p.slow_ms);
  p.shrink_wait_ms = logreg::arg_int(argc, argv, "--shrink-wait-ms", p.shrink_wait_ms);
  p.ahead_rank = logreg::arg_int(argc, argv, "--ahead-rank", p.ahead_rank);
  p.batch = logreg::arg_int(argc, argv, "--batch", p.batch);
  if (!(0 < p.kill_step && p.kill_step < p.grow_step && p.grow_step < p.steps) || p.batch < 1) {
    return fail("need 0 < --kill-step < --grow-step < --steps and --batch >= 1");
  }

  auto session = gradsync::Session::connect();
  if (!session.ok()) return fail(session.status().to_string());
  gradsync::JoinOptions opts = gradsync::JoinOptions::from_env();
  const char* repl = std::getenv("GRADSYNC_REPLACEMENT");
  const bool newcomer = repl != nullptr && std::string(repl) == "1";

  State st;
  std::vector<float> w(size_t(c.features), 0.0f);
  std::vector<float> grad(size_t(c.features) + 1);
  auto t_start = Clock::now();
  auto joined = newcomer ? gradsync::join_newcomer(opts) : session->join(opts);
  if (!joined.ok()) return fail(std::string(newcomer ? "join_newcomer: " : "join: ") + joined.status().to_string());
  gradsync::Communicator comm = std::move(joined).value();
  bool grew = false;
  if (newcomer) {
    std::printf("newcomer: rank %d of %d in generation %llu after waiting %.0f ms for the grow\n", comm.rank(),
                comm.world_size(), (unsigned long long)comm.generation(), ms_since(t_start));
  } else {
    st.initial_world = comm.world_size();
    if (p.kill_rank < 0) p.kill_rank = comm.world_size() - 1;
    if (comm.world_size() < 2 || p.kill_rank >= comm.world_size()) return fail("needs 2 ranks or more and --kill-rank < N");
    if (p.slow_rank == p.kill_rank || p.slow_rank >= comm.world_size() || (p.slow_rank >= 0 && comm.world_size() < 3)) {
      return fail("--slow-rank must be another rank of a world of 3 or more");
    }
    if (p.ahead_rank == p.kill_rank || p.ahead_rank >= comm.world_size() || (p.ahead_rank >= 0 && comm.world_size() < 3) ||
        (p.ahead_rank >= 0 && p.slow_rank >= 0)) {
      return fail("--ahead-rank must be another rank of a world of 3 or more, without --slow-rank");
    }
  }
  const int original_rank = newcomer ? -1 : comm.rank();
  const uint64_t first_generation = comm.generation();
  // After a grow, every member sends the state; a newcomer receives it.
  auto share_state = [&]() -> gradsync::Status {
    int64_t s[4] = {st.step, st.cursor, st.initial_world, st.shrunk_at};
    gradsync::Status r = comm.broadcast(s, 4, gradsync::DataType::kInt64, 0);
    if (!r.ok()) return r;
    st = State{s[0], s[1], s[2], s[3]};
    return comm.broadcast(w.data(), w.size(), gradsync::DataType::kFloat32, 0);
  };
  if (newcomer) {
    if (gradsync::Status r = share_state(); !r.ok()) return fail("receiving the state: " + r.to_string());
    grew = true;
    std::printf("newcomer: received the weights at step %lld\n", (long long)st.step);
  }
  const logreg::Dataset data = logreg::make_data(c);
  const int max_world = int(st.initial_world);
  if (int64_t(max_world) * p.batch * 2 > c.samples) return fail("--samples too small for the world's batch");

  bool first_after_shrink = false;
  bool rolled_back = false;
  // --ahead-rank: the step whose allreduce is the dying rank's last.
  const int64_t last_step_of_dying = p.ahead_rank >= 0 ? p.kill_step - 1 : -1;
  // The state before the last step's update: a survivor whose allreduce of step k completed
  // while another's failed (the abort reached that one first) is a step ahead after the
  // shrink; the survivors agree on the earliest step and a rank ahead takes this back.
  State before = st;
  std::vector<float> w_before = w;
  while (st.step < p.steps) {
    if (st.step == p.grow_step && !grew) {
      grew = true;
      auto t0 = Clock::now();
      gradsync::GrowOptions g;
      g.newcomers = int(st.initial_world) - comm.world_size();
      auto bigger = gradsync::grow(comm, g);
      if (!bigger.ok()) return fail("grow: " + bigger.status().to_string());
      const double grow_ms = ms_since(t0);
      auto t_release = Clock::now();
      comm = std::move(bigger).value();  // the old generation's communicator goes here
      const double release_ms = ms_since(t_release);
      if (gradsync::Status r = share_state(); !r.ok()) return fail("sending the state: " + r.to_string());
      if (comm.rank() == 0) {
        std::printf("step %lld: grew to %d ranks, generation %llu, in %.0f ms (old generation released in %.0f ms, "
                    "state sent after %.0f ms)\n",
                    (long long)st.step, comm.world_size(), (unsigned long long)comm.generation(), grow_ms, release_ms,
                    ms_since(t0));
      }
    }
    if (original_rank == p.kill_rank && st.step == p.kill_step && comm.generation() == first_generation &&
        p.ahead_rank < 0) {
      std::printf("rank %d: killing myself (SIGKILL) at step %lld\n", comm.rank(), (long long)st.step);
      std::fflush(stdout);
      ::raise(SIGKILL);
    }
    const int n = comm.world_size();
    const int begin = int(st.cursor) + comm.rank() * p.batch;
    logreg::accumulate(c, data, w, begin, begin + p.batch, grad);
    auto t0 = Clock::now();
    gradsync::Status s = comm.allreduce(grad.data(), grad.size(), gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum);
    if (s.ok() && st.step == last_step_of_dying && comm.generation() == first_generation) {
      if (original_rank == p.kill_rank) {
        std::printf("rank %d: killing myself (SIGKILL) right after the allreduce of step %lld\n", comm.rank(),
                    (long long)st.step);
        std::fflush(stdout);
        ::raise(SIGKILL);
      }
      if (original_rank != p.ahead_rank) {
        // As if the abort had reached this rank inside the call: the step is done again. Its
        // next allreduce pairs with rank R's of the following step and fails with the others.
        std::printf("rank %d: --ahead-rank: taking the allreduce of step %lld as lost\n", comm.rank(),
                    (long long)st.step);
        continue;
      }
    }
    if (!s.ok()) {
      const double failed_ms = ms_since(t0);
      auto t1 = Clock::now();
      gradsync::ShrinkOptions so;
      so.wait = std::chrono::milliseconds(p.shrink_wait_ms);
      if (original_rank == p.slow_rank) {
        std::printf("rank %d: calling shrink %d ms late\n", comm.rank(), p.slow_ms);
        std::this_thread::sleep_for(std::chrono::milliseconds(p.slow_ms));
      }
      auto smaller = gradsync::shrink(comm, so);
      if (original_rank == p.slow_rank) {
        if (smaller.ok() || smaller.status().code() != gradsync::Code::kFailedPrecondition) {
          return fail("the slow rank should have been left out: " +
                      (smaller.ok() ? std::string("it got rank ") + std::to_string(smaller->rank())
                                    : smaller.status().to_string()));
        }
        std::printf("rank %d: left out as expected: %s\n", comm.rank(), smaller.status().to_string().c_str());
        return 3;
      }
      if (!smaller.ok()) return fail("step " + std::to_string(st.step) + ": shrink after '" + s.to_string() +
                                     "': " + smaller.status().to_string());
      const double shrink_ms = ms_since(t1);
      auto t_release = Clock::now();
      comm = std::move(smaller).value();  // the old generation's communicator goes here
      std::printf("step %lld: allreduce failed after %.0f ms (%s); shrank to rank %d of %d, generation %llu, "
                  "in %.0f ms (old generation released in %.0f ms)\n",
                  (long long)st.step, failed_ms, s.to_string().c_str(), comm.rank(), comm.world_size(),
                  (unsigned long long)comm.generation(), shrink_ms, ms_since(t_release));
      first_after_shrink = true;
      // The step to redo in the new world: the earliest any survivor failed in.
      int64_t agreed = st.step;
      if (gradsync::Status a = comm.allreduce(&agreed, 1, gradsync::DataType::kInt64, gradsync::ReduceOp::kMin); !a.ok()) {
        return fail("agreeing on the step to redo: " + a.to_string());
      }
      if (agreed < st.step) {
        if (agreed != before.step) return fail("survivors more than one step apart after the shrink");
        std::printf("rank %d: step %lld completed here but not on every survivor: back to step %lld\n", comm.rank(),
                    (long long)st.step, (long long)agreed);
        rolled_back = true;
        const int64_t initial = st.initial_world;
        st = before;
        st.initial_world = initial;
        w = w_before;
      }
      st.shrunk_at = st.step;
      continue;  // the same step again, in the new world
    }
    if (first_after_shrink && comm.rank() == 0) {
      std::printf("step %lld: the first allreduce of generation %llu took %.1f ms\n", (long long)st.step,
                  (unsigned long long)comm.generation(), ms_since(t0));
    }
    first_after_shrink = false;
    before = st;
    w_before = w;
    apply(c, p, n, w, grad);
    st.cursor = next_cursor(c, p, st.cursor, n, max_world);
    if (comm.rank() == 0 && (st.step % 10 == 0 || st.step == p.steps - 1)) {
      std::printf("step %3lld  world %d  loss %.6f\n", (long long)st.step, n, grad[size_t(c.features)] / float(n * p.batch));
    }
    ++st.step;
  }
  if (comm.world_size() != max_world) {
    return fail("ended with " + std::to_string(comm.world_size()) + " ranks, not " + std::to_string(max_world) +
                ": the replacement never joined");
  }

  // The reference: N ranks, N-1 (N-2 with a slow rank) from the step the survivors agreed to
  // redo (the kill step, or the one before when the dying rank's last allreduce completed
  // on some survivors only), N again from the grow step.
  const int shrunk = max_world - 1 - (p.slow_rank >= 0 ? 1 : 0);
  if (st.shrunk_at < 0) return fail("the run never shrank");
  if (original_rank >= 0 && original_rank == p.ahead_rank && !rolled_back) {
    return fail("--ahead-rank: rank " + std::to_string(original_rank) + " never took a step back");
  }
  const std::vector<float> ref = reference(c, p, data, max_world, [&](int s) {
    return s < st.shrunk_at || s >= p.grow_step ? max_world : shrunk;
  });
  const std::vector<float> fixed = reference(c, p, data, max_world, [&](int) { return max_world; });
  const double rel = rel_diff(w, ref);
  const double rel_fixed = rel_diff(w, fixed);
  gradsync::Status left = comm.leave();
  if (!left.ok()) return fail("leave: " + left.to_string());
  if (!(rel <= c.tolerance)) {
    return fail("rank " + std::to_string(comm.rank()) + " weights differ from the reference that switches " +
                std::to_string(max_world) + "->" + std::to_string(shrunk) + "->" + std::to_string(max_world) +
                ": " + std::to_string(rel) + " relative");
  }
  if (!(rel_fixed > 100 * c.tolerance)) {
    return fail("the run is indistinguishable from one that never changed its world (" + std::to_string(rel_fixed) +
                " relative): the check would not see a wrong world size");
  }
  std::printf("OK: rank %d weights match the reference switching %d->%d->%d ranks at steps %lld and %d (%.3g relative, "
              "tolerance %.1g; a fixed-world run differs by %.3g)\n",
              comm.rank(), max_world, shrunk, max_world, (long long)st.shrunk_at, p.grow_step, rel, c.tolerance, rel_fixed);
  return 0;
}
