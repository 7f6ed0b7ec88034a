// gradsync-bench: nccl-tests' all_reduce_perf table for gradsync's collectives.
//
//   gradsyncrun --standalone -n 4 gradsync-bench -b 1K -e 256M -f 4 -c 1
//
// Every rank runs every size; rank 0 prints one line per size with the slowest rank's mean
// time per iteration and the #wrong elements summed over ranks. Exits 1 when anything was
// wrong or a call failed, 2 on a bad command line. Flags: gradsync-bench --help.
//
// --simulate 1 (bench/simulate.cc): no job; the GPU cost model over the planned schedules for
// declared shapes and links (docs/benchmarks.md, "Scale on paper").
//
// --device cuda (bench/gpu.cc, CUDA builds): allreduce, reduce_scatter, all_gather or
// broadcast (--collective) on device buffers, timed on a stream, beside NCCL's on the same
// buffers (--nccl 1, the default where NCCL was found at build time).
#include <unistd.h>

#include <algorithm>
#include <vector>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "bench/collective.h"
#include "bench/data.h"
#include "bench/options.h"
#include "bench/simulate.h"
#ifdef GRADSYNC_BENCH_CUDA
#include "bench/gpu.h"
#endif

namespace {

using bench::Collective;

// Per group on every rank: time, wrong count in two float-exact halves, failed flag.
constexpr int kFields = 4;
constexpr double kHalf = 1 << 20;

std::string time_str(double us) {  // nccl-tests' widths
  char b[32];
  std::snprintf(b, sizeof b, us >= 10000 ? "%7.0f" : us >= 100 ? "%7.1f" : "%7.2f", us);
  return b;
}

struct Group {
  bool in_place;
  const char* title;
};

// --model: times ring and tree allreduce (out-of-place) at every size and prints them beside
// the cost model's predictions and choice; counts the sizes where the choice was the faster.
// Then, where the job's ranks fill its nodes evenly (`local` per node), the GPU cost model's
// choice for GPU calls of that shape (bench/simulate.h).
int model_table(gradsync::Communicator& comm, const bench::Options& opt,
                const std::vector<size_t>& sizes, int local) {
  const bool root0 = comm.rank() == 0;
  const auto type = opt.types[0];
  if (root0) {
    std::printf("#\n# cost model: %s\n", comm.cost_model().c_str());
    std::printf("# %10s  %9s  %9s  %6s  %9s  %9s  %6s  %s\n", "size", "ring(us)", "tree(us)", "faster",
                "pred ring", "pred tree", "model", "right");
  }
  int right = 0, total = 0;
  // Ring and tree take turns, kModelRounds times; each is the median of its rounds (each
  // round: the slowest rank's mean), so one preempted round on a shared machine does not
  // decide which algorithm was faster.
  constexpr int kModelRounds = 5;
  for (size_t bytes : sizes) {
    double t[2];
    std::vector<double> rounds[2];
    for (int round = 0; round < kModelRounds; ++round) {
      for (int a = 0; a < 2; ++a) {
        bench::Case c{bench::Collective::kAllreduce, type.type, opt.ops[0].op, 0,
                      {a == 0 ? gradsync::Algorithm::kRing : gradsync::Algorithm::kTree}, {}, 0};
        c.g = bench::geometry(c.collective, bytes, bench::esize_of(type.type), comm.world_size());
        bench::Buffers buf(c.g, bench::esize_of(type.type));
        bench::Outcome r = bench::run_group(comm, c, false, false, round == 0 ? opt.warmup : 1, opt.iters, buf);
        if (!r.status.ok()) {
          std::fprintf(stderr, "gradsync-bench: --model %zu B failed: %s\n", bytes, r.status.to_string().c_str());
          return 1;
        }
        auto all = bench::gather(comm, {r.time_us});
        if (!all.ok()) return 1;
        rounds[a].push_back(*std::max_element(all->begin(), all->end()));
      }
    }
    for (int a = 0; a < 2; ++a) {
      std::sort(rounds[a].begin(), rounds[a].end());
      t[a] = rounds[a][rounds[a].size() / 2];
    }
    size_t count = bytes / bench::esize_of(type.type);
    auto p = comm.predict_allreduce(count, type.type);
    bool tree_faster = t[1] < t[0];
    bool picks_tree = p.choice == gradsync::Algorithm::kTree;
    // A choice within 5% of the faster time is as good as right: the two are a tie.
    bool ok = picks_tree == tree_faster || std::abs(t[0] - t[1]) <= 0.05 * std::min(t[0], t[1]);
    right += ok;
    ++total;
    if (root0) {
      std::printf("  %10zu  %9.1f  %9.1f  %6s  %9.1f  %9.1f  %6s  %s\n", bytes, t[0], t[1],
                  tree_faster ? "tree" : "ring", p.ring_us, p.tree_us, picks_tree ? "tree" : "ring",
                  ok ? "yes" : "NO");
    }
  }
  if (root0) {
    std::printf("# selection picked the faster algorithm (or a tie within 5%%) at %d of %d sizes (%.0f%%)\n",
                right, total, total ? 100.0 * right / total : 0.0);
    const int n = comm.world_size();
    if (local >= 1 && n % local == 0) bench::print_gpu_choices(opt, n / local, local, sizes);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Options opt;
  bool help = false;
  if (!bench::parse_options(argc, argv, &opt, &help)) return help ? 0 : 2;
  // --simulate 1: the planned GPU schedules on paper; no daemon, no job.
  if (opt.simulate) return bench::run_simulate(opt);

  // --timeline 1: the communicator records the GPU timeline (read when it is created).
  if (opt.timeline) ::setenv("GRADSYNC_GPU_TIMELINE", "1", 1);
  auto session = gradsync::Session::connect();
  if (!session.ok()) {
    std::fprintf(stderr, "gradsync-bench: connect: %s\n", session.status().to_string().c_str());
    return 1;
  }
  gradsync::JoinOptions join = gradsync::JoinOptions::from_env();
  // --device host: a host-only communicator whatever $GRADSYNC_DEVICE says. --device cuda:
  // $GRADSYNC_DEVICE's ordinal where set, else the device of LOCAL_RANK.
  if (opt.device == bench::Device::kHost) {
    join.device = gradsync::JoinOptions::kNoDevice;
  } else if (join.device == gradsync::JoinOptions::kNoDevice) {
    join.device = gradsync::JoinOptions::kDeviceLocalRank;
  }
  auto comm = session->join(join);
  if (!comm.ok()) {
    std::fprintf(stderr, "gradsync-bench: join: %s\n", comm.status().to_string().c_str());
    return 1;
  }
#ifdef GRADSYNC_BENCH_CUDA
  if (opt.device == bench::Device::kCuda) {
    const int rc = bench::run_gpu(*session, *comm, opt);
    (void)comm->leave();
    return rc;
  }
#endif
  const int rank = comm->rank(), n = comm->world_size();
  const bool root0 = rank == 0;
  const Collective coll = opt.collective;
  const bool reduces = coll == Collective::kAllreduce || coll == Collective::kReduceScatter;

  std::vector<Group> groups;
  if (coll == Collective::kBarrier) {
    groups.push_back({false, "barrier"});
  } else if (coll == Collective::kBroadcast) {
    // One buffer in gradsync's broadcast: there is no out-of-place form to time.
    if (!opt.in_place) {
      if (root0)
        std::fprintf(stderr, "gradsync-bench: broadcast is in-place only; drop --inplace 0\n");
      return 2;
    }
    groups.push_back({true, "in-place"});
  } else {
    if (opt.out_of_place) groups.push_back({false, "out-of-place"});
    if (opt.in_place) groups.push_back({true, "in-place"});
  }
  if (coll == Collective::kBroadcast && opt.root >= n) {
    if (root0) std::fprintf(stderr, "gradsync-bench: root %d is not a rank of %d\n", opt.root, n);
    return 2;
  }
  std::vector<size_t> sizes = bench::sizes(opt);
  if (coll == Collective::kBarrier) sizes = {0};
  if (!reduces) opt.ops.resize(1);  // one pass; redop prints as "none"
  if (coll == Collective::kBarrier) opt.types.resize(1), opt.check = false;  // nothing to check

  if (root0) {
    std::printf("# gradsync-bench %s  nranks %d  node %s  pid %d\n", bench::name(coll), n,
                session->node_name().c_str(), int(getpid()));
    std::string types, ops;
    for (const auto& t : opt.types) types += std::string(types.empty() ? "" : ",") + t.name;
    for (const auto& o : opt.ops) ops += std::string(ops.empty() ? "" : ",") + o.name;
    std::printf(
        "# minBytes %zu maxBytes %zu step: %zu(factor) warmup iters: %d iters: %d "
        "validation: %d\n# type %s  redop %s  algo %s  device %s  nccl %d\n#\n",
        opt.min_bytes, opt.max_bytes, opt.factor, opt.warmup, opt.iters, int(opt.check),
        types.c_str(), reduces ? ops.c_str() : "none", bench::name(opt.algo),
        bench::name(opt.device), int(opt.nccl));
    std::printf("# %10s  %12s  %8s  %6s  %6s", "", "", "", "", "");
    for (const auto& g : groups) std::printf("  %-31s", g.title);
    std::printf("\n# %10s  %12s  %8s  %6s  %6s", "size", "count", "type", "redop", "root");
    for (size_t i = 0; i < groups.size(); ++i)
      std::printf("  %7s  %6s  %6s  %6s", "time", "algbw", "busbw", "#wrong");
    std::printf("\n# %10s  %12s  %8s  %6s  %6s", "(B)", "(elements)", "", "", "");
    for (size_t i = 0; i < groups.size(); ++i)
      std::printf("  %7s  %6s  %6s  %6s", "(us)", "(GB/s)", "(GB/s)", "");
    std::printf("\n");
    std::fflush(stdout);
  }

  double bw_sum = 0;
  int bw_lines = 0;
  size_t total_wrong = 0;
  int failures = 0;
  for (const auto& t : opt.types) {
    for (const auto& o : opt.ops) {
      for (size_t bytes : sizes) {
        bench::Case c{coll, t.type, o.op, opt.root, {opt.algo}, {}, 0};
        c.g = bench::geometry(coll, bytes, bench::esize_of(t.type), n);
        c.seed = (uint64_t(bytes) << 16) ^ (uint64_t(t.type) << 8) ^ (uint64_t(o.op) << 4) ^
                 uint64_t(coll);
        bench::Buffers buf(c.g, bench::esize_of(t.type));
        const char* type_name = coll == Collective::kBarrier ? "none" : t.name;
        const char* op_name = reduces ? o.name : "none";
        const std::string label = std::string(bench::name(coll)) + " " + type_name + " " + op_name;
        std::vector<double> mine;
        for (const auto& g : groups) {
          bench::Outcome r =
              bench::run_group(*comm, c, g.in_place, opt.check, opt.warmup, opt.iters, buf, opt.median);
          if (!r.status.ok()) {
            std::fprintf(stderr, "gradsync-bench: rank %d: %s %zu B %s failed: %s\n", rank,
                         label.c_str(), c.g.bytes, g.title, r.status.to_string().c_str());
            std::fflush(stderr);
          }
          mine.insert(mine.end(), {r.time_us, double(r.wrong / size_t(kHalf)),
                                   double(r.wrong % size_t(kHalf)), r.status.ok() ? 0.0 : 1.0});
        }
        auto all = bench::gather(*comm, mine);
        if (!all.ok()) {
          std::fprintf(stderr, "gradsync-bench: rank %d: gathering results failed: %s\n", rank,
                       all.status().to_string().c_str());
          if (root0)
            std::printf("# %s %zu B: the job failed; see stderr\n", label.c_str(), c.g.bytes);
          return 1;
        }
        // Rank 0 prints; every rank takes the same decisions from the same gathered numbers.
        std::string line;
        bool failed = false;
        for (size_t gi = 0; gi < groups.size(); ++gi) {
          double t_us = 0, wrong = 0;
          bool group_failed = false;
          for (int r = 0; r < n; ++r) {
            const double* f = &(*all)[(r * groups.size() + gi) * kFields];
            t_us = std::max(t_us, f[0]);
            wrong += f[1] * kHalf + f[2];
            group_failed |= f[3] != 0;
          }
          total_wrong += size_t(wrong);
          char cells[96];
          if (group_failed) {
            failed = true;
            std::snprintf(cells, sizeof cells, "  %7s  %6s  %6s  %6s", "FAILED", "-", "-", "-");
          } else {
            double algbw = t_us > 0 ? double(c.g.bytes) / t_us / 1e3 : 0;  // B/us/1e3 = GB/s
            double busbw = algbw * c.g.bus_factor;
            bw_sum += busbw;
            ++bw_lines;
            std::snprintf(cells, sizeof cells, "  %7s  %6.2f  %6.2f  %6s", time_str(t_us).c_str(),
                          algbw, busbw, opt.check ? std::to_string(size_t(wrong)).c_str() : "N/A");
          }
          line += cells;
        }
        if (root0) {
          std::printf("%12zu  %12zu  %8s  %6s  %6d%s\n", c.g.bytes, c.g.count, type_name, op_name,
                      coll == Collective::kBroadcast ? opt.root : -1, line.c_str());
          if (failed) {
            std::printf(
                "# %s failed (each failing rank printed why on stderr); "
                "skipping its larger sizes\n",
                label.c_str());
          }
          std::fflush(stdout);
        }
        if (failed) {
          ++failures;
          break;
        }
      }
    }
  }
  if (root0) {
    std::printf("# Errors: %zu wrong elements, %d failed runs\n", total_wrong, failures);
    std::printf("# Avg bus bandwidth    : %.4f \n#\n", bw_lines ? bw_sum / bw_lines : 0.0);
    std::fflush(stdout);
  }
  if (opt.model && coll == Collective::kAllreduce && model_table(*comm, opt, sizes, join.local_world_size) != 0) failures++;
  (void)comm->leave();
  return (total_wrong > 0 || failures > 0) ? 1 : 0;
}
