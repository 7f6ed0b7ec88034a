// libFuzzer target: the length-prefixed frame reader (common/framing.h), as both ends of the
// trainer socket use it, reading frames until the input ends or is refused; each frame's body
// goes through the library's bounded nanopb decoder (client/daemon_wire.h) and the daemon's
// protobuf parser.
#include <cstddef>
#include <cstdint>

#include "client/daemon_wire.h"
#include "common/framing.h"
#include "daemon.pb.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto fed = gradsync::fuzz::feed(data, size);
  if (!fed.reader.valid()) return 0;
  for (int i = 0; i < 64; ++i) {
    std::string body;
    std::vector<gradsync::Fd> fds;
    if (!gradsync::recv_frame(fed.reader.get(), &body, gradsync::deadline_after(std::chrono::seconds(1)), &fds).ok()) {
      break;
    }
    (void)gradsync::wire::decode(body);
    gradsync::v1::DaemonMessage msg;
    (void)msg.ParseFromString(body);
  }
  return 0;
}
