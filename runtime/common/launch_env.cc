#include "common/launch_env.h"

#include <charconv>
#include <cstdlib>
#include <optional>

namespace gradsync::launch {
namespace {

Status bad(const std::string& message) { return {Code::kInvalidArgument, message}; }

// Reads one launcher's variables, remembering which were read for messages.
class Reader {
 public:
  Reader(const EnvLookup& env, Placement* p) : env_(env), p_(p) {}
  bool has(const char* name) const { return env_(name) != nullptr; }
  std::optional<std::string> str(const char* name) {
    const char* v = env_(name);
    if (v == nullptr) return std::nullopt;
    note(name, v);
    return std::string(v);
  }
  // An integer >= min, or an error naming the variable; `out` is left alone when unset.
  Status integer(const char* name, int min, int* out, bool required = false) {
    const char* v = env_(name);
    if (v == nullptr) {
      return required ? bad(p_->launcher + " variables incomplete: " + name + " is not set (read " +
                            p_->vars + ")")
                      : Status();
    }
    note(name, v);
    const std::string text(v);
    int value = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size() || value < min) {
      return bad(std::string(name) + "='" + text + "' is not an integer >= " + std::to_string(min));
    }
    *out = value;
    return {};
  }

 private:
  void note(const char* name, const char* v) {
    if (!p_->vars.empty()) p_->vars += ' ';
    p_->vars += std::string(name) + "=" + v;
  }
  const EnvLookup& env_;
  Placement* p_;
};

// Ranks fit in their world, local ranks in their node, nodes in the job.
Status check_ranges(const Placement& p) {
  auto out = [&](const char* what, int v, const char* of, int n) {
    return bad(p.launcher + ": " + what + " " + std::to_string(v) + " is outside its " + of + " of " +
               std::to_string(n) + " (" + p.vars + ")");
  };
  if (p.world_size > 0 && p.rank >= p.world_size) return out("rank", p.rank, "world", p.world_size);
  if (p.local_world_size > 0 && p.local_rank >= p.local_world_size)
    return out("local rank", p.local_rank, "node's ranks", p.local_world_size);
  if (p.world_size > 0 && p.local_world_size > p.world_size)
    return out("local world size", p.local_world_size, "world", p.world_size);
  if (p.nnodes > 0 && p.node_rank >= p.nnodes) return out("node rank", p.node_rank, "nodes", p.nnodes);
  return {};
}

Result<std::optional<Placement>> read_torchrun(const EnvLookup& env) {
  Placement p;
  Reader r(env, &p);
  if (!r.has("RANK") && !r.has("WORLD_SIZE") && !r.has("LOCAL_RANK")) return std::optional<Placement>();
  const char* launcher = env("GRADSYNC_LAUNCHER");
  p.launcher = launcher != nullptr && std::string(launcher) == "gradsyncrun" ? "gradsyncrun" : "torchrun";
  // PyTorchJob without torchrun in the pod: RANK is the pod's index (kubeflow's envvar.go).
  if (!r.has("LOCAL_RANK") && r.has("PET_NPROC_PER_NODE")) p.launcher = "pytorchjob";
  if (Status s = r.integer("RANK", 0, &p.rank, true); !s.ok()) return s;
  if (Status s = r.integer("WORLD_SIZE", 1, &p.world_size, true); !s.ok()) return s;
  if (p.launcher == "pytorchjob") {
    int nproc = 0, nnodes = 0;
    if (Status s = r.integer("PET_NPROC_PER_NODE", 1, &nproc); !s.ok()) return s;
    if (Status s = r.integer("PET_NNODES", 1, &nnodes); !s.ok()) return s;
    if (nproc != 1) {  // no rank here; gradsyncrun still reads the pod's node variables
      p.not_a_rank = "PyTorchJob with nprocPerNode " + std::to_string(nproc) + " sets RANK to the pod's index (" +
                     p.vars + "), not a process rank: start the pod's ranks with torchrun or `gradsyncrun -n " +
                     std::to_string(nproc) + "`, which reads PET_NODE_RANK and PET_NNODES";
      p.rank = -1;
      p.world_size = 0;
      return std::optional<Placement>(p);
    }
    if (nnodes > 0 && nnodes != p.world_size)
      return bad("PyTorchJob: WORLD_SIZE must be PET_NNODES x PET_NPROC_PER_NODE (" + p.vars + ")");
    p.local_rank = 0;
    p.local_world_size = 1;
    p.node_rank = p.rank;
    p.nnodes = p.world_size;
  } else {
    if (Status s = r.integer("LOCAL_RANK", 0, &p.local_rank); !s.ok()) return s;
    if (Status s = r.integer("LOCAL_WORLD_SIZE", 1, &p.local_world_size); !s.ok()) return s;
    if (Status s = r.integer("GROUP_RANK", 0, &p.node_rank); !s.ok()) return s;
  }
  if (auto m = r.str("MASTER_ADDR")) p.master_addr = *m;
  if (Status s = check_ranges(p); !s.ok()) return s;
  return std::optional<Placement>(p);
}

Result<std::optional<Placement>> read_openmpi(const EnvLookup& env) {
  Placement p;
  p.launcher = "openmpi";
  Reader r(env, &p);
  if (!r.has("OMPI_COMM_WORLD_RANK") && !r.has("OMPI_COMM_WORLD_SIZE")) return std::optional<Placement>();
  if (Status s = r.integer("OMPI_COMM_WORLD_RANK", 0, &p.rank, true); !s.ok()) return s;
  if (Status s = r.integer("OMPI_COMM_WORLD_SIZE", 1, &p.world_size, true); !s.ok()) return s;
  if (Status s = r.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0, &p.local_rank, true); !s.ok()) return s;
  if (Status s = r.integer("OMPI_COMM_WORLD_LOCAL_SIZE", 1, &p.local_world_size, true); !s.ok()) return s;
  if (p.local_world_size == 1) {  // one rank per node (mpirun --map-by ppr:1:node): rank = node
    p.node_rank = p.rank;
    p.nnodes = p.world_size;
  }
  if (Status s = check_ranges(p); !s.ok()) return s;
  return std::optional<Placement>(p);
}

