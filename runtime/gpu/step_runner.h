// Runs one rank's primitive steps (gpu/plan/schedule.h) over the RDMA link (gpu/gdr_link.h):
// the one place where a plan's send, receive, receive-reduce-send, receive-reduce-copy-send and
// receive-copy-send become waits, copies, reductions and signals on a stream. CUDA-free: the
// stream is an interface (StepStream). The GPU communicator implements it with kernels on the
// caller's stream (gpu/gdr_channels.cc); the CPU tests (tests/verbs/gdr_link_test.cc) with the
// host loops on a thread, so the translation below is tested in CI without a GPU.
//
// Per step: wait until each peer received from has a message waiting (its `arrived`) and each
// peer sent to has a free slot (its `send_free`); run the body over the receive slots, the
// rank's input and output and the send slots; signal `ready` for each message written and
// `consumed` for each one read; tell the link the messages' lengths. Messages are numbered per
// peer and direction across calls, as the link numbers them.
//
// Relative counts (StepRunner's `relative`: one node, every peer direct): each call numbers its
// messages from 0 per peer and direction, on top of bases the stream keeps (StepStream::
// begin_call), and names its slots by their index from the base (StepBuf::slot), which the
// stream moves on by the base modulo the slots: its waits, signals, slots and low-latency
// flags are then the same whichever call it is, and so a call captured in a CUDA graph
// replays, while each message still takes the slot its absolute number gives (the next call
// goes on from the slot after this one's last). No worker reads these counts (direct peers
// have none).
//
// Bodies (fold: the payloads in step order with the own operand at self_pos, folded left in
// one StepStream::fold; the final fold divides kAvg once, unless the step is `partial`):
//   send / copy-send            send slots (and output) <- own operand
//   recv / recv-copy-send       output (and send slots) <- payload
//   recv-reduce-send            first send slot <- fold; the other send slots <- it
//   recv-reduce-copy(-send)     output <- fold (the first send slot too); other send slots <- output
//   copy                        output <- own operand
// A fold may write the own operand (in place) wherever it stands among the operands: the
// stream loads every operand of an element before it stores that element.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu/gdr_link.h"
#include "gpu/plan/schedule.h"
#include "gradsync/gradsync.h"

