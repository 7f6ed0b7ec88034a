// libFuzzer target: the length-prefixed protobuf frame reader (common/framing.h), as both
// ends of the trainer socket use it, reading frames until the input ends or is refused.
#include <cstddef>
#include <cstdint>

#include "common/framing.h"
#include "daemon.pb.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto fed = gradsync::fuzz::feed(data, size);
  if (!fed.reader.valid()) return 0;
  for (int i = 0; i < 64; ++i) {
    gradsync::v1::DaemonMessage msg;
    std::vector<gradsync::Fd> fds;
    if (!gradsync::recv_frame(fed.reader.get(), &msg, gradsync::deadline_after(std::chrono::seconds(1)), &fds).ok()) {
      break;
    }
  }
  return 0;
}