Result<std::optional<Placement>> read_slurm(const EnvLookup& env) {
  Placement p;
  p.launcher = "slurm";
  Reader r(env, &p);
  if (!r.has("SLURM_PROCID")) return std::optional<Placement>();
  if (Status s = r.integer("SLURM_PROCID", 0, &p.rank, true); !s.ok()) return s;
  const char* ntasks = r.has("SLURM_NTASKS") ? "SLURM_NTASKS" : "SLURM_NPROCS";
  if (Status s = r.integer(ntasks, 1, &p.world_size, true); !s.ok()) return s;
  if (Status s = r.integer("SLURM_LOCALID", 0, &p.local_rank, true); !s.ok()) return s;
  if (Status s = r.integer("SLURM_NODEID", 0, &p.node_rank, true); !s.ok()) return s;
  const char* nnodes = r.has("SLURM_STEP_NUM_NODES") ? "SLURM_STEP_NUM_NODES" : "SLURM_NNODES";
  if (Status s = r.integer(nnodes, 1, &p.nnodes, true); !s.ok()) return s;
  const char* per_node_var = r.has("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
  if (auto per_node = r.str(per_node_var)) {
    p.local_world_size = tasks_on_node(*per_node, p.node_rank);
    if (p.local_world_size < 1)
      return bad(std::string(per_node_var) + "='" + *per_node + "' has no task count for SLURM_NODEID " +
                 std::to_string(p.node_rank));
  } else if (p.world_size % p.nnodes == 0) {
    p.local_world_size = p.world_size / p.nnodes;
  } else {
    return bad("slurm: SLURM_STEP_TASKS_PER_NODE is not set and " + std::to_string(p.world_size) + " tasks do not " +
               "split evenly over " + std::to_string(p.nnodes) + " nodes (" + p.vars + ")");
  }
  const char* list = r.has("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
  if (auto hosts = r.str(list)) p.master_addr = first_host(*hosts);
  if (Status s = check_ranges(p); !s.ok()) return s;
  return std::optional<Placement>(p);
}

// A JobSet pod is a node; its indexes come from the downward API (the manifest names them).
Result<std::optional<Placement>> read_jobset(const EnvLookup& env) {
  Placement p;
  p.launcher = "jobset";
  Reader r(env, &p);
  if (!r.has("JOBSET_JOB_GLOBAL_INDEX")) return std::optional<Placement>();
  int job = 0, jobs = 0, pod = 0, pods = 1;
  if (Status s = r.integer("JOBSET_JOB_GLOBAL_INDEX", 0, &job, true); !s.ok()) return s;
  if (Status s = r.integer("JOBSET_GLOBAL_REPLICAS", 1, &jobs, true); !s.ok()) return s;
  if (Status s = r.integer("JOB_COMPLETION_INDEX", 0, &pod); !s.ok()) return s;
  if (Status s = r.integer("GRADSYNC_PODS_PER_JOB", 1, &pods); !s.ok()) return s;
  if (pod >= pods) return bad("jobset: JOB_COMPLETION_INDEX must be below GRADSYNC_PODS_PER_JOB (" + p.vars + ")");
  p.node_rank = job * pods + pod;
  p.nnodes = jobs * pods;
  if (Status s = check_ranges(p); !s.ok()) return s;
  return std::optional<Placement>(p);
}

// PyTorchJob's node variables, for gradsyncrun in a pod (torchrun's job in other pods).
Result<std::optional<Placement>> read_pytorchjob_node(const EnvLookup& env) {
  Placement p;
  p.launcher = "pytorchjob";
  Reader r(env, &p);
  if (!r.has("PET_NODE_RANK") && !r.has("PET_NNODES")) return std::optional<Placement>();
  if (Status s = r.integer("PET_NODE_RANK", 0, &p.node_rank, true); !s.ok()) return s;
  if (Status s = r.integer("PET_NNODES", 1, &p.nnodes, true); !s.ok()) {
    return bad(s.message() + " (an elastic range such as 1:4 is not supported: give a node count)");
  }
  if (auto m = r.str("MASTER_ADDR")) p.master_addr = *m;
  if (Status s = check_ranges(p); !s.ok()) return s;
  return std::optional<Placement>(p);
}

// Two views of one value disagree: the message names both launchers' variables.
Status conflict(const Placement& a, const Placement& b, const char* what, int va, int vb) {
  return bad("launcher variables disagree on the " + std::string(what) + ": " + a.launcher + " says " +
             std::to_string(va) + " (" + a.vars + "), " + b.launcher + " says " + std::to_string(vb) + " (" +
             b.vars + "); unset the stale ones or set GRADSYNC_LAUNCHER to the launcher to read");
}

Status agree(const Placement& a, const Placement& b) {
  struct Field { const char* name; int Placement::*m; int unset; };
  static const Field kFields[] = {{"rank", &Placement::rank, -1},
                                  {"world size", &Placement::world_size, 0},
                                  {"local rank", &Placement::local_rank, -1},
                                  {"local world size", &Placement::local_world_size, 0},
                                  {"node rank", &Placement::node_rank, -1},
                                  {"node count", &Placement::nnodes, 0}};
  for (const Field& f : kFields) {
    const int va = a.*f.m, vb = b.*f.m;
    if (va != f.unset && vb != f.unset && va != vb) return conflict(a, b, f.name, va, vb);
  }
  return {};
}

Result<std::optional<Placement>> read_named(const std::string& name, const EnvLookup& env) {
  if (name == "gradsyncrun" || name == "torchrun" || name == "pytorchjob") return read_torchrun(env);
  if (name == "openmpi") return read_openmpi(env);
  if (name == "slurm") return read_slurm(env);
  if (name == "jobset") return read_jobset(env);
  return bad("GRADSYNC_LAUNCHER='" + name + "' is not one of gradsyncrun, torchrun, pytorchjob, openmpi, slurm, jobset");
}

// The innermost launcher of `found` (first with `has`), checked against the others.
Result<Placement> choose(const std::vector<Placement>& found, bool (*has)(const Placement&), const char* what) {
  const Placement* chosen = nullptr;
  for (const Placement& p : found) {
    if (has(p)) {
      chosen = &p;
      break;
    }
  }
  if (chosen == nullptr) return Status(Code::kNotFound, std::string("no launcher variables give the ") + what);
  for (const Placement& p : found) {
    if (&p == chosen) continue;
    // A launcher with a world of another size started the chosen one: not this rank's view.
    if (p.world_size > 0 && chosen->world_size > 0 && p.world_size != chosen->world_size) continue;
    if (p.nnodes > 0 && chosen->nnodes > 0 && p.nnodes != chosen->nnodes && p.world_size == 0) continue;
    if (Status s = agree(*chosen, p); !s.ok()) return s;
  }
  return *chosen;
}

}  // namespace

EnvLookup process_env() {
  return [](const char* name) -> const char* { return std::getenv(name); };
}

Result<std::vector<Placement>> detect(const EnvLookup& env) {
  std::vector<Placement> found;
  if (const char* named = env("GRADSYNC_LAUNCHER"); named != nullptr && *named != '\0') {
    auto p = read_named(named, env);
    if (!p.ok()) return p.status();
    if (!p->has_value()) {
      return bad(std::string("GRADSYNC_LAUNCHER=") + named + " but none of that launcher's variables is set");
    }
    found.push_back(**p);
    return found;
  }
  // Innermost first: the precedence of rank_placement and node_placement.
  for (auto* read : {read_torchrun, read_openmpi, read_slurm, read_pytorchjob_node, read_jobset}) {
    auto p = read(env);
    if (!p.ok()) return p.status();
    if (p->has_value()) found.push_back(**p);
  }
  return found;
}

Result<Placement> rank_placement(const EnvLookup& env) {
  auto found = detect(env);
  if (!found.ok()) return found.status();
  auto p = choose(*found, [](const Placement& q) { return q.rank >= 0 && q.world_size > 0; },
                  "rank (RANK, SLURM_PROCID or OMPI_COMM_WORLD_RANK)");
  if (!p.ok()) {
    for (const Placement& q : *found) {
      if (!q.not_a_rank.empty()) return bad(q.not_a_rank);
    }
    return p.status();
  }
  if (p->local_rank < 0) p->local_rank = 0;
  if (p->local_world_size <= 0) p->local_world_size = 1;
  if (Status s = check_ranges(*p); !s.ok()) return s;
  return p;
}

Result<Placement> node_placement(const EnvLookup& env) {
  auto found = detect(env);
  if (!found.ok()) return found.status();
  auto p = choose(*found, [](const Placement& q) { return q.node_rank >= 0 && q.nnodes > 0; },
                  "node (SLURM_NODEID, PET_NODE_RANK or JOBSET_JOB_GLOBAL_INDEX)");
  if (!p.ok()) return p.status();
  if (p->local_world_size > 1) {
    return bad(p->launcher + " started " + std::to_string(p->local_world_size) + " tasks on this node (" + p->vars +
               "): each is a rank, so run the program itself under it, or start one gradsyncrun per node " +
               "(srun --ntasks-per-node=1, mpirun --map-by ppr:1:node)");
  }
  return p;
}

std::string first_host(const std::string& hostlist) {
  const size_t end = hostlist.find_first_of(",[");
  if (end == std::string::npos) return hostlist;
  if (hostlist[end] == ',') return hostlist.substr(0, end);
  const size_t close = hostlist.find(']', end);
  if (close == std::string::npos) return "";
  const std::string range = hostlist.substr(end + 1, close - end - 1);
  const std::string first = range.substr(0, range.find_first_of(",-"));
  if (first.empty()) return "";
  return hostlist.substr(0, end) + first;
}

int tasks_on_node(const std::string& tasks_per_node, int node) {
  int seen = 0;
  size_t pos = 0;
  while (pos < tasks_per_node.size() && node >= 0) {
    size_t next = tasks_per_node.find(',', pos);
    if (next == std::string::npos) next = tasks_per_node.size();
    const std::string item = tasks_per_node.substr(pos, next - pos);
    int count = 0, repeat = 1;
    const char* b = item.data();
    auto [end, ec] = std::from_chars(b, b + item.size(), count);
    if (ec != std::errc() || count < 1) return -1;
    const std::string rest(end, b + item.size());
    if (!rest.empty()) {
      if (rest.size() < 4 || rest.compare(0, 2, "(x") != 0 || rest.back() != ')') return -1;
      const std::string n = rest.substr(2, rest.size() - 3);
      auto [e2, ec2] = std::from_chars(n.data(), n.data() + n.size(), repeat);
      if (ec2 != std::errc() || e2 != n.data() + n.size() || repeat < 1) return -1;
    }
    if (node < seen + repeat) return count;
    seen += repeat;
    pos = next + 1;
  }
  return -1;
}

}  // namespace gradsync::launch
