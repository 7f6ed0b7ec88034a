// Attack 6 of docs/security.md: a trainer turns on its own daemon through the job's shared
// memory. It cannot resize the region (sealed), and a slot claiming more bytes than a slot
// holds fails its own job naming it, while another job on the same daemons runs on and the
// daemons serve a new job afterwards. The daemons pump TCP channels themselves
// (--proxy-tcp): that is where a daemon reads a trainer's slot metadata.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "bystander.h"
#include "cluster.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

ClusterOptions pumping_daemons() { return {.daemons = 2, .daemon_args = {"--proxy-tcp"}}; }

// A one-rank job on daemon 0 whose trainer runs `hostile_trainer MODE`.
Process start_hostile(Cluster& c, const std::string& job, const std::string& mode, int world) {
  JobSpec spec;
  spec.job = job;
  spec.world = world;
  Env env = c.rank_env(spec, 0, 0, 0, 1);
  return c.spawn("hostile " + mode, {binary("hostile_trainer"), mode}, env, /*stdin_pipe=*/true);
}

class ResizeAttack : public ::testing::TestWithParam<const char*> {};

TEST_P(ResizeAttack, IsRefusedAndOnlyItsJobEnds) {
  const std::string mode = GetParam();
  Cluster c(pumping_daemons());
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  Bystander bystander(c, "bystander-" + mode);
  ASSERT_TRUE(bystander.joined());

  Process hostile = start_hostile(c, "hostile-" + mode, mode, 1);
  const std::string upper = mode == "shrink" ? "SHRINK" : "GROW";
  ASSERT_TRUE(hostile.wait_for_output(upper + "-", 30s)) << c.report({&hostile});
  EXPECT_NE(hostile.output().find(upper + "-REFUSED: Operation not permitted"), std::string::npos)
      << "the trainer resized the job's memory" << c.report({&hostile});
  // It leaves without a word: the daemon ends its job (touching the whole region) and lives.
  hostile.close_stdin();
  ASSERT_TRUE(hostile.wait_for_exit(10s).has_value());
  ASSERT_TRUE(c.daemon(0).wait_for_output("job=hostile-" + mode + " gen=1 torn down", 10s)) << c.report({&hostile});
  EXPECT_TRUE(c.daemon(0).alive()) << c.report({&hostile});

  EXPECT_TRUE(bystander.finish());
  EXPECT_TRUE(serves_new_job(c, "after-" + mode));
}

INSTANTIATE_TEST_SUITE_P(Region, ResizeAttack, ::testing::Values("shrink", "grow"));

TEST(SlotAttack, OversizedSlotFailsOnlyItsJobNamingTheRank) {
  Cluster c(pumping_daemons());
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  Bystander bystander(c, "bystander-slot");
  ASSERT_TRUE(bystander.joined());

  // Job "hostile-slot": rank 0 (hostile) on daemon 0, rank 1 (an honest trainer) on daemon 1.
  JobSpec spec;
  spec.job = "hostile-slot";
  spec.world = 2;
  Process hostile = start_hostile(c, spec.job, "bigslot", 2);
  Env env = c.rank_env(spec, 1, 1, 0, 1);
  env["GRADSYNC_TUNE"] = "0";  // its first collective is the checked one
  Process honest = c.spawn("honest rank 1", {binary("allreduce_worker"), "check", "1000"}, env);
  std::vector<const Process*> both = {&hostile, &honest};
  ASSERT_TRUE(honest.wait_for_output("JOINED", 30s)) << c.report(both);
  hostile.close_stdin();  // now it publishes
  ASSERT_TRUE(hostile.wait_for_output("ABORTED: ", 30s)) << c.report(both);
  const std::string reason = line_with(hostile.output(), "ABORTED: ");
  EXPECT_NE(reason.find("rank 0 (pid " + std::to_string(hostile.pid())), std::string::npos) << reason;
  EXPECT_NE(reason.find("published a slot of 2147483648 bytes"), std::string::npos) << reason;
  // Refused and logged by the daemon that read the slot.
  EXPECT_NE(c.daemon(0).output().find("published a slot of 2147483648 bytes"), std::string::npos) << c.report(both);

  // The honest rank's job fails with the same named error.
  auto st = honest.wait_for_exit(30s);
  ASSERT_TRUE(st.has_value()) << c.report(both);
  EXPECT_NE(st->code, 0);
  const std::string failed = line_with(honest.output(), "failed");
  EXPECT_NE(failed.find("ABORTED"), std::string::npos) << failed << c.report(both);
  EXPECT_NE(failed.find("rank 0 (pid"), std::string::npos) << failed << c.report(both);
  EXPECT_NE(failed.find("published a slot"), std::string::npos) << failed << c.report(both);
  hostile.wait_for_exit(10s);

  EXPECT_TRUE(c.daemon(0).alive()) << c.report(both);
  EXPECT_TRUE(bystander.finish());
  EXPECT_TRUE(serves_new_job(c, "after-slot"));
}

}  // namespace
}  // namespace gradsync::testing
