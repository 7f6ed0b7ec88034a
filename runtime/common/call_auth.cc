#include "common/call_auth.h"

#include <grpcpp/support/client_interceptor.h>

#include <cstdlib>

#include "common/secret.h"

namespace gradsync {
namespace {

Result<std::string> secret_from(const std::string& file, const char* env) {
  if (!file.empty()) return read_token_file(file);
  const char* v = std::getenv(env);
  return std::string(v != nullptr ? v : "");
}

class AuthInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit AuthInterceptor(std::shared_ptr<const CallAuth> auth) : auth_(std::move(auth)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      auto* md = methods->GetSendInitialMetadata();
      for (auto& [k, v] : auth_->headers()) md->emplace(k, v);
    }
    methods->Proceed();
  }

 private:
  std::shared_ptr<const CallAuth> auth_;
};

class AuthInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit AuthInterceptorFactory(std::shared_ptr<const CallAuth> auth) : auth_(std::move(auth)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new AuthInterceptor(auth_);
  }

 private:
  std::shared_ptr<const CallAuth> auth_;
};

}  // namespace

bool AuthOptions::take_flag(int argc, char** argv, int* i, std::string* error) {
  const std::string a = argv[*i];
  std::string* field = a == "--cluster-secret-file"   ? &cluster_secret_file
                       : a == "--operator-token-file" ? &operator_token_file
                                                      : nullptr;
  if (field == nullptr) return false;
  if (*i + 1 >= argc) {
    *error = a + " needs a file";
    return true;
  }
  *field = argv[++*i];
  return true;
}

Result<std::string> AuthOptions::cluster_secret() const {
  return secret_from(cluster_secret_file, "GRADSYNC_CLUSTER_SECRET");
}

Result<std::string> AuthOptions::operator_token() const {
  return secret_from(operator_token_file, "GRADSYNC_OPERATOR_TOKEN");
}

const char* AuthOptions::usage() {
  return "  --cluster-secret-file F   the secret every gradsyncd proves to the coordinator, first line\n"
         "                            of F ($GRADSYNC_CLUSTER_SECRET); not needed with mTLS\n"
         "  --operator-token-file F   the operator credential for jobs/describe/abort\n"
         "                            ($GRADSYNC_OPERATOR_TOKEN)\n";
}

void CallAuth::set_node(const std::string& id, const std::string& key) {
  std::lock_guard lock(mu_);
  node_id_ = id;
  node_key_ = key;
}

std::string CallAuth::node_key() const {
  std::lock_guard lock(mu_);
  return node_key_;
}

std::multimap<std::string, std::string> CallAuth::headers() const {
  std::multimap<std::string, std::string> h;
  if (!cluster_secret_.empty()) h.emplace(kClusterSecretHeader, cluster_secret_);
  if (!operator_token_.empty()) h.emplace(kOperatorTokenHeader, operator_token_);
  std::lock_guard lock(mu_);
  if (!node_id_.empty()) h.emplace(kNodeIdHeader, node_id_);
  if (!node_key_.empty()) h.emplace(kNodeKeyHeader, node_key_);
  return h;
}

void CallAuth::set_job_token(const std::string& job, const std::string& token) {
  std::lock_guard lock(mu_);
  job_tokens_[job] = token;
}

void CallAuth::add_job_token(grpc::ClientContext& ctx, const std::string& job) const {
  std::lock_guard lock(mu_);
  auto it = job_tokens_.find(job);
  if (it != job_tokens_.end() && !it->second.empty()) ctx.AddMetadata(kJobTokenHeader, it->second);
}

std::shared_ptr<grpc::Channel> coordinator_channel(const std::string& target,
                                                   std::shared_ptr<grpc::ChannelCredentials> credentials,
                                                   const grpc::ChannelArguments& args,
                                                   std::shared_ptr<const CallAuth> auth) {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<AuthInterceptorFactory>(std::move(auth)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, credentials, args, std::move(interceptors));
}

}  // namespace gradsync
