#include "daemon/trainer_request.h"

#include <vector>

#include "common/framing_proto.h"
#include "common/limits.h"

namespace gradsync {

Status read_trainer_request(int sock, v1::ClientMessage* msg, Deadline deadline) {
  std::vector<Fd> passed;  // a trainer has no descriptors to send: any it sent are closed here
  return recv_frame(sock, msg, deadline, &passed, kMaxRequestBytes);
}

Status check_join_request(const v1::JoinRequest& req, uint32_t pid, const std::string& host) {
  const std::string caller = "rank " + std::to_string(req.rank()) + " (pid " + std::to_string(pid) + ") on " + host;
  // The id is checked first, and a bad one is never echoed back (it may be long, or odd bytes).
  if (Status id = check_job_id(req.job_id()); !id.ok()) return {id.code(), caller + ": " + id.message()};
  const std::string who = "job=" + req.job_id() + " " + caller + ": ";
  auto invalid = [&](const std::string& what) { return Status(Code::kInvalidArgument, who + what); };
  if (req.world_size() == 0) return invalid("world size 0");
  if (req.world_size() > kMaxWorldSize) {
    return invalid("world size " + std::to_string(req.world_size()) + " exceeds the limit of " +
                   std::to_string(kMaxWorldSize));
  }
  if (req.local_world_size() > kMaxLocalWorldSize) {
    return invalid("local world size " + std::to_string(req.local_world_size()) + " exceeds the limit of " +
                   std::to_string(kMaxLocalWorldSize));
  }
  if (req.token().size() > kMaxTokenBytes) {
    return invalid("token longer than " + std::to_string(kMaxTokenBytes) + " bytes");
  }
  if (req.rank() >= req.world_size()) return invalid("rank >= world size " + std::to_string(req.world_size()));
  if (req.local_world_size() == 0 || req.local_world_size() > req.world_size()) {
    return invalid("local world size " + std::to_string(req.local_world_size()) + " out of range");
  }
  if (req.local_rank() >= req.local_world_size()) {
    return invalid("local rank " + std::to_string(req.local_rank()) + " >= local world size " +
                   std::to_string(req.local_world_size()));
  }
  if (req.token().empty() && req.local_world_size() < req.world_size()) {
    return {Code::kPermissionDenied, who + "a job over several nodes needs a job token ($GRADSYNC_JOB_TOKEN), "
                                           "the same on every node"};
  }
  return Status::Ok();
}

Status check_regroup_request(const v1::RegroupRequest& req, uint32_t pid, const std::string& host) {
  const std::string caller = "regroup of pid " + std::to_string(pid) + " on " + host;
  if (Status id = check_job_id(req.job_id()); !id.ok()) return {id.code(), caller + ": " + id.message()};
  const std::string who = "job=" + req.job_id() + " " + caller + ": ";
  auto invalid = [&](const std::string& what) { return Status(Code::kInvalidArgument, who + what); };
  if (req.token().size() > kMaxTokenBytes) return invalid("token longer than " + std::to_string(kMaxTokenBytes) + " bytes");
  if (req.newcomer()) return Status::Ok();
  if (req.old_world_size() == 0 || req.old_world_size() > kMaxWorldSize) return invalid("old world size out of range");
  if (req.old_rank() < 0 || uint32_t(req.old_rank()) >= req.old_world_size()) return invalid("old rank out of range");
  if (uint32_t(req.failed_size()) > req.old_world_size()) return invalid("more failed ranks than the world");
  if (req.from_generation() == 0) return invalid("generation 0");
  return Status::Ok();
}

}  // namespace gradsync
