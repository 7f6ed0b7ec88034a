#include "common/grpc_security.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <cstdlib>
#include <fstream>

#include "common/log.h"

namespace gradsync {
namespace {

// How often watched certificate files are looked at again.
constexpr unsigned kCertRefreshSeconds = 5;

Status readable(const std::string& flag, const std::string& path) {
  std::ifstream f(path);
  if (!f) return {Code::kInvalidArgument, flag + " " + path + ": cannot read it"};
  return Status::Ok();
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

}  // namespace

bool is_loopback_address(const std::string& hostport) {
  // A list "a:1,b:2" (several coordinators) is loopback only when every entry is.
  if (const size_t comma = hostport.find(','); comma != std::string::npos) {
    return is_loopback_address(hostport.substr(0, comma)) && is_loopback_address(hostport.substr(comma + 1));
  }
  return hostport.rfind("127.", 0) == 0 || hostport.rfind("localhost:", 0) == 0 || hostport == "localhost" ||
         hostport.rfind("[::1]", 0) == 0;
}

void TlsOptions::add_env() {
  auto take = [](std::string& field, const char* name) {
    const char* v = std::getenv(name);
    if (field.empty() && v != nullptr) field = v;
  };
  take(cert_file, "GRADSYNC_TLS_CERT");
  take(key_file, "GRADSYNC_TLS_KEY");
  take(ca_file, "GRADSYNC_TLS_CA");
  require_client_cert = require_client_cert || env_flag("GRADSYNC_REQUIRE_CLIENT_CERT");
  insecure = insecure || env_flag("GRADSYNC_INSECURE");
}

bool TlsOptions::take_flag(int argc, char** argv, int* i, std::string* error) {
  const std::string a = argv[*i];
  if (a == "--require-client-cert") return require_client_cert = true;
  if (a == "--insecure") return insecure = true;
  std::string* field = a == "--tls-cert" ? &cert_file : a == "--tls-key" ? &key_file : a == "--tls-ca" ? &ca_file : nullptr;
  if (field == nullptr) return false;
  if (*i + 1 >= argc) {
    *error = a + " needs a file";
    return true;
  }
  *field = argv[++*i];
  return true;
}

const char* TlsOptions::usage() {
  return "  --tls-cert FILE           certificate chain (PEM) of this side ($GRADSYNC_TLS_CERT)\n"
         "  --tls-key FILE            its private key ($GRADSYNC_TLS_KEY)\n"
         "  --tls-ca FILE             roots that sign the other side ($GRADSYNC_TLS_CA); files are\n"
         "                            reloaded when they change\n"
         "  --require-client-cert     coordinator: refuse clients without a certificate signed by\n"
         "                            --tls-ca ($GRADSYNC_REQUIRE_CLIENT_CERT=1)\n"
         "  --insecure                allow plaintext gRPC off loopback ($GRADSYNC_INSECURE=1)\n";
}

Result<std::shared_ptr<grpc::ServerCredentials>> server_credentials(const TlsOptions& tls, const std::string& listen) {
  auto log = log::get("tls");
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return Status(Code::kInvalidArgument, "--tls-cert and --tls-key go together");
  }
  if (tls.require_client_cert && tls.ca_file.empty()) {
    return Status(Code::kInvalidArgument, "--require-client-cert needs --tls-ca (the roots client certificates are checked against)");
  }
  if (tls.cert_file.empty()) {
    if (is_loopback_address(listen)) return grpc::InsecureServerCredentials();
    if (!tls.insecure) {
      return Status(Code::kFailedPrecondition,
                    "refusing to serve plaintext gRPC on " + listen +
                        ": anyone on the network could read and forge every call; give --tls-cert and --tls-key "
                        "(and --tls-ca --require-client-cert), or --insecure to accept that");
    }
    log->warn("serving plaintext gRPC on {} (--insecure): calls can be read and forged on the network", listen);
    return grpc::InsecureServerCredentials();
  }
  GS_RETURN_IF_ERROR(readable("--tls-cert", tls.cert_file));
  GS_RETURN_IF_ERROR(readable("--tls-key", tls.key_file));
  if (!tls.ca_file.empty()) GS_RETURN_IF_ERROR(readable("--tls-ca", tls.ca_file));
  auto provider = tls.ca_file.empty()
                      ? std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                            tls.key_file, tls.cert_file, kCertRefreshSeconds)
                      : std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                            tls.key_file, tls.cert_file, tls.ca_file, kCertRefreshSeconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (!tls.ca_file.empty()) options.watch_root_certs();
  options.set_cert_request_type(tls.require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                : tls.ca_file.empty()    ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                         : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  log->info("serving TLS on {} (certificate {}, client certificates {}; files reloaded when they change)", listen,
            tls.cert_file, tls.require_client_cert ? "required" : tls.ca_file.empty() ? "not asked for" : "checked if sent");
  return grpc::experimental::TlsServerCredentials(options);
}

Result<std::shared_ptr<grpc::ChannelCredentials>> channel_credentials(const TlsOptions& tls, const std::string& target) {
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return Status(Code::kInvalidArgument, "--tls-cert and --tls-key go together");
  }
  if (tls.ca_file.empty()) {
    if (!tls.cert_file.empty()) {
      return Status(Code::kInvalidArgument, "--tls-cert without --tls-ca: give the roots that sign the coordinator's certificate");
    }
    if (is_loopback_address(target)) return grpc::InsecureChannelCredentials();
    if (!tls.insecure) {
      return Status(Code::kFailedPrecondition,
                    "refusing to talk plaintext gRPC to the coordinator at " + target +
                        ": give --tls-ca (and --tls-cert/--tls-key where it requires client certificates), or "
                        "--insecure to accept that calls and tokens can be read on the network");
    }
    log::get("tls")->warn("plaintext gRPC to {} (--insecure): calls and job tokens can be read on the network", target);
    return grpc::InsecureChannelCredentials();
  }
  GS_RETURN_IF_ERROR(readable("--tls-ca", tls.ca_file));
  std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> provider;
  if (tls.cert_file.empty()) {
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(tls.ca_file, kCertRefreshSeconds);
  } else {
    GS_RETURN_IF_ERROR(readable("--tls-cert", tls.cert_file));
    GS_RETURN_IF_ERROR(readable("--tls-key", tls.key_file));
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(tls.key_file, tls.cert_file,
                                                                                     tls.ca_file, kCertRefreshSeconds);
  }
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider);
  options.watch_root_certs();
  if (!tls.cert_file.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  return grpc::experimental::TlsCredentials(options);
}

}  // namespace gradsync
