// What every attack test of docs/security.md checks besides the attack itself: a job that
// runs on the same daemons while the attack goes on is unaffected (it completes with exact
// results afterwards), and the daemons still serve a new job.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cluster.h"

namespace gradsync::testing {

// A job of one rank per daemon, joined and inside (rank 0) or just before (the others) a
// 1-element allreduce until finish() closes their stdin.
class Bystander {
 public:
  Bystander(Cluster& c, const std::string& job) : c_(c) {
    JobSpec spec;
    spec.job = job;
    spec.world = c.num_daemons();
    spec.ranks_per_daemon.assign(c.num_daemons(), 1);
    spec.args = {"idle"};
    spec.stdin_pipe = true;
    ranks_ = c.spawn_ranks(spec);
  }

  // Whether every rank joined within 30 s.
  ::testing::AssertionResult joined() {
    for (auto& r : ranks_) {
      if (!r.wait_for_output("JOINED", Millis(30'000))) {
        return ::testing::AssertionFailure() << r.name() << " of the bystander job never joined" << c_.report(ranks_);
      }
    }
    return ::testing::AssertionSuccess();
  }

  // Lets the job finish; it must pass on every rank.
  ::testing::AssertionResult finish() {
    for (auto& r : ranks_) r.close_stdin();
    std::string problems = all_succeeded(ranks_, Millis(30'000));
    if (!problems.empty()) {
      return ::testing::AssertionFailure() << "the bystander job was disturbed: " << problems << c_.report(ranks_);
    }
    return ::testing::AssertionSuccess();
  }

 private:
  Cluster& c_;
  std::vector<Process> ranks_;
};

// The daemons are alive and run a fresh job of two ranks per daemon with exact results.
inline ::testing::AssertionResult serves_new_job(Cluster& c, const std::string& job) {
  for (int d = 0; d < c.num_daemons(); ++d) {
    if (!c.daemon(d).alive()) return ::testing::AssertionFailure() << "gradsyncd " << d << " died" << c.report();
  }
  auto ranks = c.spawn_ranks(job, 2 * c.num_daemons(), 2, {"check", "0,1,1000"});
  std::string problems = all_succeeded(ranks, Millis(60'000));
  if (!problems.empty()) {
    return ::testing::AssertionFailure() << "a new job failed after the attack: " << problems << c.report(ranks);
  }
  return ::testing::AssertionSuccess();
}

}  // namespace gradsync::testing
