#include "coordinator/standby_server.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include "common/log.h"
#include "coordinator/service.h"

namespace gradsync::coordinator {

// Finishes every call at once, before reading anything.
class StandbyServer::Service final : public grpc::CallbackGenericService {
 public:
  Service(const StandbyServer* owner) : owner_(owner) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    class Refuse final : public grpc::ServerGenericBidiReactor {
     public:
      explicit Refuse(grpc::Status s) { Finish(std::move(s)); }
      void OnDone() override { delete this; }
    };
    std::string leader;
    {
      std::lock_guard lock(*owner_->mu_);
      leader = *owner_->leader_;
    }
    std::string msg = "coordinator at " + owner_->me_ + " is a standby; ";
    msg += leader.empty() ? std::string("no leader is elected yet (etcd at ") + owner_->etcd_ +
                                "); retry in a moment"
                          : std::string(kLeaderIsPhrase) + leader + " (elected through etcd at " + owner_->etcd_ + ")";
    return new Refuse(grpc::Status(grpc::StatusCode::UNAVAILABLE, msg + " [" + ctx->method() + "]"));
  }

 private:
  const StandbyServer* const owner_;
};

StandbyServer::StandbyServer(std::string me, std::string etcd_address)
    : me_(std::move(me)), etcd_(std::move(etcd_address)), leader_(std::make_shared<std::string>()),
      mu_(std::make_shared<std::mutex>()) {}

StandbyServer::~StandbyServer() { shutdown(); }

Status StandbyServer::start(const std::string& listen_addr, const TlsOptions& tls) {
  auto credentials = server_credentials(tls, listen_addr);
  if (!credentials.ok()) return credentials.status();
  service_ = std::make_unique<Service>(this);
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // gradsyncd pings every second, also a standby it asked for the leader once: refused, its
  // pings would end in a GOAWAY ("too_many_pings") and gRPC would halve their rate on that
  // channel, which this coordinator may later serve as the leader.
  set_keepalive_policy(builder);
  int port = 0;
  builder.AddListeningPort(listen_addr, *credentials, &port);
  builder.RegisterCallbackGenericService(service_.get());
  server_ = builder.BuildAndStart();
  if (!server_ || port == 0) {
    server_.reset();
    return {Code::kUnavailable, "standby coordinator cannot listen on '" + listen_addr +
                                    "': the port is in use or the address is not this machine's"};
  }
  log::get("coordinator")->info("standby on {}: answering UNAVAILABLE with the leader's address", listen_addr);
  return Status::Ok();
}

void StandbyServer::set_leader(const std::string& leader) {
  std::lock_guard lock(*mu_);
  *leader_ = leader;
}

void StandbyServer::shutdown() {
  if (!server_) return;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  server_->Wait();
  server_.reset();
}

}  // namespace gradsync::coordinator
