#include "common/framing.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

namespace gradsync {
namespace {

constexpr int kPollSliceMs = 1000;  // upper bound of one poll(); the deadline governs

Status wait_readable(int sock, Deadline deadline) {
  for (;;) {
    int timeout = poll_timeout_ms(deadline, kPollSliceMs);
    if (timeout == 0 && Clock::now() >= deadline) {
      return {Code::kDeadlineExceeded, "timed out waiting for a message"};
    }
    pollfd p{sock, POLLIN, 0};
    int rc = ::poll(&p, 1, timeout);
    if (rc > 0) return Status::Ok();
    if (rc < 0 && errno != EINTR) return {Code::kInternal, errno_string("poll")};
  }
}

}  // namespace

Status write_all(int sock, const void* data, size_t len) {
  auto* p = static_cast<const char*>(data);
  while (len > 0) {
    ssize_t n = ::send(sock, p, len, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return {Code::kUnavailable, errno_string("send")};
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status write_two(int sock, const void* head, size_t head_len, const void* body, size_t body_len) {
  iovec iov[2] = {{const_cast<void*>(head), head_len}, {const_cast<void*>(body), body_len}};
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = 2;
  ssize_t n;
  do {
    n = ::sendmsg(sock, &mh, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return {Code::kUnavailable, errno_string("sendmsg")};
  size_t sent = static_cast<size_t>(n);
  if (sent < head_len) {
    GS_RETURN_IF_ERROR(write_all(sock, static_cast<const char*>(head) + sent, head_len - sent));
    sent = head_len;
  }
  return write_all(sock, static_cast<const char*>(body) + (sent - head_len), body_len - (sent - head_len));
}

Status read_all(int sock, void* data, size_t len, Deadline deadline) {
  auto* p = static_cast<char*>(data);
  while (len > 0) {
    GS_RETURN_IF_ERROR(wait_readable(sock, deadline));
    ssize_t n = ::recv(sock, p, len, 0);
    if (n == 0) return {Code::kUnavailable, "connection closed by peer"};
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return {Code::kUnavailable, errno_string("recv")};
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status send_frame(int sock, std::string_view body, const std::vector<int>& pass_fds) {
  if (pass_fds.size() > kMaxPassedFds) {
    return {Code::kInternal, "cannot pass " + std::to_string(pass_fds.size()) + " descriptors in one frame"};
  }
  if (body.size() > kMaxFrameBytes) return {Code::kInvalidArgument, "frame too large"};
  uint32_t len = static_cast<uint32_t>(body.size());
  std::string frame(reinterpret_cast<const char*>(&len), sizeof(len));
  frame += body;

  iovec iov{frame.data(), frame.size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int) * kMaxPassedFds)] = {};
  if (!pass_fds.empty()) {
    mh.msg_control = ctrl;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * pass_fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * pass_fds.size());
    std::memcpy(CMSG_DATA(c), pass_fds.data(), sizeof(int) * pass_fds.size());
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock, &mh, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return {Code::kUnavailable, errno_string("sendmsg")};
  // The descriptors travelled with the first byte; the rest is plain data.
  return write_all(sock, frame.data() + n, frame.size() - static_cast<size_t>(n));
}

Status recv_frame(int sock, std::string* body, Deadline deadline, std::vector<Fd>* passed,
                  uint32_t max_bytes) {
  GS_RETURN_IF_ERROR(wait_readable(sock, deadline));
  uint32_t len = 0;
  iovec iov{&len, sizeof(len)};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int) * kMaxPassedFds)] = {};
  mh.msg_control = ctrl;
  mh.msg_controllen = sizeof(ctrl);
  ssize_t n;
  do {
    n = ::recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n == 0) return {Code::kUnavailable, "connection closed by peer"};
  if (n < 0) return {Code::kUnavailable, errno_string("recvmsg")};
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (passed) passed->emplace_back(fd);
        else Fd unwanted(fd);  // closed here: the caller takes no descriptors
      }
    }
  }
  if (mh.msg_flags & MSG_CTRUNC) return {Code::kInternal, "descriptors passed with a frame were truncated"};
  if (static_cast<size_t>(n) < sizeof(len)) {
    GS_RETURN_IF_ERROR(read_all(sock, reinterpret_cast<char*>(&len) + n, sizeof(len) - n, deadline));
  }
  if (len > std::min(max_bytes, kMaxFrameBytes)) {
    return {Code::kInternal, "frame of " + std::to_string(len) + " bytes exceeds the limit of " +
                                 std::to_string(std::min(max_bytes, kMaxFrameBytes))};
  }
  body->assign(len, '\0');
  return read_all(sock, body->data(), len, deadline);
}

}  // namespace gradsync
