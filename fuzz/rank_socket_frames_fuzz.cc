// libFuzzer target: the frame reader of a channel's TCP connection as a rank runs it
// (transport/tcp/socket_driver.h; the same frames the proxy pumps): SlotMeta + payload, read
// straight into the slots of the rank's incoming channel, consumed as a collective would.
#include <cstddef>
#include <cstdint>

#include "fuzz_input.h"
#include "transport/tcp/socket_driver.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static gradsync::fuzz::Region region(2, 4096);
  if (!region.shm) return 0;
  auto fed = gradsync::fuzz::feed(data, size);
  if (!fed.reader.valid()) return 0;
  gradsync::init_job_control(region.shm->data(), region.layout);
  gradsync::Channel recv(region.shm->data(), region.layout, 0);
  gradsync::SocketDriver driver("job=fuzz rank 1 (host b)");
  driver.add_receiver(recv, std::move(fed.reader), "rank 0 (host a)");
  recv.set_driver(&driver, true);
  gradsync::WaitContext wait;
  wait.control = static_cast<const gradsync::JobControl*>(region.shm->data());
  wait.spin = std::chrono::microseconds(0);
  // The whole input is in the socket before the first read, so a wait has nothing to wait
  // for: a deadline already passed makes every read one pass over what is there. (With a
  // future deadline the end of the input, a closed connection, waited up to the driver's
  // 500 ms grace for a job abort: about 250 ms an input.)
  wait.deadline = gradsync::Clock::now();
  for (int i = 0; i < 64; ++i) {
    gradsync::SlotMeta meta{};
    auto slot = recv.acquire_recv(wait, &meta);
    if (!slot.ok()) break;
    if (meta.bytes > region.layout.slot_bytes) __builtin_trap();  // the reader let it through
    uint8_t sum = 0;  // read every payload byte the reader says landed (ASan checks the bounds)
    for (uint32_t b = 0; b < meta.bytes; ++b) sum = static_cast<uint8_t>(sum ^ (*slot)[b]);
    asm volatile("" : : "r"(sum));
    recv.release();
  }
  return 0;
}
