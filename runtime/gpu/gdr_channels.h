// The RDMA path of the GPU communicator (docs/architecture.md, the GPU paths): the planning
// layer's channels (gpu/plan: a ring, and the two trees of a double binary tree with a chain
// per node) over queue pairs to each peer on another node and CUDA IPC to each peer on this
// one (GdrConfig::direct), and the plan's primitive steps run on the caller's stream. The NIC writes each message straight from a send slot in one rank's GPU memory into
// a receive slot in the peer's GPU memory, and the kernels on the stream read the slots there:
// no byte of the payload passes through host memory. A rank whose GPU memory the NIC cannot
// reach keeps its links with its slots in pinned host memory instead (gpu_slots() below).
//
// The set-up, messages, credits and checks are gpu/gdr_link.h's (the transport half,
// CUDA-free, tested on the CPU); the steps are gpu/plan/schedule.h's, turned into waits,
// copies, reductions and signals by gpu/step_runner.h (also CUDA-free and tested on the CPU).
// This file is the GPU half: the slots in GPU memory registered by dma-buf (else peermem), the
// words in mapped pinned memory, and the stream's operations as kernels: wait kernels on
// `arrived` and `send_free`, copy and reduction kernels, signal kernels for `ready` and
// `consumed`. Every wait has the op timeout; a link failure sets the communicator's abort
// word, so the stream's waits end.
//
// Built with CUDA and the verbs headers (GRADSYNC_HAVE_GDR).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/collective.h"
#include "gpu/device_comm.h"
#include "gpu/gdr_link.h"
#include "gpu/plan/channels.h"
#include "gpu/plan/cost_model.h"
#include "gpu/plan/schedule.h"
#include "gpu/step_table_cache.h"
#include "kernels/cuda_node.cuh"

namespace gradsync {

struct GdrConfig {
  GdrLinkConfig link;  // rank, hosts, RDMA device, slots, op timeout (gpu/gdr_link.h); the
                       // peers are filled in from the channels
  // Every world rank's node (a grouping key: the coordinator's node numbering); empty: the
  // hosts of link.hosts (several daemons on one machine are then one node).
  std::vector<std::string> nodes;
  int device = 0;      // the CUDA device
  // The most blocks of a step kernel (kernels/cuda_step.cuh): every block of every rank on
  // this GPU must be resident at once, so ranks that share a GPU share its multiprocessors.
  unsigned max_blocks = 32;
  uint32_t block_bytes = 0;  // bulk bytes per block (kernels::StepTableHead::block_bytes)
  // The hops between ranks of one node go through CUDA IPC (the peer's receive slots and words
  // mapped into this process; NVLink where the GPUs have it), not through the NIC. Agreed at
  // set-up (off on any rank: off on all); where some pair cannot map the other's memory every
  // rank sets up again without it.
  bool direct = true;
  // Every hop between nodes over TCP (GdrLinkConfig::tcp; the slots in pinned mapped host
  // memory, no RDMA device): the step channels where the daemons run no verbs.
  bool tcp = false;
  // Also the direct pairs of each node: on one node RdmaChannels::pairs (a peer for every other
  // rank of the node, so that one-shot and two-shot run as steps: enqueue's `algo`; asked with
  // GRADSYNC_GPU_NODE_STEPS=1), across nodes RdmaChannels::hier (those pairs and a ring per
  // local index: hierarchical allreduce; asked where the nodes hold the same number of ranks,
  // DeviceComm::plan_hierarchical). More peers, more slots.
  bool pairs = false;
  // GRADSYNC_PROTO: every call on the low-latency protocol (kLowLatency: each message to a
  // direct or RDMA peer in its low-latency slot, GdrLinkConfig::ll_bytes; TCP peers' stay
  // bulk) or on bulk; unset: per call
  // as the cost model predicts (RdmaChannels::ll_max_bytes). Agreed at set-up.
  std::optional<plan::Protocol> protocol;
  // The communicator's mapped words (device views) that the stream's waits read and report
  // through, and the host view of the abort word (set when this ring fails).
  const uint32_t* abort_dev = nullptr;
  kernels::NodeError* error_dev = nullptr;
  uint32_t* abort_host = nullptr;
};

class GdrChannels {
 public:
  // Collective: every rank calls it at the same point of set-up. A null ring with *why_not
  // set when GPUDirect RDMA cannot run for some rank (all ranks agree); an error only for a
  // failure that leaves the communicator unusable (the host allreduce failed).
  static Result<std::unique_ptr<GdrChannels>> create(const GdrConfig& cfg, const HostOps& ops,
                                                     std::string* why_not);
  // The slot memory create() will take on this rank (its peers' directions x slots x (slot
  // bytes + low-latency slot bytes)), for GRADSYNC_GPU_MEMORY_MAX before anything is allocated.
  static uint64_t slot_region_bytes(const GdrConfig& cfg);
  ~GdrChannels();
  GdrChannels(const GdrChannels&) = delete;
  GdrChannels& operator=(const GdrChannels&) = delete;

