// Job tokens: where they come from (a file or the environment, never argv; standalone jobs
// make a random one), how they are compared (constant time), and the MAC that proves one
// without sending it. OpenSSL's libcrypto does the cryptography.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "gradsync/status.h"

namespace gradsync {

// Equal contents, in time that does not depend on where they differ (CRYPTO_memcmp). The
// lengths are compared first: a token's length is not a secret.
bool same_secret(const std::string& a, const std::string& b);

// `len` bytes from OpenSSL's CSPRNG (RAND_bytes).
Status random_bytes(void* out, size_t len);

// 16 random bytes (RAND_bytes) as 32 hex digits.
Result<std::string> random_token();

// The token in `path`: its first line, without the line end. Refused when the file is empty
// or other users can read it.
Result<std::string> read_token_file(const std::string& path);

// The token from --token-file when given, else $GRADSYNC_JOB_TOKEN, else "".
Result<std::string> token_from(const std::string& token_file);

using Mac = std::array<uint8_t, 32>;
// HMAC-SHA256 of `data` under `key`.
Mac hmac_sha256(const std::string& key, const void* data, size_t len);
// Equal MACs, in constant time.
bool same_mac(const Mac& a, const Mac& b);

}  // namespace gradsync
