// Where a rank or a node sits in a job, read from the variables of the launcher that started
// it: gradsyncrun and torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR), Slurm's srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID,
// SLURM_NNODES, SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NODELIST), Open MPI's mpirun
// (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE), Kubeflow's PyTorchJob (RANK,
// WORLD_SIZE, MASTER_ADDR, PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE) and a JobSet's
// indexes passed through the downward API (JOBSET_JOB_GLOBAL_INDEX, JOBSET_GLOBAL_REPLICAS,
// JOB_COMPLETION_INDEX, GRADSYNC_PODS_PER_JOB; deploy/kubernetes/jobset-example.yaml).
//
// Precedence (docs/launchers.md):
// 1. GRADSYNC_LAUNCHER=NAME reads only that launcher's variables (gradsyncrun sets it to
//    "gradsyncrun" for the ranks it starts, whatever launched gradsyncrun itself).
// 2. Otherwise the innermost launcher present wins: torchrun/gradsyncrun, then Open MPI, then
//    Slurm. Every other launcher present that describes a world of the same size must agree
//    with it on every value both give, else the result is kInvalidArgument naming both
//    variables. One with a world of another size started the inner launcher (srun torchrun,
//    mpirun inside an allocation) and is not read.
// Values that are not integers, or that contradict each other (a rank outside its world), are
// errors naming the variable, never a guess.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "gradsync/status.h"

namespace gradsync::launch {

// Looks a variable up; nullptr when it is not set. std::getenv, or a table in tests.
using EnvLookup = std::function<const char*(const char*)>;
EnvLookup process_env();

// One launcher's view. -1 / 0: that launcher does not say.
struct Placement {
  std::string launcher;      // "gradsyncrun", "torchrun", "slurm", "openmpi", "pytorchjob", "jobset"
  int rank = -1;
  int world_size = 0;
  int local_rank = -1;
  int local_world_size = 0;
  int node_rank = -1;
  int nnodes = 0;
  std::string master_addr;   // MASTER_ADDR, or the first host of SLURM_STEP_NODELIST
  std::string vars;          // the variables it was read from, for messages: "SLURM_PROCID=3 ..."
  std::string not_a_rank;    // set when the variables look like a rank's but are not (PyTorchJob)
};

// Every launcher whose variables are present (an error for any that is malformed).
Result<std::vector<Placement>> detect(const EnvLookup& env);

// The rank's placement for JoinOptions::from_env(): rank and world size known, local rank and
// local world size filled (0 and 1 when no launcher says). kNotFound when no launcher is
// present; kInvalidArgument on a conflict or a malformed value.
Result<Placement> rank_placement(const EnvLookup& env);

// The node's placement for gradsyncrun: node_rank and nnodes, from a launcher that started
// one gradsyncrun per node (srun --ntasks-per-node=1, mpirun --map-by ppr:1:node, a
// PyTorchJob or JobSet pod). kNotFound when none says; kInvalidArgument on a conflict, or
// when the launcher started several tasks on this node (then each task is a rank: run the
// program under the launcher without gradsyncrun).
Result<Placement> node_placement(const EnvLookup& env);

// The first host of a Slurm hostlist ("gpu[03-05,09],cpu1" -> "gpu03"); empty if malformed.
std::string first_host(const std::string& hostlist);
// Tasks on node `node` of a Slurm tasks-per-node list ("4(x2),3" -> 4, 4, 3); -1 if malformed
// or out of range.
int tasks_on_node(const std::string& tasks_per_node, int node);

}  // namespace gradsync::launch
