// gradsync public API: the only header training code includes.
//
//   auto session = gradsync::Session::connect();            // $GRADSYNC_DAEMON or default socket
//   if (!session.ok()) { ... session.status().to_string() ... }
//   auto comm = session->join(gradsync::JoinOptions::from_env());
//   gradsync::Status s = comm->allreduce(grads.data(), grads.size(), gradsync::DataType::kFloat32,
//                                        gradsync::ReduceOp::kSum);
//
// Errors are values (gradsync::Status); nothing in the API throws. A communicator that failed
// (a peer died, the job was aborted, a wait ran past its deadline) stays failed: every later
// call returns the first error.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "gradsync/status.h"

// cudaStream_t is `CUstream_st*` (driver_types.h); declared here so that this header needs no
// CUDA header. Pass a cudaStream_t where a CUstream_st* is asked for.
struct CUstream_st;

namespace gradsync {

// Element types. Numeric rules, the same on every path:
// - float16 and bfloat16 are added/multiplied/compared in float32 and rounded to nearest
//   even when stored, once per reduction step;
// - integers wrap in two's complement (sum, prod); avg of integers divides the wrapped sum by
//   the world size rounding toward zero; avg of floating types divides in float32/float64.
enum class DataType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
};
constexpr int kNumDataTypes = 8;

enum class ReduceOp : uint8_t { kSum = 0, kProd = 1, kMin = 2, kMax = 3, kAvg = 4 };
constexpr int kNumReduceOps = 5;

// Which algorithm a collective uses. kAuto asks the cost model (docs/algorithms.md); the
// environment variable GRADSYNC_ALGO=ring|tree overrides kAuto for every call.
enum class Algorithm : uint8_t { kAuto = 0, kRing = 1, kTree = 2 };

size_t element_size(DataType type);  // 0 for an unknown type
const char* to_string(DataType type);
const char* to_string(ReduceOp op);
const char* to_string(Algorithm algo);

// Per-call options; one struct for every collective.
struct CallOptions {
  Algorithm algorithm = Algorithm::kAuto;
};

struct JoinOptions {
  std::string job;               // job id shared by every rank
  std::string token;             // job token; the first joiner sets it, the others must match
  int rank = -1;
  int world_size = 0;
  int local_rank = 0;            // index of this rank among the ranks of its node
  int local_world_size = 1;      // ranks on this node: the daemon waits for all of them
  std::chrono::milliseconds join_timeout{60'000};
  // Deadline of one collective from the call to its completion. A dead peer is normally
  // reported much sooner, through the daemon and the coordinator.
  std::chrono::milliseconds op_timeout{300'000};
  // The CUDA device whose memory this rank's GPU collectives use (the stream overloads
  // below): an ordinal, kDeviceLocalRank (LOCAL_RANK modulo the number of visible devices),
  // or kNoDevice for a host-only communicator. Set up at join (all ranks of a job must agree
  // on GPU or not); a library built without CUDA refuses a device with kUnimplemented.
  static constexpr int kNoDevice = -1;
  static constexpr int kDeviceLocalRank = -2;
  int device = kNoDevice;

  // RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GRADSYNC_JOB_ID, GRADSYNC_JOB_TOKEN,
  // GRADSYNC_JOIN_TIMEOUT_MS, GRADSYNC_OP_TIMEOUT_MS, GRADSYNC_DEVICE (an ordinal or "local").
  static JoinOptions from_env();
};

class CommunicatorImpl;
class WorkImpl;

// The handle of an asynchronous collective.
class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<WorkImpl> impl) : impl_(std::move(impl)) {}
  // Waits until the collective finished or `timeout` passed (kDeadlineExceeded then; the
  // collective goes on and can be waited for again).
  Status wait(std::chrono::milliseconds timeout = std::chrono::milliseconds::max());
  bool done() const;

 private:
  std::shared_ptr<WorkImpl> impl_;
};

class Communicator {
 public:
  explicit Communicator(std::shared_ptr<CommunicatorImpl> impl);
  ~Communicator();
  Communicator(Communicator&&) noexcept;
  Communicator& operator=(Communicator&&) noexcept;

  int rank() const;
  int world_size() const;
  uint64_t generation() const;
  const std::string& job() const;

  // Every collective has a blocking form, which returns when the result is in place, and an
  // _async form, which queues it on the communicator's worker and returns a Work; buffers
  // must stay valid until the Work completes. Collectives run in the order they were called,
  // and every rank must call the same collectives in the same order with matching arguments
  // (a mismatch is reported as kMismatch, not reduced). `send == recv` is in-place.

