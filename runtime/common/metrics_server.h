// The /metrics endpoint of gradsyncd and gradsync-coordinator (--metrics-listen HOST:PORT,
// off by default), served by civetweb (Debian's libcivetweb-dev): every GET renders the text
// anew through the callback. Anything else is 404.
#pragma once

#include <functional>
#include <string>

#include "gradsync/status.h"

struct mg_context;

namespace gradsync {

class MetricsServer {
 public:
  using Render = std::function<std::string()>;
  MetricsServer() = default;
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // `listen`: "HOST:PORT" (IPv4), "[V6]:PORT", or ":PORT"/"PORT" for every address; port 0
  // picks a free one (port() says which).
  Status start(const std::string& listen, Render render);
  void stop();
  int port() const { return port_; }
  // "http://HOST:PORT/metrics" as started.
  std::string url() const;

  // Called by civetweb's threads.
  int serve(void* conn);

 private:
  mg_context* ctx_ = nullptr;
  Render render_;
  std::string host_;
  int port_ = 0;
};

}  // namespace gradsync
