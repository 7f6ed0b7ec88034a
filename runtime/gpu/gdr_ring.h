// GPUDirect RDMA between the GPUs of a job (docs/architecture.md, the GPU paths): the NIC writes each
// message straight from a send slot in one rank's GPU memory into a receive slot in the next
// rank's GPU memory, and the reduction kernels on the caller's stream read the slots there.
// No byte of the payload passes through host memory. A rank whose GPU memory the NIC cannot
// reach keeps the ring with its slots in pinned host memory instead (gpu_slots() below).
//
// The set-up, the messages, credits and checks are gpu/gdr_link.h's (the transport half,
// CUDA-free, tested on the CPU); the order of the steps is gpu/gdr_schedule.h's. This file is
// the GPU half: the slots in GPU memory registered by dma-buf (else peermem), the four words in
// mapped pinned memory, and per step on the caller's stream: wait kernels on `arrived` and
// `send_free`, the copy or reduction kernels reading the receive slot and writing the send
// slot (and the output), signal kernels for `ready` and `consumed`. Every wait has the op
// timeout; a link failure sets the communicator's abort word, so the stream's waits end.
//
// Built with CUDA and the verbs headers (GRADSYNC_HAVE_GDR).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "collectives/collective.h"
#include "gpu/device_comm.h"
#include "gpu/gdr_link.h"
#include "kernels/cuda_node.cuh"

namespace gradsync {

struct GdrConfig {
  GdrLinkConfig link;  // rank, peers, RDMA device, slots, op timeout (gpu/gdr_link.h)
  int device = 0;      // the CUDA device
  // The communicator's mapped words (device views) that the stream's waits read and report
  // through, and the host view of the abort word (set when this ring fails).
  const uint32_t* abort_dev = nullptr;
  kernels::NodeError* error_dev = nullptr;
  uint32_t* abort_host = nullptr;
};

class GdrRing {
 public:
  // Collective: every rank calls it at the same point of set-up. A null ring with *why_not
  // set when GPUDirect RDMA cannot run for some rank (all ranks agree); an error only for a
  // failure that leaves the communicator unusable (the host allreduce failed).
  static Result<std::unique_ptr<GdrRing>> create(const GdrConfig& cfg, const HostOps& ops,
                                                 std::string* why_not);
  ~GdrRing();
  GdrRing(const GdrRing&) = delete;
  GdrRing& operator=(const GdrRing&) = delete;

  // Queues one checked, non-empty collective (allreduce, reduce_scatter, all_gather,
  // broadcast) among the ring's members (GdrLinkConfig::ring; c.root a world rank) on
  // `stream`; the worker moves its messages as the stream gets to them. `avg_divisor`: what an
  // avg divides by (0: the ring's member count; the hierarchical path's rails pass the world's).
  Status enqueue(const CollectiveCall& c, cudaStream_t stream, int avg_divisor = 0);
  // The worker's failure, if any (ok otherwise).
  Status error() const;
  // Lets the last credits go out and stops the worker; the stream must be idle (leave).
  void quiesce();
  // "GPUDirect RDMA over emu1n0 port 1 (RoCE, ...), dma-buf, 4 x 4194304-byte slots".
  const std::string& describe() const;
  // True when this rank's slots are in GPU memory (GPUDirect RDMA); false when the NIC
  // reaches them in pinned host memory (host-staged RDMA: the GPU too far from the NIC, GPU
  // memory it cannot register, or GRADSYNC_GDR_HOST_SLOTS). The kernels and the protocol are
  // the same; each rank decides for itself, so one ring may mix both.
  bool gpu_slots() const;
  // The ring's memory: its slots (2 x slots x slot bytes, in GPU or pinned host memory) and
  // its mapped words.
  DeviceComm::MemoryUse memory() const;

  struct Impl;

 private:
  explicit GdrRing(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync
