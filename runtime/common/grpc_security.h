// TLS for the gRPC links to the coordinator (daemons, gradsyncctl, the coordinator itself):
// the same flags and environment everywhere, certificate files watched and reloaded when they
// change (gRPC's FileWatcherCertificateProvider), and plaintext only where nobody else can
// listen (loopback) or where asked for by name (--insecure, with a warning).
#pragma once

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "gradsync/status.h"

namespace gradsync {

struct TlsOptions {
  std::string cert_file;             // --tls-cert / GRADSYNC_TLS_CERT: this side's certificate chain
  std::string key_file;              // --tls-key / GRADSYNC_TLS_KEY: its private key
  std::string ca_file;               // --tls-ca / GRADSYNC_TLS_CA: roots that sign the other side
  bool require_client_cert = false;  // --require-client-cert / GRADSYNC_REQUIRE_CLIENT_CERT=1 (server)
  bool insecure = false;             // --insecure / GRADSYNC_INSECURE=1: plaintext off loopback

  // Fills what the flags left unset from the environment.
  void add_env();
  // Takes argv[*i] (and its value) when it is one of the flags above; `*error` when its value
  // is missing. False when argv[*i] is not one of them.
  bool take_flag(int argc, char** argv, int* i, std::string* error);
  // The flags' lines for a usage text.
  static const char* usage();
};

// How the coordinator serves `listen` ("HOST:PORT"): TLS when a certificate and key are
// given (clients must present a certificate signed by --tls-ca with --require-client-cert),
// plaintext on loopback or with --insecure (logged), else an error saying what to give.
Result<std::shared_ptr<grpc::ServerCredentials>> server_credentials(const TlsOptions& tls, const std::string& listen);

// How a client reaches the coordinator at `target`: TLS when --tls-ca is given (with this
// side's certificate when --tls-cert/--tls-key are), plaintext on loopback or with --insecure.
Result<std::shared_ptr<grpc::ChannelCredentials>> channel_credentials(const TlsOptions& tls, const std::string& target);

// "127.0.0.1:5", "localhost:5", "[::1]:5".
bool is_loopback_address(const std::string& hostport);

}  // namespace gradsync
