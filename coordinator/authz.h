// Who may make which coordinator call (docs/security.md, attack 5). The service calls one of
// these at the top of each handler; a refusal is PERMISSION_DENIED naming the missing or
// wrong credential, logged with the caller's address (at most once a second per kind of call).
//
// - Node calls (RegisterNode, Heartbeat, WatchEvents, JoinJob, GetPeerTable, LeaveJob,
//   ReportPath, AbortJob from a node): the node's credential is a client certificate that
//   TLS verified (mTLS), else the cluster secret. RegisterNode binds the node's name to the
//   credential that first registered it: with mTLS its certificate's identity, else a random
//   key the coordinator returns in the reply's metadata; while a node of that name is
//   registered, RegisterNode under the name with another credential is refused. Every later
//   call about a node id must carry that id's key.
// - Job calls (GetPeerTable, LeaveJob, ReportPath, AbortJob from a node) also carry the job's
//   token, checked against the token of the job's latest accepted JoinJob (its current
//   generation's; JoinJob itself is checked by the job table).
// - Operator calls (ListJobs, DescribeJob, AbortJob without a node): the operator token.
//
// With no cluster secret, no client certificates and no operator token configured (only
// in-process tests build a coordinator so; gradsync-coordinator refuses to start so) nothing
// is checked.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "common/log.h"
#include "gradsync/status.h"

namespace gradsync::coordinator {

struct AuthzOptions {
  std::string cluster_secret;  // what gradsyncds present without mTLS
  std::string operator_token;  // empty: no operator calls
  bool client_certs = false;   // TLS requires and verifies client certificates
  bool open() const { return cluster_secret.empty() && operator_token.empty() && !client_certs; }
};

class Authorizer {
 public:
  explicit Authorizer(AuthzOptions o) : o_(std::move(o)) {}
  bool open() const { return o_.open(); }

  // RegisterNode of a node named `name` (as the job table names it). `alive(node_id)`: whether
  // that node is still registered. On success, the key to send back (kNodeKeyHeader); call
  // bound() with the id the table gave.
  Result<std::string> admit_node(const grpc::ServerContextBase& ctx, const std::string& name,
                                 const std::function<bool(const std::string&)>& alive);
  void bound(const std::string& name, const std::string& node_id, const std::string& key);
  // The table removed node `node_id` (lost, replaced): its key goes; its name is freed when
  // it is registered again (admit_node finds the holder gone).
  void forget(const std::string& node_id);
  // A call of node `node_id` (empty: the id in the call's kNodeIdHeader), with its key.
  Status node_call(const grpc::ServerContextBase& ctx, const std::string& node_id, const char* what);
  // A node call about `job`: the node's credential and the job's token.
  Status job_call(const grpc::ServerContextBase& ctx, const std::string& node_id, const std::string& job,
                  const char* what);
  // JoinJob accepted `token` for `job` (its current generation's): later job calls must carry it.
  void job_token(const std::string& job, const std::string& token);
  Status operator_call(const grpc::ServerContextBase& ctx, const char* what);
  // The node id a call names in its metadata ("" when none).
  static std::string node_id_of(const grpc::ServerContextBase& ctx);

 private:
  // The credential of a node call: "" without one. With mTLS the certificate's identity, else
  // "cluster secret" when the secret matches.
  std::string node_credential(const grpc::ServerContextBase& ctx) const;
  Status refuse(const grpc::ServerContextBase& ctx, const char* what, const std::string& why);

  struct Binding {
    std::string credential;  // mTLS identity, or "" (the key is the credential)
    std::string key;
    std::string node_id;
  };
  const AuthzOptions o_;
  std::mutex mu_;
  std::map<std::string, Binding> names_;          // node name -> who holds it
  std::map<std::string, std::string> keys_;       // node id -> its key
  std::map<std::string, std::string> job_tokens_; // job id -> its token
  std::map<std::string, log::RateLimit> refusals_;  // per kind of call
};

}  // namespace gradsync::coordinator
