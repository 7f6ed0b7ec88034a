// A memfd-backed shared-memory region: created by the daemon, handed to trainers with
// SCM_RIGHTS, mapped by both.
#pragma once

#include <cstddef>
#include <string>

#include "common/fd.h"

namespace gradsync {

class SharedMemory {
 public:
  SharedMemory() = default;
  ~SharedMemory();
  SharedMemory(SharedMemory&& other) noexcept;
  SharedMemory& operator=(SharedMemory&& other) noexcept;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  // A new zero-filled region of `bytes`, sealed against resizing (F_SEAL_SHRINK|F_SEAL_GROW):
  // a process it is passed to cannot pull memory out from under the creator.
  static Result<SharedMemory> create(const std::string& name, size_t bytes);
  // Maps a region received from another process; checks its size first. `populate` faults
  // every page in now (MAP_POPULATE), so the first collectives do not pay page faults on
  // slots they touch for the first time.
  static Result<SharedMemory> map(Fd fd, size_t bytes, bool populate = false);

  void* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_.get(); }

 private:
  Fd fd_;
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace gradsync