  // Queues one checked, non-empty collective (allreduce, reduce_scatter, all_gather,
  // broadcast) among the members (c.root a world rank) on `stream`; the worker moves its
  // messages as the stream gets to them. An allreduce runs on the trees with c.algorithm
  // kTree, on the ring with kRing, and with kAuto where the cost model predicts it faster
  // (rdma_auto_algo); every other collective takes the ring. `algo`, when set, wins over
  // c.algorithm: kOneShot and kTwoShot run on the direct pairs (GdrConfig::pairs; an error
  // without them; kHierarchical on RdmaChannels::hier likewise). The protocol:
  // GdrConfig::protocol, else the cost model's per size.
  Status enqueue(const CollectiveCall& c, cudaStream_t stream, std::optional<plan::Algo> algo = std::nullopt);
  // The worker's failure, if any (ok otherwise).
  Status error() const;
  // Lets the last credits go out and stops the worker; the stream must be idle (leave).
  void quiesce();
  // "GPUDirect RDMA over emu1n0 port 1 (RoCE, ...), dma-buf, 4 x 4194304-byte slots, 3 peers".
  const std::string& describe() const;
  // True when this rank's slots are in GPU memory (GPUDirect RDMA); false when the NIC
  // reaches them in pinned host memory (host-staged RDMA: the GPU too far from the NIC, GPU
  // memory it cannot register, or GRADSYNC_GDR_HOST_SLOTS). The kernels and the protocol are
  // the same; each rank decides for itself, so one ring may mix both.
  bool gpu_slots() const;
  // Every member on this node: no RDMA, every hop by CUDA IPC.
  bool one_node() const;
  // The hops between nodes are TCP connections (GdrConfig::tcp).
  bool tcp() const;
  // The hierarchical channels were planned (RdmaChannels::hier): allreduce may take them.
  bool hierarchical() const;
  // One node with every hop direct: every call's message counts are relative to bases in
  // device memory (gpu/step_runner.h), so a call captured in a CUDA graph replays. Elsewhere
  // the queue pairs' and TCP peers' worker numbers the messages as the calls are made.
  bool capturable() const;
  // Adds the payload bytes this rank wrote over its queue pairs so far to `b`: to peers on
  // its own node (GdrConfig::nodes) and to peers on other nodes.
  void add_bytes_sent(Communicator::GpuBytesSent& b) const;
  // Its memory: the slots (slots x slot bytes per peer and direction, in GPU or pinned host
  // memory) and the mapped words.
  DeviceComm::MemoryUse memory() const;

  struct Impl;

 private:
  explicit GdrChannels(std::unique_ptr<Impl> impl);
  static Result<bool> set_up(Impl& m, const HostOps& ops, std::string* why_not, std::string* refused);
  Status replay(const StepTableCache::Entry& e, const CollectiveCall& c, cudaStream_t stream);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync
