// libFuzzer target: what gradsyncd does with bytes from its trainer socket before a job is
// touched (daemon/trainer_request.h): read a request frame, and check a join's fields.
#include <cstddef>
#include <cstdint>

#include "daemon/trainer_request.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto fed = gradsync::fuzz::feed(data, size);
  if (!fed.reader.valid()) return 0;
  for (int i = 0; i < 64; ++i) {
    gradsync::v1::ClientMessage msg;
    if (!gradsync::read_trainer_request(fed.reader.get(), &msg, gradsync::deadline_after(std::chrono::seconds(1)))
             .ok()) {
      break;
    }
    if (msg.has_join()) (void)gradsync::check_join_request(msg.join(), 1234, "fuzz-host");
  }
  return 0;
}
