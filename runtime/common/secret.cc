#include "common/secret.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>

#include "common/fd.h"

namespace gradsync {

bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  return a.empty() || CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

Status random_bytes(void* out, size_t len) {
  if (RAND_bytes(static_cast<unsigned char*>(out), static_cast<int>(len)) != 1) {
    return {Code::kInternal, "RAND_bytes failed (OpenSSL error " + std::to_string(ERR_get_error()) + ")"};
  }
  return Status::Ok();
}

Result<std::string> random_token() {
  unsigned char bytes[16];
  GS_RETURN_IF_ERROR(random_bytes(bytes, sizeof(bytes)));
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += kDigits[b >> 4];
    out += kDigits[b & 0xfu];
  }
  OPENSSL_cleanse(bytes, sizeof(bytes));
  return out;
}

Result<std::string> read_token_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status(Code::kInvalidArgument, errno_string(("token file " + path).c_str()));
  if (st.st_mode & S_IROTH) {
    return Status(Code::kPermissionDenied, "token file " + path +
                                               " is readable by every user: chmod o-r it (or 600) first");
  }
  std::ifstream f(path);
  std::string token;
  if (!f || !std::getline(f, token)) return Status(Code::kInvalidArgument, "cannot read token file " + path);
  if (!token.empty() && token.back() == '\r') token.pop_back();
  if (token.empty()) return Status(Code::kInvalidArgument, "token file " + path + " starts with an empty line");
  return token;
}

Result<std::string> token_from(const std::string& token_file) {
  if (!token_file.empty()) return read_token_file(token_file);
  const char* env = std::getenv("GRADSYNC_JOB_TOKEN");
  return std::string(env != nullptr ? env : "");
}

Mac hmac_sha256(const std::string& key, const void* data, size_t len) {
  Mac out{};
  unsigned int n = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), static_cast<const unsigned char*>(data), len,
       out.data(), &n);
  return out;
}

bool same_mac(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

}  // namespace gradsync
