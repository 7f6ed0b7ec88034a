// Elastic communicators: after a failure the survivors go on in a new communicator of the
// survivors (shrink), and at a step boundary the members admit replacement processes (grow),
// without restarting any process.
//
//   Status s = comm.allreduce(...);
//   if (!s.ok()) {                                   // e.g. kAborted: rank 3 was killed
//     auto next = gradsync::shrink(comm);            // every survivor calls it
//     if (!next.ok()) ...;                           // this rank was excluded, or no coordinator
//     comm = std::move(next).value();                // renumbered 0..n-1 in the old order
//     ...redo the step that failed...
//   }
//   // At a step boundary, on every member:
//   auto bigger = gradsync::grow(comm);              // admits a waiting newcomer
//   // In the replacement process:
//   auto comm = gradsync::join_newcomer(gradsync::JoinOptions::from_env());
//   // then every member of the grown communicator broadcasts the state (weights, step) to it.
//
// Each new communicator is a new generation of the job (generation() + 1). It runs as the
// coordinator job "JOB@GENERATION" with new channels, new shared memory and new rank sockets;
// leaving the old generation releases its channels here and in gradsyncd. The members of the
// new generation are agreed through the coordinator, never by luck:
//   - a member is every rank of the old generation that calls shrink() or grow();
//   - the set is fixed as soon as every old rank has called or is known to have failed (the
//     rank the job's abort named, e.g. a killed process), else when `wait` has passed since
//     the first call: a rank slower than that is left out, and its own call fails naming the
//     set it missed (it must then restart or join as a newcomer);
//   - every member gets the same set, ranks renumbered in the old order, newcomers last.
//
// Next to ncclCommShrink (NCCL 2.27): NCCL's caller passes the ranks to exclude and every
// remaining rank must pass the same list; here the coordinator decides from who calls, so
// survivors need not agree beforehand. ShrinkMode::kDefault is NCCL_SHRINK_DEFAULT (no
// collective may be queued or running on the communicator); ShrinkMode::kAbort is
// NCCL_SHRINK_ABORT (the job's collectives in flight are aborted first, on every rank).
// Neither shares resources with the parent (NCCL's shrinkShare): channels are always new.
// grow() plays the part of ncclCommGrow (NCCL 2.29).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "gradsync/gradsync.h"

namespace gradsync {

enum class ShrinkMode : uint8_t {
  // The communicator has nothing queued or running (else kFailedPrecondition): after a
  // collective failed, or between steps.
  kDefault = 0,
  // Aborts the job first (collectives in flight end with kAborted on every rank), naming no
  // culprit so that the others wait for this rank, then shrinks. (A rank that called
  // Communicator::abort() is named by it, and the others' shrink does not wait for it.)
  kAbort = 1,
};

struct ShrinkOptions {
  ShrinkMode mode = ShrinkMode::kDefault;
  // How long the coordinator waits, from the first member's call, for old ranks that neither
  // called nor are known to have failed.
  std::chrono::milliseconds wait{5'000};
};

struct GrowOptions {
  // Newcomers (join_newcomer) to admit; the set is fixed once this many wait and every member
  // called, or at `wait` with those there (possibly none: then only the generation changes).
  int newcomers = 1;
  std::chrono::milliseconds wait{30'000};
};

// Every survivor calls it on its old communicator, which it leaves (later calls on it return
// kFailedPrecondition). Returns the communicator of the next generation.
Result<Communicator> shrink(Communicator& comm, const ShrinkOptions& options = {});

// Every member calls it at the same step boundary; the old communicator is left once the new
// set is fixed (if the coordinator cannot be reached it stays usable).
Result<Communicator> grow(Communicator& comm, const GrowOptions& options = {});

// A process that joins a running job at its members' next grow(): options.job and .token
// name the job (the base id, as first joined), .join_timeout bounds the wait for a grow, and
// rank / world size are ignored (the coordinator assigns them: after the members). The
// daemon socket as for Session::connect: `socket_path`, else $GRADSYNC_DAEMON, else the
// default.
Result<Communicator> join_newcomer(const JoinOptions& options, const std::string& socket_path = "");

}  // namespace gradsync
