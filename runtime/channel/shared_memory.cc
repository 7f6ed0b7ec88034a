#include "channel/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <utility>

namespace gradsync {

SharedMemory::~SharedMemory() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

SharedMemory::SharedMemory(SharedMemory&& other) noexcept
    : fd_(std::move(other.fd_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

SharedMemory& SharedMemory::operator=(SharedMemory&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(data_, size_);
    fd_ = std::move(other.fd_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Result<SharedMemory> SharedMemory::create(const std::string& name, size_t bytes) {
  Fd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return Status(Code::kInternal, errno_string("memfd_create"));
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return Status(Code::kInternal, errno_string("ftruncate of shared memory"));
  }
  // Whoever receives the descriptor can write the region but not resize it: a shrink would
  // make every access of the creator past the new end fault (SIGBUS).
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return Status(Code::kInternal, errno_string("sealing the shared memory (F_ADD_SEALS)"));
  }
  return map(std::move(fd), bytes);
}

Result<SharedMemory> SharedMemory::map(Fd fd, size_t bytes, bool populate) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Status(Code::kInternal, errno_string("fstat"));
  if (static_cast<size_t>(st.st_size) < bytes) {
    return Status(Code::kInternal, "shared memory is " + std::to_string(st.st_size) +
                                       " bytes, expected " + std::to_string(bytes));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0),
                   fd.get(), 0);
  if (p == MAP_FAILED) return Status(Code::kInternal, errno_string("mmap"));
  SharedMemory shm;
  shm.fd_ = std::move(fd);
  shm.data_ = p;
  shm.size_ = bytes;
  return shm;
}

}  // namespace gradsync
