#include "common/metrics_server.h"

#include <civetweb.h>

#include <cstring>
#include <mutex>

namespace gradsync {
namespace {

int handle(mg_connection* conn, void* self) { return static_cast<MetricsServer*>(self)->serve(conn); }

// Keeps civetweb's own error text for the start failure.
int log_message(const mg_connection*, const char* message) {
  (void)message;
  return 1;  // handled: civetweb writes nothing to stderr
}

}  // namespace

MetricsServer::~MetricsServer() { stop(); }

Status MetricsServer::start(const std::string& listen, Render render) {
  static std::once_flag init;
  std::call_once(init, [] { mg_init_library(0); });
  render_ = std::move(render);
  // civetweb's listening_ports: "127.0.0.1:9100", "[::1]:9100" (with IPv6 built in), "9100".
  std::string ports = listen;
  if (!ports.empty() && ports[0] == ':') ports = ports.substr(1);
  auto colon = listen.rfind(':');
  host_ = colon == std::string::npos || colon == 0 ? "0.0.0.0" : listen.substr(0, colon);
  const char* options[] = {"listening_ports", ports.c_str(), "num_threads", "2", "request_timeout_ms", "10000",
                           nullptr};
  mg_callbacks callbacks{};
  callbacks.log_message = log_message;
  ctx_ = mg_start(&callbacks, nullptr, options);
  if (ctx_ == nullptr) {
    return {Code::kUnavailable, "cannot serve metrics on '" + listen +
                                    "': the port is in use, or not HOST:PORT with HOST an address of this machine"};
  }
  mg_set_request_handler(ctx_, "/metrics", handle, this);
  mg_server_port bound[4]{};
  if (mg_get_server_ports(ctx_, 4, bound) > 0) port_ = bound[0].port;
  return Status::Ok();
}

void MetricsServer::stop() {
  if (ctx_) mg_stop(ctx_);
  ctx_ = nullptr;
}

std::string MetricsServer::url() const { return "http://" + host_ + ":" + std::to_string(port_) + "/metrics"; }

int MetricsServer::serve(void* c) {
  auto* conn = static_cast<mg_connection*>(c);
  const mg_request_info* req = mg_get_request_info(conn);
  if (req == nullptr || std::strcmp(req->request_method, "GET") != 0) {
    mg_send_http_error(conn, 405, "only GET");
    return 405;
  }
  const std::string body = render_();
  mg_send_http_ok(conn, "text/plain; version=0.0.4; charset=utf-8", static_cast<long long>(body.size()));
  mg_write(conn, body.data(), body.size());
  return 200;
}

}  // namespace gradsync