  // recv[i] = op over ranks of send[i], i < count.
  Status allreduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                   CallOptions opts = {});
  Status allreduce(void* buf, size_t count, DataType type, ReduceOp op, CallOptions opts = {}) {
    return allreduce(buf, buf, count, type, op, opts);
  }
  Work allreduce_async(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                       CallOptions opts = {});

  // GPU collectives: the forms with a `stream` work on device memory of device(). Each is
  // queued on `stream` (a cudaStream_t; nullptr is the legacy default stream) and returns
  // without waiting for the GPU, like ncclAllReduce, ncclReduceScatter, ncclAllGather and
  // ncclBroadcast; work queued on `stream` after it sees the result. Semantics, in-place
  // layouts and numeric rules are those of the host forms below (reduce_scatter's and
  // all_gather's counts are per rank; in a reduction every rank folds the inputs in rank
  // order, so all ranks get the same bytes). What goes wrong once the work runs (a peer that
  // never arrives, an abort) is reported by async_error() and by every later call. Bad
  // arguments (null, misaligned or overlapping buffers, host memory or another GPU's, unknown
  // type or op, a root outside the world, an overflowing count) are refused here with
  // kInvalidArgument naming the rank and host, before anything is queued. Calls of one
  // communicator must be ordered (one stream, or streams ordered by events), as with NCCL.
  // On one node the calls can be captured in a CUDA graph; across nodes (host-staged) they
  // cannot (refused while capturing). Without CUDA in the build: kUnimplemented. CallOptions'
  // algorithm (else GRADSYNC_ALGO) picks the GPU schedule where the path has a choice
  // (docs/architecture.md). A host collective called after a GPU call comes after it on every
  // rank, whether or not the stream got there yet.
  Status allreduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                   CUstream_st* stream, CallOptions opts = {});
  // send holds world_size * recv_count elements; rank r receives block r of the reduction.
  Status reduce_scatter(const void* send, void* recv, size_t recv_count, DataType type, ReduceOp op,
                        CUstream_st* stream, CallOptions opts = {});
  // recv holds world_size * send_count elements: block r is rank r's send.
  Status all_gather(const void* send, void* recv, size_t send_count, DataType type,
                    CUstream_st* stream, CallOptions opts = {});
  // Every rank's buf ends equal to the root's.
  Status broadcast(void* buf, size_t count, DataType type, int root, CUstream_st* stream,
                   CallOptions opts = {});
  // The first error of GPU work queued earlier that has since failed (Ok while none has);
  // does not wait for the GPU. Like ncclCommGetAsyncError.
  Status async_error();
  // The CUDA device of GPU collectives, or JoinOptions::kNoDevice.
  int device() const;
  // How the GPU collectives move data on this communicator, for logs: "cuda-ipc" (every rank
  // on one node: kernels write into peers' GPU memory), "gpudirect-rdma" and "hierarchical"
  // (RDMA queue pairs between nodes), "cuda-ipc-steps" (one node of more ranks than the
  // one-node kernels take, kernels::kMaxNodeRanks: the planner's ring and trees over CUDA IPC
  // for calls from the measured size), "tcp-steps" (several nodes without RDMA and
  // GRADSYNC_GPU_STAGED=steps: the same ring and trees with the hops between nodes over the
  // ranks' own TCP connections, slots in pinned host memory), "host-staged" (through pinned
  // host memory and the daemons), "single-rank", or "none" on a host-only communicator.
  std::string gpu_path() const;
  // Payload bytes this rank's GPU collectives sent to other GPUs so far, by link: the counters
  // behind the byte counts in docs/benchmarks.md. The host-staged path through the daemons
  // is not counted here (its channels have their own counters).
  struct GpuBytesSent {
    uint64_t cuda_ipc = 0;          // stored into peers' GPU memory by this rank's kernels (its node)
    uint64_t rdma_same_node = 0;    // written by RDMA to peers on its own node (the flat channels)
    uint64_t rdma_other_nodes = 0;  // written by RDMA to peers on other nodes
    uint64_t tcp = 0;               // sent over TCP by the step channels (GRADSYNC_GPU_STAGED=steps)
    uint64_t total() const { return cuda_ipc + rdma_same_node + rdma_other_nodes + tcp; }
  };
  Result<GpuBytesSent> gpu_bytes_sent_by_link() const;
  // gpu_bytes_sent_by_link().total().
  Result<uint64_t> gpu_bytes_sent() const;

  // send holds world_size * recv_count elements; rank r receives block r of the reduction.
  Status reduce_scatter(const void* send, void* recv, size_t recv_count, DataType type,
                        ReduceOp op, CallOptions opts = {});
  Work reduce_scatter_async(const void* send, void* recv, size_t recv_count, DataType type,
                            ReduceOp op, CallOptions opts = {});

  // recv holds world_size * send_count elements: block r is rank r's send.
  Status all_gather(const void* send, void* recv, size_t send_count, DataType type,
                    CallOptions opts = {});
  Work all_gather_async(const void* send, void* recv, size_t send_count, DataType type,
                        CallOptions opts = {});

  // Every rank's buf ends equal to the root's.
  Status broadcast(void* buf, size_t count, DataType type, int root, CallOptions opts = {});
  Work broadcast_async(void* buf, size_t count, DataType type, int root, CallOptions opts = {});

  // Returns once every rank has entered the barrier.
  Status barrier();

  // What the cost model predicts for an allreduce of `count` elements, and what kAuto picks
  // (GRADSYNC_ALGO aside). Every rank of the communicator predicts the same.
  struct Prediction {
    double ring_us = 0;
    double tree_us = 0;
    Algorithm choice = Algorithm::kRing;
  };
  Prediction predict_allreduce(size_t count, DataType type) const;
  // The model's constants in one line, for logs and gradsync-bench --model.
  std::string cost_model() const;

  // Aborts the job on every rank (like ncclCommAbort): collectives in flight here and on the
  // other ranks return kAborted naming this rank and `reason`; this communicator stays
  // failed. Callable from any thread, also while a collective is running.
  Status abort(const std::string& reason);

  // Leaves the job; also done by the destructor.
  Status leave();

 private:
  friend struct CommunicatorInternals;  // the library's internal headers (gpu/timeline.h)
  std::shared_ptr<CommunicatorImpl> impl_;
};

class SessionImpl;

class Session {
 public:
  // Connects to the local daemon: `socket_path` if given, else $GRADSYNC_DAEMON, else
  // /run/gradsync/gradsyncd.sock.
  static Result<Session> connect(const std::string& socket_path = "");
  // Joins a communicator; blocks until every rank joined or the join timeout passed.
  Result<Communicator> join(const JoinOptions& options);

  const std::string& node_name() const;

 private:
  explicit Session(std::shared_ptr<SessionImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<SessionImpl> impl_;
};

}  // namespace gradsync
