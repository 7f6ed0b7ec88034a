// What a standby coordinator serves while another one leads (coordinator/election.h): every
// call, whatever its method, is answered UNAVAILABLE with a message that names the leader,
// "... standby; the leader is HOST:PORT ...", so daemons (coordinator_link) and gradsyncctl
// move to it. It listens on the address the coordinator will serve from once elected.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "common/call_auth.h"  // kLeaderIsPhrase
#include "common/grpc_security.h"
#include "gradsync/status.h"

namespace grpc {
class Server;
class CallbackGenericService;
}  // namespace grpc

namespace gradsync::coordinator {

class StandbyServer {
 public:
  StandbyServer(std::string me, std::string etcd_address);
  ~StandbyServer();
  Status start(const std::string& listen_addr, const TlsOptions& tls);
  void set_leader(const std::string& leader);  // "" when none
  void shutdown();  // ends calls and closes the port; idempotent

 private:
  class Service;
  const std::string me_;
  const std::string etcd_;
  std::shared_ptr<std::string> leader_;  // read by the service under mu_
  std::shared_ptr<std::mutex> mu_;
  std::unique_ptr<grpc::CallbackGenericService> service_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace gradsync::coordinator
