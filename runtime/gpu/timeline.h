// The in-kernel timeline of the one-node GPU path's chunked protocol (cuda-ipc,
// kernels/cuda_node.cuh), for the overlap figure of issue 4: does a rank reduce one chunk while
// the next is in flight, and how much of the transfer time does that hide?
//
// Switch: GRADSYNC_GPU_TIMELINE=1 in the environment when the communicator is created (read
// once, by DeviceComm::create); off otherwise, and then the kernels are the plain ones (the
// stamping kernel is a separate instantiation, so the registers of the default path do not
// change). The low-latency protocol (segments up to GRADSYNC_GPU_LL_MAX bytes) and launches
// captured in a CUDA graph record nothing.
//
// What is recorded. Every block of a chunked launch has a record; its thread 0 reads
// %globaltimer (ns, this GPU's clock) at these points of each chunk i, in program order
// push(0), then for each i: push(i + 1), consume(i):
//   credit_wait  push(i) entered; thread 0 waits for every peer's `freed` of the slot
//   push_start   after the block's barrier: the slot is free, the block's stores start
//   push_end     after every thread's stores into the peers' slots, __threadfence_system and
//                the barrier: the stores completed at system scope; taken before the ready
//                flags are released
//   ready_wait   consume(i) entered; thread 0 waits for every pushing peer's `ready`
//   fold_start   after the barrier: the peers' chunk i is in this GPU's slots; the fold
//                starts (all_gather, broadcast: the copy out of the slots)
//   fold_end     after the barrier that ends every thread's reads of the slots; taken
//                before `freed` is released
// plus the block's start (kernel entry) and end. At most kMaxChunksPerBlock chunks of a
// block are recorded per call; the others run normally and are counted as dropped.
//
// What "in flight" can mean here, precisely. Within one block the intervals cannot overlap
// by construction: all of the block's threads issue their stores of chunk i + 1, fence them
// (__threadfence_system orders them at system scope before the ready release; in practice
// it waits until the peer acknowledged the writes) and meet at a barrier before any starts
// the fold of chunk i. So "reduce chunk i while chunk i + 1 is in flight" happens between
// blocks of one GPU (block a folds while block b's stores are on the link; the blocks drift
// apart through their waits) and between ranks (a peer's stores land in this GPU's slots
// while this GPU folds). The figures:
//   same_block_overlap_us  sum over blocks of |push ∩ fold| of the same block: measured, and
//                          0 by construction (a check of the claim above, not a result).
//   push_us, fold_us       |U_P|, |U_F|: the time at least one block of this GPU was pushing
//                          (push_start..push_end), resp. folding (fold_start..fold_end); U
//                          is the union over every recorded block and chunk.
//   overlap_us             |U_P ∩ U_F|: this GPU had stores in flight and was folding.
//   hidden                 overlap_us / push_us: the fraction of this GPU's transfer time
//                          during which it was also reducing, i.e. transfer time that did
//                          not lengthen the call beyond its reduce time. Measured from the
//                          stamps of every block; nothing is assumed about the link.
//   exposed_push_us        push_us - overlap_us.
//   fold_hidden            overlap_us / fold_us: the same overlap seen from the reduce side
//                          (the fraction of reduce time spent while transfers were in flight).
// Both are GPU-wide: "some block folds while some other block pushes"; activity() says how
// many blocks do each over the call.
// Across ranks (overlap_with_peer): the peer's pushes, in the peer's clock, are mapped onto
// this rank's clock. %globaltimer is per GPU (each is set from the host clock when the device
// is attached; on two H200s of one host they differed by about 38 us), so the offset between
// two GPUs is not assumed to be 0. The protocol's own causality bounds it: a peer's push_end
// precedes this rank's fold_start of the same chunk (this rank saw the ready flag, released
// after that stamp); this rank's push_end precedes the peer's fold_start; a fold_end precedes
// the other rank's push_start of the chunk `slots` later (through freed). The hidden fraction
// of the peer's transfer (|peer's U_P ∩ my U_F| / |peer's U_P|) is reported as the range it
// takes over every offset the bounds allow (about +-2 us on H200s). If the bounds contradict
// each other by more than two timer ticks, the figure is refused rather than guessed.
//
// Reading it: DeviceComm::last_timeline(), or gpu::last_timeline(comm) below, waits for the
// last call's kernel (an event recorded after it; nothing else is synchronised) and copies the
// records of the blocks it used on a private stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/status.h"

namespace gradsync {
class Communicator;
}

namespace gradsync::gpu {

// Chunks recorded per block and call, at most (later ones are counted as dropped).
constexpr uint32_t kMaxChunksPerBlock = 128;

// One chunk's stamps, %globaltimer ns of the recording GPU; 0: the step did not happen (a
// broadcast non-root pushes nothing).
struct ChunkSteps {
  uint64_t credit_wait = 0, push_start = 0, push_end = 0;
  uint64_t ready_wait = 0, fold_start = 0, fold_end = 0;
};

struct BlockTimeline {
  uint32_t block = 0;
  uint64_t start_ns = 0, end_ns = 0;
  uint64_t first_seq = 0;          // the block's sequence number of its chunk 0
  uint32_t chunks = 0;             // the block's chunks in the call, recorded or not
  std::vector<ChunkSteps> steps;   // the first min(chunks, kMaxChunksPerBlock)
  uint32_t dropped() const { return chunks - uint32_t(steps.size()); }
};

struct Interval {
  uint64_t begin = 0, end = 0;
};

struct TimelineSummary {
  double wall_us = 0;           // first block start .. last block end
  double push_us = 0;           // |U_P| (see the top of this file)
  double fold_us = 0;           // |U_F|
  double overlap_us = 0;        // |U_P ∩ U_F|
  double hidden = 0;            // overlap_us / push_us (0 when nothing was pushed)
  double exposed_push_us = 0;   // push_us - overlap_us
  double fold_hidden = 0;       // overlap_us / fold_us (0 when nothing was folded)
  double same_block_overlap_us = 0;  // sum over blocks of |P_b ∩ F_b|: 0 by construction
  // Sums over blocks and chunks, divided by the blocks: one block's mean busy times.
  double block_push_us = 0, block_fold_us = 0, block_credit_wait_us = 0,
         block_ready_wait_us = 0, block_span_us = 0;
  uint32_t max_chunks_per_block = 0;
  uint64_t recorded_chunks = 0;
  uint64_t dropped_chunks = 0;
  uint64_t granularity_ns = 0;  // smallest positive step between a block's distinct stamps
};

struct Timeline {
  int rank = 0, world = 0;
  std::string collective;       // "allreduce", ...
  uint64_t bytes = 0;           // of one segment (the call's count x element size)
  uint64_t chunk_bytes = 0;
  uint32_t slots = 0;
  uint64_t nchunks = 0;         // of the call, every block
  uint32_t blocks = 0;          // the layout's
  uint32_t blocks_used = 0;     // min(blocks, nchunks): the records below
  std::vector<BlockTimeline> block;
  TimelineSummary summary;      // summarize(*this)
};

// Chunk i of a call with `nchunks` chunks on `blocks_used` blocks belongs to block i % blocks_used.
inline uint32_t chunks_of_block(uint64_t nchunks, uint32_t blocks_used, uint32_t b) {
  return nchunks > b ? uint32_t((nchunks - 1 - b) / blocks_used + 1) : 0;
}

TimelineSummary summarize(const Timeline& t);

// One step of a block's thread 0, in program order.
struct Step {
  enum Kind { kBlockStart, kCreditWait, kPushStart, kPushEnd, kReadyWait, kFoldStart, kFoldEnd, kBlockEnd };
  Kind kind;
  uint32_t chunk;  // unused for kBlockStart and kBlockEnd
  uint64_t ns;
};
const char* step_name(Step::Kind k);
// The recorded stamps of block `b` in thread 0's program order (steps that did not happen
// left out); when chunks were dropped the list stops at the last recorded one.
std::vector<Step> program_order(const BlockTimeline& b);
// "" when the timeline is well-formed: the expected blocks and chunks per block, no chunk
// dropped unless more than kMaxChunksPerBlock, every stamp present that the collective makes,
// and every block's stamps non-decreasing in program order (hence start <= end of every
// interval). Else the first problem found.
std::string check_well_formed(const Timeline& t);

// Per bin of the span (first start .. last end, `bins` equal parts): the mean number of blocks
// pushing and folding (the time they spend in the bin / the bin's length).
struct Activity {
  std::vector<double> pushing, folding;
  double bin_us = 0;
};
Activity activity(const Timeline& t, int bins);

// The peer's pushes (transfers into this rank's slots, among others) against this rank's
// folds, across the clocks of two GPUs; see the top of this file.
struct PeerOverlap {
  bool ok = false;
  std::string why;               // when !ok: the reason; when ok: a caveat, or empty
  int constraints = 0;           // causal pairs used to bound the offset
  double offset_lo_ns = 0, offset_hi_ns = 0;  // my clock = peer clock + offset, within these
  double peer_push_us = 0;       // |peer's U_P|
  double hidden_lo = 0, hidden_hi = 0;  // |peer U_P ∩ my U_F| / |peer U_P| over the offsets
};
PeerOverlap overlap_with_peer(const Timeline& mine, const Timeline& peer);

// Flat integers (for an int64 exchange between ranks) and back.
std::vector<int64_t> pack(const Timeline& t);
Result<Timeline> unpack(const int64_t* words, size_t n);

// Every rank's timeline, on every rank, index = rank (collective: every rank calls it at the
// same point; host int64 allreduces). `mine` null: this rank has none, its entry is empty
// (world == 0, no blocks), as is every entry that did not unpack.
Result<std::vector<Timeline>> all_timelines(Communicator& comm, const Timeline* mine);

// The timeline of the last GPU collective `comm` queued (see the top of this file): waits
// for that call's kernel only. kFailedPrecondition when the timeline is off
// (GRADSYNC_GPU_TIMELINE=1 was not set at join), the path is not cuda-ipc, or the last call
// recorded nothing (low-latency protocol, graph capture); kUnimplemented without CUDA.
Result<Timeline> last_timeline(Communicator& comm);

}  // namespace gradsync::gpu
