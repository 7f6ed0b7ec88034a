// GPUDirect RDMA between the GPUs of a job (design §3, path 1; issue 5): the NIC writes each
// message straight from a send slot in one rank's GPU memory into a receive slot in the next
// rank's GPU memory, and the reduction kernels on the caller's stream read the slots there.
// No byte of the payload passes through host memory.
//
// Set-up (collective, at join): each rank opens the RDMA device port its daemon uses (named
// in the join reply), allocates one GPU region of `slots` send slots and `slots` receive slots
// and registers it (gpu/gpu_memory_registration.h: dma-buf, else nvidia-peermem), creates one
// RC QP to the next rank and one from the previous rank (ranks in rank order), and exchanges
// QPN, PSN, LID/GID, MTU, the slot address and rkey and the credit word's address and rkey
// with every rank through a host allreduce. If any rank cannot (no device, no registration,
// a QP that would not connect), every rank hears so and the communicator keeps the
// host-staged path, logging each rank's reason.
//
// A call is a ring schedule cut into messages of at most one slot, piece-major (NCCL's loop
// order: every step of piece 0, then of piece 1, ...), so that two slots per direction keep
// the ring deadlock-free. Everything the GPU does is queued on the caller's stream at the
// call; a worker thread per communicator drives the NIC:
//
//   stream (rank r)                                    worker (rank r)
//     wait arrived >= k+1  (message k from r-1)          poll the CQ: message k's receive
//     wait send_free >= m+1-slots                          completion (imm == k, length
//     kernel: reduce/copy recv slot k, input ->           checked) -> flush if the GPU needs
//             send slot m (and/or the output)             it -> arrived = k+1
//     signal ready = m+1, consumed = k+1                 ready >= m+1 and the next rank's
//                                                        credit >= m+1-slots -> post
//                                                        WRITE_WITH_IMM of send slot m into
//                                                        its receive slot m % slots (imm = m)
//                                                        send completion -> send_free = m+1
//                                                        consumed advanced -> RDMA WRITE it
//                                                        into the previous rank's credit word
//
// `arrived`, `ready`, `send_free` and `consumed` are words in mapped pinned host memory
// (the stream's wait kernels poll them, as on the host-staged path); the credit word is host
// memory registered with the NIC. Every wait has the op timeout; an error completion or a
// stalled peer fails the communicator with the peer's rank and host and the verbs status,
// aborts the job (so every rank's waits end), and every later call reports it.
//
// Allreduce is reduce-scatter then all-gather around the ring (rank r ends the first half
// holding segment r reduced, in rank order from r+1 around to r); reduce_scatter and
// all_gather are the halves; broadcast is a pipeline from the root around the ring. Results
// are bitwise identical on every rank (each segment is reduced once, then copied).
//
// The transport half (QPs, credits, the worker) is gpu/gdr_link.h, CUDA-free and tested on
// the CPU; this file is the GPU half: slot memory, mapped words, the stream's kernels.
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
  // broadcast) on `stream`; the worker moves its messages as the stream gets to them.
  Status enqueue(const CollectiveCall& c, cudaStream_t stream);
  // The worker's failure, if any (ok otherwise).
  Status error() const;
  // Lets the last credits go out and stops the worker; the stream must be idle (leave).
  void quiesce();
  // "GPUDirect RDMA over emu1n0 port 1 (RoCE, ...), dma-buf, 4 x 4194304-byte slots".
  const std::string& describe() const;

  struct Impl;

 private:
  explicit GdrRing(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync
