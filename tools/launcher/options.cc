#include "launcher/options.h"

#include "common/fd.h"
#include "common/launch_env.h"
#include "common/secret.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdlib>

namespace gradsync::launcher {
namespace {

constexpr int kUsageExit = 2;                       // like getopt-based tools: bad command line
constexpr double kMaxTimeoutS = 365.0 * 24 * 3600;  // keeps the deadline arithmetic finite

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : fallback;
}

bool parse_int(const std::string& text, int min, int* out) {
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < min) return false;
  *out = value;
  return true;
}

ParseOutcome fail(const std::string& message) {
  return {std::nullopt, "gradsyncrun: " + message + "\n" + usage(), kUsageExit};
}

// Fills defaults that depend on the mode and checks that the flags fit together.
// --nnodes and --node-rank from the launcher that started this gradsyncrun (one per node:
// srun --ntasks-per-node=1, mpirun --map-by ppr:1:node, a PyTorchJob or JobSet pod). Flags
// that contradict the launcher are an error.
ParseOutcome take_node_placement(Options& o, bool nnodes_given, bool node_rank_given) {
  auto placed = launch::node_placement(launch::process_env());
  if (!placed.ok()) {
    if (placed.status().code() == Code::kNotFound) return {std::nullopt, "", 0};
    return fail(placed.status().message());
  }
  if ((nnodes_given && o.nnodes != placed->nnodes) || (node_rank_given && o.node_rank != placed->node_rank)) {
    return fail("--nnodes " + std::to_string(o.nnodes) + " --node-rank " + std::to_string(o.node_rank) +
                " contradict the " + placed->launcher + " variables (" + placed->vars + "): node " +
                std::to_string(placed->node_rank) + " of " + std::to_string(placed->nnodes) +
                "; drop the flags or set GRADSYNC_LAUNCHER");
  }
  o.nnodes = placed->nnodes;
  o.node_rank = placed->node_rank;
  o.launcher = placed->launcher;
  return {std::nullopt, "", 0};
}

ParseOutcome finish(Options o, bool nnodes_given, bool node_rank_given) {
  if (o.program.empty()) return fail("missing PROGRAM");
  if (o.standalone) {
    if (!o.coordinator.empty())
      return fail("--standalone starts its own coordinator; drop --coordinator");
    if (!o.daemon_socket.empty()) return fail("--standalone starts its own daemon; drop --daemon");
    if (o.start_daemon) return fail("--standalone starts its own daemon; drop --start-daemon");
    if (o.nnodes != 1 || o.node_rank != 0)
      return fail("--standalone runs one node: --nnodes 1 --node-rank 0");
    if (o.job_id.empty()) o.job_id = env_or("GRADSYNC_JOB_ID", "");
    if (o.job_id.empty()) {
      auto suffix = random_token();
      o.job_id = "job-" + std::to_string(getpid()) + "-" + (suffix.ok() ? suffix->substr(0, 8) : "0");
    }
    auto token = token_from(o.token_file);
    if (!token.ok()) return fail(token.status().message());
    o.token = *token;
    if (o.token.empty()) {
      auto random = random_token();
      if (!random.ok()) return {std::nullopt, "gradsyncrun: " + random.status().message() + "\n", 1};
      o.token = *random;
    }
  } else {
    if (auto placed = take_node_placement(o, nnodes_given, node_rank_given); !placed.message.empty()) return placed;
    if (o.coordinator.empty()) o.coordinator = env_or("GRADSYNC_COORDINATOR", "");
    if (o.start_daemon && !o.daemon_socket.empty()) return fail("--start-daemon and --daemon exclude each other");
    if (o.start_daemon && o.coordinator.empty())
      return fail("--start-daemon needs --coordinator HOST:PORT (or $GRADSYNC_COORDINATOR)");
    if (o.node_rank >= o.nnodes) return fail("--node-rank must be below --nnodes");
    if (o.job_id.empty()) o.job_id = env_or("GRADSYNC_JOB_ID", "");
    if (o.job_id.empty())
      return fail("a job on the nodes' daemons needs --job-id (or $GRADSYNC_JOB_ID), the same on every node");
    auto token = token_from(o.token_file);
    if (!token.ok()) return fail(token.status().message());
    o.token = *token;
    if (o.token.empty()) {
      return fail("a multi-node job needs a job token, the same on every node: --token-file PATH "
                  "or $GRADSYNC_JOB_TOKEN (without one anyone could join the job)");
    }
  }
  if (o.node_name.empty()) o.node_name = gradsync::hostname();
  return {std::move(o), "", 0};
}

}  // namespace