namespace gradsync {

// The channels of a set of members over RDMA links: the plan's shape (members grouped into
// nodes by host, in member order; plan rank i is members[i]), its ring and tree channels, the
// direct pairs of each node when asked (one-shot and two-shot on one node, hierarchical
// across nodes), and the peers this rank needs for them (every hop to or from it).
struct RdmaChannels {
  std::vector<int> members;  // world ranks
  int position = -1;         // this rank's plan rank; -1 when it is not a member
  plan::JobShape shape;
  plan::ChannelSet ring, tree;
  // The direct channels (every ordered pair of the node) that one-shot and two-shot run over:
  // planned only when asked (rdma_channels' `pairs`) and the shape is one node of 2 to
  // plan::kMaxPeers + 1 ranks; empty otherwise.
  plan::ChannelSet pairs;
  // The hierarchical channels (every ordered pair inside each node, and a ring per local index
  // across the nodes, each on its rank's own NIC): planned only when asked (`pairs`) and the
  // shape has 2 or more nodes of the same rank count, at most plan::kMaxPeers + 1; empty
  // otherwise. Allreduce only (plan/schedule.h).
  plan::ChannelSet hier;
  std::vector<GdrPeer> peers;
  // Hops inside a node go through the peers' mapped memory (GdrPeer::direct), not the NIC.
  bool direct = false;
  // The GPU cost model's choice for an allreduce that forces no algorithm, per power of two
  // of its bytes (index i: up to 8 << i bytes; the last entry holds above): the ring, the
  // trees or, where planned, hierarchical (across nodes) or one-shot and two-shot (one node's
  // pairs), whichever is predicted fastest (the GPU cost model
  // on this shape; without `direct`, the hops and bytes inside a node costed as the NIC's,
  // since they loop through it). Filled by rdma_choose_algos; empty: the ring.
  std::vector<plan::Algo> auto_algo;
  // Per plan::Algo, the largest call (bytes, a power of two) for which the cost model
  // predicts the low-latency protocol faster than bulk on these channels; 0: never. Only
  // where every peer is direct (one node): across nodes the protocol is taken only where
  // forced (GRADSYNC_PROTO=ll), and then the hops through a NIC take it too, while TCP hops
  // stay bulk (they have no low-latency slots). Filled by rdma_choose_algos.
  size_t ll_max_bytes[plan::kNumAlgos] = {};
};
// `hosts`: every world rank's node (its host, or any grouping key). An error when `me` is not among `members` once, or the
// peers exceed kMaxGdrPeers. `direct`: the peers on this rank's node are direct peers (their
// GPU memory mapped, CUDA IPC) rather than queue pairs through the NIC. `pairs`: also the
// direct channels of one node (RdmaChannels::pairs), or across nodes the hierarchical ones
// (RdmaChannels::hier), and their peers: every other rank of the node, and the rank's rail
// neighbours (each peer costs slots).
Result<RdmaChannels> rdma_channels(const std::vector<int>& members, const std::vector<std::string>& hosts, int me,
                                   bool direct = false, bool pairs = false);

// Fills `auto_algo` (once per set of channels, at set-up: it plans every size).
void rdma_choose_algos(RdmaChannels& ch);
// The algorithm an allreduce of `bytes` takes on these channels when none is forced, from
// `auto_algo`.
plan::Algo rdma_auto_algo(const RdmaChannels& ch, size_t bytes);
// That choice in words, for logs and describe: "tree up to 65536 B, ring above".
std::string rdma_auto_summary(const RdmaChannels& ch);
// Whether a call of `bytes` on `algo` takes the low-latency protocol when none is forced
// (ll_max_bytes), and that choice in words ("low-latency up to 16384 B (ring), ...").
bool rdma_auto_low_latency(const RdmaChannels& ch, plan::Algo algo, size_t bytes);
std::string rdma_protocol_summary(const RdmaChannels& ch);

// The steps of one call on those channels, ordered channel by channel (so that every peer
// connection carries one channel's messages after another's on both ends), with messages of at
// most `slot_bytes`. kTree applies to allreduce; kOneShot and kTwoShot (every collective the
// planner has them for) run on `pairs`, and kHierarchical (allreduce) on `hier`, each an error
// (kInvalidArgument) where that set is empty; every other call takes the ring. `root` is a
// world rank. `window`: the link's slots per peer (plan::PlanRequest::window).
Result<std::vector<plan::Step>> rdma_steps(const RdmaChannels& ch, CollectiveKind kind, plan::Algo algo,
                                           size_t count, size_t esize, int root, size_t slot_bytes,
                                           size_t window = 1);

// An operand of a stream operation: plain memory, or a low-latency slot (GdrLink::ll_slot)
// whose 16-byte lines carry 8 bytes of the message and `flag` (nonzero) twice: a read waits
// for each line's flags (bounded, as every wait), a write stores them with it. A pointer
// converts to plain memory. Sources are only read (p is not const so that one type serves both).
struct StepBuf {
  StepBuf() = default;
  StepBuf(const void* at) : p(const_cast<void*>(at)) {}  // NOLINT: plain memory
  StepBuf(void* at, uint32_t f, int writer) : p(at), flag(f), peer(writer) {}
  void* p = nullptr;
  uint32_t flag = 0;  // 0: plain memory
  int peer = -1;      // a low-latency receive slot: the world rank that writes it (for errors)
  // A relative flag's base (step_base of its peer and direction): the flag is that base plus
  // `flag`, as a 32-bit count (0 taken as 1); -1: `flag` is the flag.
  int base = -1;
  // A slot of a relative call (with `base`): its index among the link's slots when the base
  // is a multiple of them; the stream moves it on by the base (kernels::step_slot), so that
  // message base + n takes slot (base + n) mod slots. -1: p is where it is.
  int slot = -1;
};
// The base of a relative count: peer index p's sends (ready, send_free, the send slots' flags)
// or receives (arrived, consumed, the receive slots' flags).
inline int step_base(int p, bool receive) { return 2 * p + (receive ? 1 : 0); }

// What a step asks of the stream that runs it. Peers are link indices; values are message
// counts (monotonic, as GdrWords holds them), relative to the stream's bases in a relative
// call (a wait for a count <= 0 there is none). `fold`: dst (and dst2 when dst2.p is not null)
// = srcs[0] op srcs[1] op .. op srcs[k-1], folded left in that order, ((x0 op x1) op x2) ..,
// each step's result of the element type (the same bytes as k - 1 pairwise reductions
// acc = op(acc, x[j])); kAvg sums, and divides once at the last step when `final`. 2 <= k <=
// plan::kMaxPeers + 1. dst may be one of the sources exactly (in place): every source of an
// element is read before the element is written.
class StepStream {
 public:
  virtual ~StepStream() = default;
  // Before a call's first step: whether its counts are relative (to step_base(p, receive) of
  // the peer and direction: ready and send_free the sends', arrived and consumed the
  // receives'); then end_call moves each base on by the call's last signal of it.
  virtual Status begin_call(bool relative) = 0;
  virtual Status wait_arrived(int peer, int64_t value) = 0;
  virtual Status wait_send_free(int peer, int64_t value) = 0;
  virtual Status signal_ready(int peer, uint64_t value) = 0;
  virtual Status signal_consumed(int peer, uint64_t value) = 0;
  virtual Status copy(StepBuf dst, StepBuf src, size_t bytes) = 0;
  virtual Status fold(StepBuf dst, StepBuf dst2, const StepBuf* srcs, int k, size_t count, bool final) = 0;
  // Around each step's calls above, and after a call's last step (also after an error, for
  // the steps queued before it): a stream may collect a step's waits, operations and signals,
  // and a call's steps, and queue them as one (the GPU's step kernel, kernels/cuda_step.cuh).
  virtual Status begin_step() { return Status::Ok(); }
  // Called within a step (before end_step) whose signals must be ordered after its stores: it
  // wrote a message in plain memory, or low-latency lines into an RDMA peer's send slot
  // (ours), which the peer (or its NIC, or the worker) reads once it sees `ready`. A step
  // without it only read its receive slots (its loads done before its signals) and wrote
  // low-latency lines into a direct peer's slots, each read by its flag, and plain memory no peer reads
  // (no step writes into its receive slots, which the peer overwrites once it sees `consumed`:
  // a fold in place writes the own operand, in one pass).
  virtual void order_signals() {}
  virtual Status end_step() { return Status::Ok(); }
  virtual Status end_call() { return Status::Ok(); }
};

class StepRunner {
 public:
  // `relative`: every call's counts relative (the header says when); every peer must be direct.
  explicit StepRunner(GdrLink* link, bool relative = false);
  // Runs `steps` (ranks in them are positions in `members`, the world ranks of the plan's
  // shape) on `stream`. `input` and `output` are the call's buffers, `esize` bytes per element.
  // Every message must fit a slot. On an error the steps already queued stay queued, and the
  // link knows their messages. `low_latency`: each message to or from a direct or RDMA peer
  // (not a TCP peer) that fits its low-latency slot (GdrLink::ll_payload_bytes) travels there,
  // and its receiver reads it as it lands instead of waiting for `arrived`; every rank of a
  // call must pass the same.
  Status run(const std::vector<plan::Step>& steps, const std::vector<int>& members, const void* input,
             void* output, size_t esize, StepStream& stream, bool low_latency = false);

 private:
  GdrLink& link_;
  bool relative_;
  std::vector<uint64_t> sent_, received_;  // per peer index: messages queued so far (this call's, relative)
};

}  // namespace gradsync
