// Who a coordinator call comes from (docs/security.md, attack 5): every client of the
// coordinator presents its credentials as request metadata on every call, over the TLS
// channel of common/grpc_security.h.
//
//   gradsync-cluster-secret  gradsyncd: the cluster secret (--cluster-secret-file,
//                            $GRADSYNC_CLUSTER_SECRET); not needed when mTLS names the node
//   gradsync-node-id/-key    gradsyncd: the node id and the key the coordinator gave it at
//                            RegisterNode (in the reply's initial metadata, kNodeKeyHeader)
//   gradsync-job-token       gradsyncd: the job's token on the calls about one job
//   gradsync-operator-token  gradsyncctl: the operator credential (--operator-token-file,
//                            $GRADSYNC_OPERATOR_TOKEN) for jobs, describe and abort
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "gradsync/status.h"

namespace gradsync {

inline constexpr char kClusterSecretHeader[] = "gradsync-cluster-secret";
inline constexpr char kNodeIdHeader[] = "gradsync-node-id";
inline constexpr char kNodeKeyHeader[] = "gradsync-node-key";
// A standby coordinator (coordinator/standby_server.h) answers UNAVAILABLE with a message that
// holds this phrase followed by the leader's HOST:PORT; clients move to that address.
inline constexpr char kLeaderIsPhrase[] = "the leader is ";
inline constexpr char kJobTokenHeader[] = "gradsync-job-token";
// Trailing metadata of a RegisterNode refused with RESOURCE_EXHAUSTED because the coordinator is
// behind: retry after about this many ms (callers add their own jitter).
inline constexpr char kRetryAfterHeader[] = "gradsync-retry-after-ms";
inline constexpr char kOperatorTokenHeader[] = "gradsync-operator-token";

// Where the cluster secret and the operator token come from: a file (refused when every user
// can read it) or the environment, never argv.
struct AuthOptions {
  std::string cluster_secret_file;   // --cluster-secret-file
  std::string operator_token_file;   // --operator-token-file

  // Takes argv[*i] (and its value) when it is one of the flags above; `*error` when its value
  // is missing. False when argv[*i] is not one of them.
  bool take_flag(int argc, char** argv, int* i, std::string* error);
  // The file's first line when given, else $GRADSYNC_CLUSTER_SECRET, else "".
  Result<std::string> cluster_secret() const;
  // The file's first line when given, else $GRADSYNC_OPERATOR_TOKEN, else "".
  Result<std::string> operator_token() const;
  static const char* usage();
};

// What one client presents: fixed secrets, and the node's id and key once it registered.
// Thread-safe: the link's threads share it.
class CallAuth {
 public:
  CallAuth(std::string cluster_secret, std::string operator_token)
      : cluster_secret_(std::move(cluster_secret)), operator_token_(std::move(operator_token)) {}
  void set_node(const std::string& id, const std::string& key);
  std::string node_key() const;
  // The headers of every call.
  std::multimap<std::string, std::string> headers() const;
  // The job's token, kept from its join, goes with each later call about it.
  void set_job_token(const std::string& job, const std::string& token);
  void add_job_token(grpc::ClientContext& ctx, const std::string& job) const;

 private:
  const std::string cluster_secret_;
  const std::string operator_token_;
  mutable std::mutex mu_;
  std::string node_id_;
  std::string node_key_;
  std::map<std::string, std::string> job_tokens_;
};

// The retry hint (kRetryAfterHeader) of a finished call; 0 when it has none.
inline std::chrono::milliseconds retry_hint(const grpc::ClientContext& ctx) {
  const auto& trailers = ctx.GetServerTrailingMetadata();
  auto it = trailers.find(kRetryAfterHeader);
  if (it == trailers.end()) return std::chrono::milliseconds{0};
  long ms = 0;
  for (char c : it->second) {
    if (c < '0' || c > '9' || ms > 600000) return std::chrono::milliseconds{0};
    ms = ms * 10 + (c - '0');
  }
  return std::chrono::milliseconds{ms};
}

// A channel to the coordinator whose every call carries `auth`'s headers (a gRPC client
// interceptor).
std::shared_ptr<grpc::Channel> coordinator_channel(const std::string& target,
                                                   std::shared_ptr<grpc::ChannelCredentials> credentials,
                                                   const grpc::ChannelArguments& args,
                                                   std::shared_ptr<const CallAuth> auth);

}  // namespace gradsync