std::string usage() {
  return R"(usage: gradsyncrun [options] PROGRAM [ARGS...]

Runs PROGRAM once per local rank with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GRADSYNC_DAEMON, GRADSYNC_JOB_ID, GRADSYNC_JOB_TOKEN, GRADSYNC_COORDINATOR and
GRADSYNC_LAUNCHER=gradsyncrun set. Without --standalone or --start-daemon the ranks use the
node's running gradsyncd: --daemon SOCKET, else $GRADSYNC_DAEMON, else the first socket found
of /run/gradsync/gradsyncd.sock (gradsyncd.service), $XDG_RUNTIME_DIR/gradsync/gradsyncd.sock,
/tmp/gradsync-UID/gradsyncd.sock. Under srun --ntasks-per-node=1, mpirun --map-by
ppr:1:node, a PyTorchJob (PET_NODE_RANK, PET_NNODES) or a JobSet (JOBSET_JOB_GLOBAL_INDEX...),
--nnodes and --node-rank default to the launcher's (docs/launchers.md).

  --standalone              start a coordinator and a daemon for a one-node job
  -n, --nproc-per-node N    ranks on this node (default 1)
  --coordinator HOST:PORT   the coordinator (default $GRADSYNC_COORDINATOR); needed with
                            --start-daemon, else passed to the ranks only
  --nnodes M                nodes in the job (default 1, or the launcher's)
  --node-rank I             this node's index, 0..M-1 (default 0, or the launcher's)
  --daemon SOCKET           the running gradsyncd to use
  --start-daemon            start a gradsyncd for this job (a node without the service)
  --job-id ID               job name (default $GRADSYNC_JOB_ID; generated in standalone)
  --token-file PATH         job token: the file's first line (default $GRADSYNC_JOB_TOKEN;
                            random in standalone; a multi-node job must have one). Never
                            on the command line, where every user's `ps` shows it
  --node-name NAME          name of this node (default: hostname)
  --tls-ca F, --tls-cert F, --tls-key F, --insecure
                            the started gradsyncd's TLS to the coordinator (also
                            $GRADSYNC_TLS_CA, _CERT, _KEY, $GRADSYNC_INSECURE=1)
  --cluster-secret-file F   the started gradsyncd's credential to the coordinator (default
                            $GRADSYNC_CLUSTER_SECRET; made up in standalone)
  --log-level L             trace|debug|info|warn|error|off, for the launcher and children
  --timeout-s S             stop everything after S seconds and exit 124
  --no-prefix               do not prefix rank output with "[rank R] "
  --replace-failed N        elastic jobs: start a replacement for a rank process that dies
                            (at most N in all), with GRADSYNC_REPLACEMENT=1; the survivors
                            admit it at their next grow (gradsync/elastic.h)
  -h, --help                this text
)";
}

ParseOutcome parse_options(int argc, char** argv) {
  Options o;
  bool nnodes_given = false, node_rank_given = false;
  int i = 1;
  // Value of "--flag V" or "--flag=V"; nullopt when missing.
  auto value_of = [&](const std::string& arg,
                      const std::string& flag) -> std::optional<std::string> {
    if (arg.size() > flag.size() && arg.compare(0, flag.size() + 1, flag + "=") == 0) {
      return arg.substr(flag.size() + 1);
    }
    if (i + 1 >= argc) return std::nullopt;
    return std::string(argv[++i]);
  };
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.empty() || arg[0] != '-') break;  // PROGRAM: everything after it is its own
    if (arg == "-h" || arg == "--help") return {std::nullopt, usage(), 0};
    if (arg == "--standalone") {
      o.standalone = true;
      continue;
    }
    if (arg == "--start-daemon") {
      o.start_daemon = true;
      continue;
    }
    if (arg == "--no-prefix") {
      o.no_prefix = true;
      continue;
    }
    if (arg == "--insecure") {
      o.daemon_tls_flags.push_back(arg);
      continue;
    }

    const std::string flag = arg.substr(0, arg.find('='));
    if (flag == "--token") {
      return fail("--token is gone: a token in argv is visible to every user through ps; "
                  "use --token-file PATH or $GRADSYNC_JOB_TOKEN");
    }
    static const char* kValueFlags[] = {
        "-n",       "--nproc-per-node", "--coordinator", "--nnodes",    "--node-rank", "--daemon",
        "--job-id", "--token-file",     "--node-name",   "--log-level", "--timeout-s",
        "--tls-cert", "--tls-key",      "--tls-ca",      "--cluster-secret-file", "--replace-failed"};
    bool known = false;
    for (const char* f : kValueFlags) known = known || flag == f;
    if (!known) return fail("unknown option " + arg);
    const auto value = value_of(arg, flag);
    if (!value) return fail(flag + " needs a value");

    if (flag == "-n" || flag == "--nproc-per-node") {
      if (!parse_int(*value, 1, &o.nproc_per_node)) return fail(flag + " needs an integer >= 1");
    } else if (flag == "--nnodes") {
      if (!parse_int(*value, 1, &o.nnodes)) return fail("--nnodes needs an integer >= 1");
      nnodes_given = true;
    } else if (flag == "--node-rank") {
      if (!parse_int(*value, 0, &o.node_rank)) return fail("--node-rank needs an integer >= 0");
      node_rank_given = true;
    } else if (flag == "--timeout-s") {
      char* end = nullptr;
      const double s = std::strtod(value->c_str(), &end);
      if (value->empty() || *end != '\0' || !(s > 0)) return fail("--timeout-s needs seconds > 0");
      o.timeout_s = std::min(s, kMaxTimeoutS);
    } else if (flag == "--replace-failed") {
      if (!parse_int(*value, 0, &o.replace_failed)) return fail("--replace-failed needs an integer >= 0");
    } else if (flag == "--coordinator") {
      o.coordinator = *value;
    } else if (flag == "--daemon") {
      o.daemon_socket = *value;
    } else if (flag == "--job-id") {
      o.job_id = *value;
    } else if (flag == "--token-file") {
      o.token_file = *value;
    } else if (flag == "--tls-cert" || flag == "--tls-key" || flag == "--tls-ca" || flag == "--cluster-secret-file") {
      o.daemon_tls_flags.insert(o.daemon_tls_flags.end(), {flag, *value});
    } else if (flag == "--node-name") {
      o.node_name = *value;
    } else if (flag == "--log-level") {
      static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
      if (std::find(std::begin(kLevels), std::end(kLevels), *value) == std::end(kLevels)) {
        return fail("--log-level must be one of trace|debug|info|warn|error|critical|off");
      }
      o.log_level = *value;
    }
  }
  for (; i < argc; ++i) o.program.emplace_back(argv[i]);
  return finish(std::move(o), nnodes_given, node_rank_given);
}

}  // namespace gradsync::launcher
