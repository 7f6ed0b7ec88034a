// libFuzzer target: the accepting side of the data port's handshake (daemon/proxy.h), as
// gradsyncd's serve_peer runs it before any job is looked at: read the Hello, send a
// challenge, read the proof, check it against a token.
#include <cstddef>
#include <cstdint>

#include "daemon/proxy.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto fed = gradsync::fuzz::feed(data, size);
  if (!fed.reader.valid()) return 0;
  const auto deadline = gradsync::deadline_after(std::chrono::seconds(1));
  auto hello = gradsync::proxy_read_hello(fed.reader.get(), deadline);
  if (!hello.ok()) return 0;
  auto challenge = gradsync::hello_challenge(fed.reader.get());
  if (!challenge.ok()) return 0;
  auto proof = gradsync::hello_read_proof(fed.reader.get(), deadline);
  if (!proof.ok()) return 0;
  const auto want = gradsync::hello_proof("fuzz-token", *hello, *challenge, gradsync::HelloRole::kConnector);
  // A random challenge: a matching proof means the MAC check is broken.
  if (gradsync::same_mac(*proof, want)) __builtin_trap();
  return 0;
}
