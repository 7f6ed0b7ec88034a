#include "bench/simulate.h"

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "bench/collective.h"
#include "gpu/plan/cost_model.h"

namespace bench {
namespace {

namespace plan = gradsync::plan;

gradsync::CollectiveKind kind_of(Collective c) {
  switch (c) {
    case Collective::kReduceScatter: return gradsync::CollectiveKind::kReduceScatter;
    case Collective::kAllGather: return gradsync::CollectiveKind::kAllGather;
    case Collective::kBroadcast: return gradsync::CollectiveKind::kBroadcast;
    default: return gradsync::CollectiveKind::kAllreduce;
  }
}

char letter(plan::Algo a) {
  switch (a) {
    case plan::Algo::kRing: return 'r';
    case plan::Algo::kTree: return 't';
    case plan::Algo::kOneShot: return 'o';
    case plan::Algo::kTwoShot: return 's';
    case plan::Algo::kHierarchical: return 'h';
  }
  return '?';
}

plan::JobShape shape_of(const Options& opt, int nodes, int gpus) {
  plan::JobShape s = plan::uniform_shape(nodes, gpus, opt.sim.nics);
  s.links = opt.sim.links;
  return s;
}

// The override the runtime would apply: --algo, else GRADSYNC_ALGO.
std::optional<plan::Algo> forced(const Options& opt) {
  std::string err;
  auto env = plan::algo_from_env(std::getenv("GRADSYNC_ALGO"), &err);
  if (!err.empty()) std::fprintf(stderr, "gradsync-bench: %s; using auto\n", err.c_str());
  return plan::forced_algo(opt.algo, env);
}

std::string human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  char b[32];
  std::snprintf(b, sizeof b, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return b;
}

struct Row {
  size_t bytes = 0;
  double busbw = 0;
  plan::Algo algo = plan::Algo::kRing;
  bool valid = false;
};

}  // namespace

int run_simulate(const Options& opt) {
  const auto type = opt.types[0];
  const size_t esize = esize_of(type.type);
  const auto kind = kind_of(opt.collective);
  const auto force = forced(opt);
  const auto& l = opt.sim.links;
  const std::vector<size_t> all_sizes = sizes(opt);
  std::printf("# gradsync-bench --simulate: %s %s, predicted by the GPU cost model over the planned schedules\n",
              name(opt.collective), type.name);
  std::printf("# links: %s %.0f GB/s per GPU per direction, hop %.2f/%.2f us (LL/bulk); %d NIC(s) per node x %.0f GB/s, hop %.2f/%.2f us\n",
              plan::to_string(l.intra_class), l.intra_gbps, l.intra_lat.ll_us, l.intra_lat.bulk_us, opt.sim.nics,
              l.nic_gbps, l.nic_lat.ll_us, l.nic_lat.bulk_us);
  std::printf("# algo %s; busbw as nccl-tests (allreduce x 2(n-1)/n, reduce_scatter/all_gather x (n-1)/n, broadcast x 1)\n",
              force ? plan::to_string(*force) : "auto (the model's choice)");
  std::vector<std::vector<Row>> table;
  for (int nodes : opt.sim.nodes) {
    const plan::JobShape shape = shape_of(opt, nodes, opt.sim.gpus);
    const int n = shape.world_size();
    std::printf("#\n# %dx%d: %d ranks, %d ring channel(s), %d tree channel(s)\n", nodes, opt.sim.gpus, n,
                plan::default_ring_channels(shape), plan::default_tree_channels(shape));
    std::printf("# %10s  %11s  %-12s  %-4s  %9s  %7s  %7s  %9s  %9s  %9s  %9s  %9s  %11s  %11s\n", "size", "count",
                "algo", "prot", "time(us)", "algbw", "busbw", "ring", "tree", "one-shot", "two-shot", "hier", "GPU bytes",
                "NIC bytes");
    std::vector<Row> rows;
    std::string note;  // an override the shape cannot honour, once per shape
    for (size_t bytes : all_sizes) {
      const Geometry g = geometry(opt.collective, bytes, esize, n);
      Row row;
      row.bytes = bytes;
      if (g.count == 0) {
        rows.push_back(row);
        continue;
      }
      const plan::Choice c = plan::choose(shape, kind, g.count, esize, 0, force);
      if (note.empty() && c.forced.find("cannot") != std::string::npos) note = c.forced;
      const double algbw = double(g.bytes) / c.best.us / 1e3;
      row.busbw = algbw * g.bus_factor;
      row.algo = c.best.algo;
      row.valid = true;
      rows.push_back(row);
      double per_algo[plan::kNumAlgos] = {};
      for (const auto& e : c.all) {
        double& t = per_algo[int(e.algo)];
        if (t == 0 || e.us < t) t = e.us;
      }
      char cells[plan::kNumAlgos][16];
      for (int a = 0; a < plan::kNumAlgos; ++a) {
        if (per_algo[a] == 0) std::snprintf(cells[a], 16, "%9s", "-");
        else std::snprintf(cells[a], 16, "%9.1f", per_algo[a]);
      }
      std::printf("  %10zu  %11zu  %-12s  %-4s  %9.1f  %7.2f  %7.2f  %s  %s  %s  %s  %s  %11s  %11s\n", g.bytes,
                  g.count, plan::to_string(c.best.algo), plan::to_string(c.best.proto), c.best.us, algbw, row.busbw,
                  cells[0], cells[1], cells[2], cells[3], cells[4], human(double(c.best.fig.max_intra_bytes)).c_str(),
                  human(double(c.best.fig.max_nic_bytes)).c_str());
      std::fflush(stdout);
    }
    if (!note.empty()) std::printf("# note: %s\n", note.c_str());
    table.push_back(std::move(rows));
  }
  // The summary: busbw by size (rows) and shape (columns), the chosen algorithm's letter.
  std::printf("#\n# predicted busbw (GB/s) and algorithm (r ring, t tree, o one-shot, s two-shot, h hierarchical)\n# %10s", "size");
  for (int nodes : opt.sim.nodes) std::printf("  %9s", (std::to_string(nodes) + "x" + std::to_string(opt.sim.gpus)).c_str());
  std::printf("\n");
  for (size_t i = 0; i < all_sizes.size(); ++i) {
    std::printf("  %10zu", all_sizes[i]);
    for (const auto& rows : table) {
      if (rows[i].valid) std::printf("  %7.1f %c", rows[i].busbw, letter(rows[i].algo));
      else std::printf("  %9s", "-");
    }
    std::printf("\n");
  }
  return 0;
}

void print_gpu_choices(const Options& opt, int nodes, int gpus, const std::vector<size_t>& sizes) {
  const plan::JobShape shape = shape_of(opt, nodes, gpus);
  const auto type = opt.types[0];
  const size_t esize = esize_of(type.type);
  const auto force = forced(opt);
  std::printf("#\n# GPU plan for this job's shape (%d node(s) x %d GPUs, declared links: gradsync-bench --help, "
              "--simulate): the choice of the GPU cost model\n# %10s  %-12s  %-4s  %9s\n",
              nodes, gpus, "size", "algo", "prot", "pred(us)");
  for (size_t bytes : sizes) {
    const Geometry g = geometry(opt.collective, bytes, esize, shape.world_size());
    if (g.count == 0) continue;
    const plan::Choice c = plan::choose(shape, kind_of(opt.collective), g.count, esize, 0, force);
    std::printf("  %10zu  %-12s  %-4s  %9.1f%s%s\n", g.bytes, plan::to_string(c.best.algo), plan::to_string(c.best.proto),
                c.best.us, c.forced.empty() ? "" : "  ", c.forced.c_str());
  }
}

}  // namespace bench
