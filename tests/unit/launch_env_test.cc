// common/launch_env: every launcher's variables, the precedence between them, and the errors
// for conflicting or malformed ones.
#include "common/launch_env.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace gradsync::launch {
namespace {

using Vars = std::map<std::string, std::string>;

EnvLookup table(const Vars& vars) {
  return [&vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

void expect_rank(const Vars& vars, const std::string& launcher, int rank, int world, int local, int local_world) {
  auto p = rank_placement(table(vars));
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->launcher, launcher);
  EXPECT_EQ(p->rank, rank);
  EXPECT_EQ(p->world_size, world);
  EXPECT_EQ(p->local_rank, local);
  EXPECT_EQ(p->local_world_size, local_world);
}

std::string rank_error(const Vars& vars) {
  auto p = rank_placement(table(vars));
  EXPECT_FALSE(p.ok()) << "accepted as rank " << p->rank << " of " << p->world_size;
  return p.ok() ? "" : p.status().message();
}

TEST(LaunchEnv, Torchrun) {
  expect_rank({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
               {"GROUP_RANK", "1"}, {"MASTER_ADDR", "n0"}},
              "torchrun", 5, 8, 1, 4);
  // What gradsyncrun sets, without local variables: one rank per node as before.
  expect_rank({{"RANK", "2"}, {"WORLD_SIZE", "4"}}, "torchrun", 2, 4, 0, 1);
}

TEST(LaunchEnv, Slurm) {
  const Vars srun = {{"SLURM_PROCID", "6"},     {"SLURM_NTASKS", "8"},
                     {"SLURM_LOCALID", "2"},    {"SLURM_NODEID", "1"},
                     {"SLURM_NNODES", "2"},     {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"},
                     {"SLURM_STEP_NODELIST", "gpu[03-04]"}};
  expect_rank(srun, "slurm", 6, 8, 2, 4);
  EXPECT_EQ(rank_placement(table(srun))->master_addr, "gpu03");
  // Uneven tasks per node: node 1 of "3,1" has one task.
  expect_rank({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "1"},
               {"SLURM_NNODES", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "3,1"}},
              "slurm", 3, 4, 0, 1);
}

TEST(LaunchEnv, OpenMpi) {
  expect_rank({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
               {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}},
              "openmpi", 3, 4, 3, 4);
}

TEST(LaunchEnv, PyTorchJobOneProcessPerPod) {
  expect_rank({{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"PET_NPROC_PER_NODE", "1"}, {"PET_NNODES", "3"},
               {"PET_NODE_RANK", "1"}, {"MASTER_ADDR", "job-master-0"}},
              "pytorchjob", 1, 3, 0, 1);
  // nprocPerNode > 1 without torchrun: RANK is the pod's index, not a rank.
  const std::string e = rank_error({{"RANK", "1"}, {"WORLD_SIZE", "8"}, {"PET_NPROC_PER_NODE", "4"},
                                    {"PET_NNODES", "2"}, {"PET_NODE_RANK", "1"}});
  EXPECT_NE(e.find("pod's index"), std::string::npos) << e;
  EXPECT_NE(e.find("gradsyncrun -n 4"), std::string::npos) << e;
}

TEST(LaunchEnv, InnerLauncherWinsOverTheOneThatStartedIt) {
  // srun -N2 --ntasks-per-node=1 torchrun --nproc-per-node 4: Slurm's task is torchrun.
  expect_rank({{"RANK", "6"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "4"},
               {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "1"},
               {"SLURM_NNODES", "2"}},
              "torchrun", 6, 8, 2, 4);
}

TEST(LaunchEnv, SameWorldMustAgree) {
  const std::string e = rank_error({{"RANK", "2"}, {"WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "1"},
                                    {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_NE(e.find("disagree on the rank"), std::string::npos) << e;
  EXPECT_NE(e.find("RANK=2"), std::string::npos) << e;
  EXPECT_NE(e.find("OMPI_COMM_WORLD_RANK=1"), std::string::npos) << e;
  // Agreeing views of one world are fine.
  expect_rank({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"},
               {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "0"}, {"SLURM_NNODES", "1"}},
              "torchrun", 1, 4, 0, 1);
}

TEST(LaunchEnv, GradsyncLauncherSelectsOne) {
  // gradsyncrun's ranks inside an srun step: only RANK... is read.
  expect_rank({{"GRADSYNC_LAUNCHER", "gradsyncrun"}, {"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"},
               {"LOCAL_WORLD_SIZE", "4"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"},
               {"SLURM_NODEID", "0"}, {"SLURM_NNODES", "1"}},
              "gradsyncrun", 3, 4, 3, 4);
  EXPECT_NE(rank_error({{"GRADSYNC_LAUNCHER", "pbs"}}).find("not one of"), std::string::npos);
  EXPECT_NE(rank_error({{"GRADSYNC_LAUNCHER", "slurm"}, {"RANK", "0"}, {"WORLD_SIZE", "1"}}).find("none of"),
            std::string::npos);
}

TEST(LaunchEnv, MalformedAndInconsistentValues) {
  EXPECT_NE(rank_error({{"RANK", "x"}, {"WORLD_SIZE", "4"}}).find("RANK='x'"), std::string::npos);
  EXPECT_NE(rank_error({{"RANK", "4"}, {"WORLD_SIZE", "4"}}).find("outside"), std::string::npos);
  EXPECT_NE(rank_error({{"RANK", "0"}}).find("WORLD_SIZE is not set"), std::string::npos);
  EXPECT_NE(rank_error({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "0"},
                        {"SLURM_NNODES", "1"}})
                .find("outside its world"),
            std::string::npos);
  EXPECT_NE(rank_error({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "3"}, {"SLURM_NODEID", "1"},
                        {"SLURM_NNODES", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}})
                .find("local rank 3"),
            std::string::npos);
  EXPECT_NE(rank_error({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}).find("LOCAL_RANK is not set"),
            std::string::npos);
  auto none = rank_placement(table({}));
  EXPECT_EQ(none.status().code(), Code::kNotFound);
}

TEST(LaunchEnv, NodePlacementForGradsyncrun) {
  auto slurm = node_placement(table({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                                     {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"}}));
  ASSERT_TRUE(slurm.ok()) << slurm.status().to_string();
  EXPECT_EQ(slurm->node_rank, 1);
  EXPECT_EQ(slurm->nnodes, 2);
  auto jobset = node_placement(table({{"JOBSET_JOB_GLOBAL_INDEX", "2"}, {"JOBSET_GLOBAL_REPLICAS", "3"},
                                      {"JOB_COMPLETION_INDEX", "1"}, {"GRADSYNC_PODS_PER_JOB", "2"}}));
  ASSERT_TRUE(jobset.ok()) << jobset.status().to_string();
  EXPECT_EQ(jobset->node_rank, 5);
  EXPECT_EQ(jobset->nnodes, 6);
  auto pytorchjob = node_placement(table({{"PET_NODE_RANK", "1"}, {"PET_NNODES", "2"}, {"PET_NPROC_PER_NODE", "4"},
                                          {"RANK", "1"}, {"WORLD_SIZE", "8"}}));
  ASSERT_TRUE(pytorchjob.ok()) << pytorchjob.status().to_string();
  EXPECT_EQ(pytorchjob->node_rank, 1);
  // srun -n 4 on one node: each task is a rank, gradsyncrun would start 4 x N ranks.
  auto many = node_placement(table({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                                    {"SLURM_NODEID", "0"}, {"SLURM_NNODES", "1"}}));
  ASSERT_FALSE(many.ok());
  EXPECT_NE(many.status().message().find("ntasks-per-node=1"), std::string::npos) << many.status().message();
  EXPECT_EQ(node_placement(table({{"RANK", "0"}, {"WORLD_SIZE", "2"}})).status().code(), Code::kNotFound);
}

TEST(LaunchEnv, SlurmLists) {
  EXPECT_EQ(first_host("gpu[03-05,09],cpu1"), "gpu03");
  EXPECT_EQ(first_host("a1,a2"), "a1");
  EXPECT_EQ(first_host("solo"), "solo");
  EXPECT_EQ(first_host("bad[1-2"), "");
  EXPECT_EQ(tasks_on_node("4(x2),3", 0), 4);
  EXPECT_EQ(tasks_on_node("4(x2),3", 1), 4);
  EXPECT_EQ(tasks_on_node("4(x2),3", 2), 3);
  EXPECT_EQ(tasks_on_node("4(x2),3", 3), -1);
  EXPECT_EQ(tasks_on_node("4(y2)", 0), -1);
  EXPECT_EQ(tasks_on_node("", 0), -1);
}

}  // namespace
}  // namespace gradsync::launch
