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

namespace gradsync {

enum class DataType : uint8_t { kFloat32 = 0 };
enum class ReduceOp : uint8_t { kSum = 0 };

size_t element_size(DataType type);
const char* to_string(DataType type);
const char* to_string(ReduceOp op);

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

  // RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GRADSYNC_JOB_ID, GRADSYNC_JOB_TOKEN,
  // GRADSYNC_JOIN_TIMEOUT_MS, GRADSYNC_OP_TIMEOUT_MS.
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

  // Blocking allreduce; `send == recv` is in-place. Returns when `recv` holds the result.
  Status allreduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op);
  Status allreduce(void* buf, size_t count, DataType type, ReduceOp op) {
    return allreduce(buf, buf, count, type, op);
  }
  // Queues the allreduce on the communicator's worker; buffers must stay valid until the
  // returned Work completes. Collectives run in the order they were queued.
  Work allreduce_async(const void* send, void* recv, size_t count, DataType type, ReduceOp op);

  // Leaves the job; also done by the destructor.
  Status leave();

 private:
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
