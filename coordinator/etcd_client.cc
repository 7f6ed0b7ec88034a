#include "coordinator/etcd_client.h"

namespace gradsync::coordinator {

Result<EtcdUrl> EtcdUrl::parse(const std::string& url) {
  const std::string scheme = "etcd://";
  if (url.rfind(scheme, 0) != 0) {
    return Status(Code::kInvalidArgument, "store '" + url + "': expected etcd://HOST:PORT[/PREFIX]");
  }
  std::string rest = url.substr(scheme.size());
  EtcdUrl out;
  const size_t slash = rest.find('/');
  out.address = rest.substr(0, slash);
  out.prefix = slash == std::string::npos ? "/gradsync" : rest.substr(slash);
  while (out.prefix.size() > 1 && out.prefix.back() == '/') out.prefix.pop_back();
  const size_t colon = out.address.rfind(':');
  if (out.address.empty() || colon == std::string::npos || colon == 0 || colon + 1 == out.address.size()) {
    return Status(Code::kInvalidArgument, "store '" + url + "': etcd's address must be HOST:PORT");
  }
  if (out.prefix.size() < 2) {
    return Status(Code::kInvalidArgument, "store '" + url + "': the key prefix must not be empty");
  }
  return out;
}

std::string prefix_end(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

EtcdClient::EtcdClient(std::string address, Millis call_timeout) : address_(std::move(address)), timeout_(call_timeout) {
  grpc::ChannelArguments args;
  // etcd restarting or briefly away: reconnect within a second, not gRPC's default backoff.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  // After a failed connection gRPC asks its resolver again, and the DNS resolver answers at most
  // every 30 s by default: the channel then fails calls for seconds after etcd is back.
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 100);
  channel_ = grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args);
  kv_ = etcdserverpb::KV::NewStub(channel_);
  lease_ = etcdserverpb::Lease::NewStub(channel_);
}

void EtcdClient::set_deadline(grpc::ClientContext& ctx) const {
  ctx.set_deadline(std::chrono::system_clock::now() + timeout_);
}

Status EtcdClient::check(const grpc::Status& s, const std::string& what) const {
  if (s.ok()) return Status::Ok();
  std::string msg = "etcd at " + address_ + ": " + what + " failed: " + s.error_message();
  switch (s.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      return {Code::kUnavailable, msg + " (is etcd running there and reachable?)"};
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return {Code::kDeadlineExceeded, msg + " (no answer within " + std::to_string(timeout_.count()) +
                                           " ms: etcd overloaded, or without quorum)"};
    case grpc::StatusCode::INVALID_ARGUMENT:
      return {Code::kInvalidArgument, msg};
    case grpc::StatusCode::NOT_FOUND:
      return {Code::kNotFound, msg};
    default:
      return {Code::kInternal, msg};
  }
}

Result<std::vector<std::pair<std::string, std::string>>> EtcdClient::range_prefix(const std::string& prefix) {
  grpc::ClientContext ctx;
  set_deadline(ctx);
  etcdserverpb::RangeRequest req;
  req.set_key(prefix);
  req.set_range_end(prefix_end(prefix));
  etcdserverpb::RangeResponse resp;
  GS_RETURN_IF_ERROR(check(kv_->Range(&ctx, req, &resp), "Range " + prefix + "*"));
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(resp.kvs_size());
  for (const auto& kv : resp.kvs()) out.emplace_back(kv.key(), kv.value());
  return out;
}

Result<std::optional<mvccpb::KeyValue>> EtcdClient::get(const std::string& key) {
  grpc::ClientContext ctx;
  set_deadline(ctx);
  etcdserverpb::RangeRequest req;
  req.set_key(key);
  etcdserverpb::RangeResponse resp;
  GS_RETURN_IF_ERROR(check(kv_->Range(&ctx, req, &resp), "Range " + key));
  if (resp.kvs_size() == 0) return std::optional<mvccpb::KeyValue>();
  return std::optional<mvccpb::KeyValue>(resp.kvs(0));
}

