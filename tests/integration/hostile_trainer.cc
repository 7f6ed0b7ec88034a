// A trainer that attacks its own gradsyncd through what a trainer may touch: the job's shared
// memory (tests/integration/trainer_attack_test.cc). It joins like allreduce_worker's rawjoin
// (launcher environment, the daemon protocol directly), then:
//   shrink    ftruncate()s the region to half its size: prints "SHRINK-REFUSED: why" when the
//             kernel refuses (the region is sealed), "SHRINK-DONE" otherwise
//   grow      the same with twice the size ("GROW-REFUSED" / "GROW-DONE")
//   bigslot   once stdin closes (the test's word that the other ranks joined), publishes a
//             slot claiming 2 GiB of payload on a channel the daemon pumps to another node,
//             then waits up to 20 s for the job's abort flag and prints "ABORTED: reason" (or
//             "NOT-ABORTED")
// Then it holds the connection until stdin closes, so the test decides when it goes.
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "channel/channel.h"
#include "channel/shared_memory.h"
#include "raw_join.h"

namespace {

using gradsync::Fd;

int resize(int fd, off_t bytes, const char* what) {
  if (::ftruncate(fd, bytes) != 0) {
    std::printf("%s-REFUSED: %s\n", what, std::strerror(errno));
    return 0;
  }
  std::printf("%s-DONE\n", what);
  return 1;
}

int big_slot(Fd shm_fd, const gradsync::wire::ChannelSetup& setup) {
  gradsync::ShmLayout layout;
  layout.num_channels = setup.num_channels;
  layout.slots = setup.slots;
  layout.slot_bytes = setup.slot_bytes;
  auto shm = gradsync::SharedMemory::map(std::move(shm_fd), setup.shm_bytes);
  if (!shm.ok()) {
    std::fprintf(stderr, "map: %s\n", shm.status().to_string().c_str());
    return 1;
  }
  int pumped = -1;
  for (const auto& ref : setup.channels) {
    if (ref.send && ref.remote && ref.socket == 0) pumped = static_cast<int>(ref.index);
  }
  if (pumped < 0) {
    std::fprintf(stderr, "no channel of this rank is pumped by gradsyncd (start it with --proxy-tcp)\n");
    return 1;
  }
  char c;
  while (std::fread(&c, 1, 1, stdin) == 1) {}
  gradsync::Channel ch(shm->data(), layout, static_cast<uint32_t>(pumped));
  gradsync::WaitContext wait;
  wait.deadline = gradsync::deadline_after(std::chrono::seconds(5));
  auto slot = ch.acquire_send(wait);
  if (!slot.ok()) {
    std::fprintf(stderr, "acquire_send: %s\n", slot.status().to_string().c_str());
    return 1;
  }
  gradsync::SlotMeta meta{};
  meta.bytes = 2u << 30;  // far past the slot, and past the whole region
  meta.count = 1;
  ch.publish(meta);
  std::printf("PUBLISHED bytes=%u on channel %d\n", meta.bytes, pumped);
  auto* control = static_cast<const gradsync::JobControl*>(shm->data());
  for (int i = 0; i < 2000; ++i) {
    if (control->aborted.load(std::memory_order_acquire)) {
      std::printf("ABORTED: %.*s\n", static_cast<int>(::strnlen(control->reason, sizeof(control->reason))),
                  control->reason);
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::printf("NOT-ABORTED\n");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: hostile_trainer shrink|grow|bigslot\n");
    return 2;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string mode = argv[1];
  auto joined = gradsync::testing::raw_join();
  if (!joined) return 1;
  const auto& setup = joined->join.setup;
  int rc = 2;
  if (mode == "shrink") rc = resize(joined->shm.get(), static_cast<off_t>(setup.shm_bytes / 2), "SHRINK");
  else if (mode == "grow") rc = resize(joined->shm.get(), static_cast<off_t>(setup.shm_bytes * 2), "GROW");
  else if (mode == "bigslot") rc = big_slot(std::move(joined->shm), setup);
  char c;
  while (std::fread(&c, 1, 1, stdin) == 1) {}
  return rc;
}
