#include "coordinator/authz.h"

#include "common/call_auth.h"
#include "common/secret.h"

namespace gradsync::coordinator {
namespace {

// The value of request header `name`, or "".
std::string header(const grpc::ServerContextBase& ctx, const char* name) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(name);
  if (it == md.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

// The identity TLS verified in the client's certificate ("" without one): its subject
// alternative names, else its common name.
std::string certificate_identity(const grpc::ServerContextBase& ctx) {
  auto auth = ctx.auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) return "";
  std::string id;
  for (const auto& v : auth->GetPeerIdentity()) {
    if (!id.empty()) id += ",";
    id.append(v.data(), v.size());
  }
  return id;
}

}  // namespace

std::string Authorizer::node_id_of(const grpc::ServerContextBase& ctx) { return header(ctx, kNodeIdHeader); }

Status Authorizer::refuse(const grpc::ServerContextBase& ctx, const char* what, const std::string& why) {
  uint64_t held = 0;
  bool log_it;
  {
    std::lock_guard lock(mu_);
    log_it = refusals_[what].allow(&held);
  }
  if (log_it) {
    log::get("coordinator")
        ->warn("refused {} from {}: {}{}", what, ctx.peer(), why,
               held ? " (" + std::to_string(held) + " more refusals of it not logged)" : "");
  }
  return {Code::kPermissionDenied, std::string(what) + " refused: " + why};
}

std::string Authorizer::node_credential(const grpc::ServerContextBase& ctx) const {
  if (o_.client_certs) return certificate_identity(ctx);
  if (o_.cluster_secret.empty()) return "";
  return same_secret(header(ctx, kClusterSecretHeader), o_.cluster_secret) ? "cluster secret" : "";
}

Result<std::string> Authorizer::admit_node(const grpc::ServerContextBase& ctx, const std::string& name,
                                           const std::function<bool(const std::string&)>& alive) {
  if (o_.open()) return std::string();
  const std::string cred = node_credential(ctx);
  if (cred.empty()) {
    return refuse(ctx, "RegisterNode",
                  "node " + name + " presents no valid node credential (a client certificate with mTLS, else "
                                   "the cluster secret: --cluster-secret-file or $GRADSYNC_CLUSTER_SECRET)");
  }
  const std::string presented_key = header(ctx, kNodeKeyHeader);
  std::string held_by;  // the node holding the name, when the caller may not take it
  {
    std::lock_guard lock(mu_);
    auto it = names_.find(name);
    // The name's holder is gone (lost, left, replaced): the name is free again. Only this name
    // is looked at, so a registration costs O(log nodes), not a pass over every node. (No node
    // id: its RegisterNode failed after admit_node; the service holds its lock over both.)
    if (it != names_.end() && (it->second.node_id.empty() || !alive(it->second.node_id))) {
      keys_.erase(it->second.node_id);
      names_.erase(it);
      it = names_.end();
    }
    if (it == names_.end()) {
      auto key = random_token();
      if (!key.ok()) return key.status();
      names_[name] = Binding{o_.client_certs ? cred : "", *key, ""};
      return *key;
    }
    // With mTLS the certificate is the node (a restarted daemon presents it again); else only
    // the holder of the key this coordinator gave the name's registrant.
    const bool same = o_.client_certs ? it->second.credential == cred : same_secret(presented_key, it->second.key);
    if (same) return it->second.key;
    held_by = it->second.node_id;
  }
  return refuse(ctx, "RegisterNode",
                "the node name " + name + " belongs to node " + held_by +
                    ", registered with another credential; a node cannot register as another (without mTLS a "
                    "restarted gradsyncd gets its name back once the old registration's lease expired)");
}

void Authorizer::forget(const std::string& node_id) {
  if (o_.open()) return;
  std::lock_guard lock(mu_);
  keys_.erase(node_id);
}

void Authorizer::bound(const std::string& name, const std::string& node_id, const std::string& key) {
  if (o_.open()) return;
  std::lock_guard lock(mu_);
  names_[name].node_id = node_id;
  if (!key.empty()) names_[name].key = key;  // also when restored from the store (service restore())
  keys_[node_id] = key;
}

Status Authorizer::node_call(const grpc::ServerContextBase& ctx, const std::string& node_id, const char* what) {
  if (o_.open()) return Status::Ok();
  if (node_credential(ctx).empty()) {
    return refuse(ctx, what, "no valid node credential (a client certificate with mTLS, else the cluster secret)");
  }
  const std::string id = node_id.empty() ? node_id_of(ctx) : node_id;
  std::string want;
  {
    std::lock_guard lock(mu_);
    auto it = keys_.find(id);
    if (it == keys_.end()) return Status::Ok();  // not registered: the table answers NOT_FOUND
    want = it->second;
  }
  if (!same_secret(header(ctx, kNodeKeyHeader), want)) {
    return refuse(ctx, what, "the call is about node " + id + " but does not carry that node's key");
  }
  return Status::Ok();
}

void Authorizer::job_token(const std::string& job, const std::string& token) {
  if (o_.open()) return;
  std::lock_guard lock(mu_);
  job_tokens_[job] = token;  // accepted: the current generation's token
}

Status Authorizer::job_call(const grpc::ServerContextBase& ctx, const std::string& node_id, const std::string& job,
                            const char* what) {
  GS_RETURN_IF_ERROR(node_call(ctx, node_id, what));
  std::string want;
  {
    std::lock_guard lock(mu_);
    auto it = job_tokens_.find(job);
    if (it == job_tokens_.end()) return Status::Ok();  // no such job: the table answers NOT_FOUND
    want = it->second;
  }
  if (!same_secret(header(ctx, kJobTokenHeader), want)) {
    return refuse(ctx, what, "the call about job " + job + " does not carry the job's token");
  }
  return Status::Ok();
}

Status Authorizer::operator_call(const grpc::ServerContextBase& ctx, const char* what) {
  if (o_.open()) return Status::Ok();
  if (o_.operator_token.empty()) {
    return refuse(ctx, what, "this coordinator has no operator credential configured (--operator-token-file)");
  }
  const std::string got = header(ctx, kOperatorTokenHeader);
  if (got.empty() || !same_secret(got, o_.operator_token)) {
    return refuse(ctx, what,
                  got.empty() ? "no operator credential (--operator-token-file or $GRADSYNC_OPERATOR_TOKEN)"
                              : "wrong operator credential");
  }
  return Status::Ok();
}

}  // namespace gradsync::coordinator
