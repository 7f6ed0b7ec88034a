// What the library's own files (gpu/timeline, client/elastic.cc) may reach inside a
// Communicator or Session; not installed.
#pragma once

#include <cstdint>
#include <string>

#include "client/daemon_client.h"
#include "gradsync/gradsync.h"

namespace gradsync {

class CommunicatorImpl;

// Where a communicator sits in an elastic job (gradsync/elastic.h): the job id its
// generations derive from (generation g > 1 after a regroup runs as "BASE@g").
struct Lineage {
  std::string base_job;
  uint64_t generation = 0;
};

struct CommunicatorInternals {
  static CommunicatorImpl* impl(Communicator& c) { return c.impl_.get(); }

  // A communicator's state as elastic.cc needs it.
  struct State {
    JoinOptions options;     // as joined (rank, world size of its generation)
    std::string socket_path; // its daemon
    Lineage lineage;
    int culprit = -1;        // the rank the job's abort named, -1 none or not known
    bool idle = true;        // no collective queued or running
    bool aborted = false;    // the job was aborted (or its daemon lost)
    bool left = false;
  };
  static Result<State> state(Communicator& c);
  // Aborts the job on every rank without naming a culprit (ShrinkMode::kAbort).
  static Status abort_unnamed(Communicator& c, const std::string& reason);

  // Joins on an attached daemon connection: Session::join (lineage {job, its generation},
  // calibrating the cost model) and elastic.cc's next generations (no calibration: the new
  // generation is ready as soon as its channels are).
  static Result<Communicator> join(DaemonClient daemon, const JoinOptions& o, const Lineage* lineage);
};

}  // namespace gradsync