Status EtcdClient::put(const std::string& key, const std::string& value, int64_t lease) {
  grpc::ClientContext ctx;
  set_deadline(ctx);
  etcdserverpb::PutRequest req;
  req.set_key(key);
  req.set_value(value);
  req.set_lease(lease);
  etcdserverpb::PutResponse resp;
  return check(kv_->Put(&ctx, req, &resp), "Put " + key + " (" + std::to_string(value.size()) + " bytes)");
}

Status EtcdClient::remove(const std::string& key) {
  grpc::ClientContext ctx;
  set_deadline(ctx);
  etcdserverpb::DeleteRangeRequest req;
  req.set_key(key);
  etcdserverpb::DeleteRangeResponse resp;
  return check(kv_->DeleteRange(&ctx, req, &resp), "DeleteRange " + key);
}

Status EtcdClient::remove_prefix(const std::string& prefix) {
  grpc::ClientContext ctx;
  set_deadline(ctx);
  etcdserverpb::DeleteRangeRequest req;
  req.set_key(prefix);
  req.set_range_end(prefix_end(prefix));
  etcdserverpb::DeleteRangeResponse resp;
  return check(kv_->DeleteRange(&ctx, req, &resp), "DeleteRange " + prefix + "*");
}

Result<etcdserverpb::TxnResponse> EtcdClient::txn(const etcdserverpb::TxnRequest& request) {
  grpc::ClientContext ctx;
  set_deadline(ctx);
  etcdserverpb::TxnResponse resp;
  GS_RETURN_IF_ERROR(check(kv_->Txn(&ctx, request, &resp), "Txn"));
  return resp;
}

Result<std::pair<int64_t, int64_t>> EtcdClient::grant(int64_t ttl_seconds) {
  grpc::ClientContext ctx;
  set_deadline(ctx);
  etcdserverpb::LeaseGrantRequest req;
  req.set_ttl(ttl_seconds);
  etcdserverpb::LeaseGrantResponse resp;
  GS_RETURN_IF_ERROR(check(lease_->LeaseGrant(&ctx, req, &resp), "LeaseGrant"));
  if (!resp.error().empty() || resp.id() == 0) {
    return Status(Code::kInternal, "etcd at " + address_ + ": LeaseGrant of " + std::to_string(ttl_seconds) +
                                       " s refused: " + resp.error());
  }
  return std::make_pair(resp.id(), resp.ttl());
}

Result<int64_t> EtcdClient::keep_alive(int64_t lease) {
  grpc::ClientContext ctx;
  set_deadline(ctx);
  auto stream = lease_->LeaseKeepAlive(&ctx);
  etcdserverpb::LeaseKeepAliveRequest req;
  req.set_id(lease);
  etcdserverpb::LeaseKeepAliveResponse resp;
  bool ok = stream->Write(req) && stream->WritesDone() && stream->Read(&resp);
  // The stream ends once we stop writing; drain it so Finish() returns at once.
  etcdserverpb::LeaseKeepAliveResponse extra;
  while (ok && stream->Read(&extra)) {
  }
  grpc::Status s = stream->Finish();
  if (!ok) {
    if (s.ok()) s = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream ended without an answer");
    return check(s, "LeaseKeepAlive of lease " + std::to_string(lease));
  }
  return resp.ttl() > 0 ? resp.ttl() : 0;
}

Status EtcdClient::revoke(int64_t lease) {
  grpc::ClientContext ctx;
  set_deadline(ctx);
  etcdserverpb::LeaseRevokeRequest req;
  req.set_id(lease);
  etcdserverpb::LeaseRevokeResponse resp;
  return check(lease_->LeaseRevoke(&ctx, req, &resp), "LeaseRevoke of lease " + std::to_string(lease));
}

}  // namespace gradsync::coordinator
