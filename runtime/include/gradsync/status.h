// gradsync::Status — errors are values, inside the runtime and at the API boundary.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace gradsync {

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 1,   // bad input: refused before anything was sent
  kNotFound = 2,
  kAlreadyExists = 3,     // e.g. two trainers claiming one rank
  kPermissionDenied = 4,  // wrong job token, socket credentials
  kDeadlineExceeded = 5,  // a wait ran past its deadline
  kUnavailable = 6,       // daemon or coordinator unreachable
  kAborted = 7,           // the job was aborted: a peer died, a node was lost
  kInternal = 8,
  kFailedPrecondition = 9,  // e.g. a communicator that failed earlier
  kMismatch = 10,           // ranks called different collectives
  kUnimplemented = 11,      // e.g. GPU collectives in a build without CUDA
};

const char* code_name(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "ABORTED: job=train rank 2 (host node-b) died: ..."
  std::string to_string() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &std::get<T>(v_); }
  T& operator*() { return std::get<T>(v_); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace gradsync

#define GS_RETURN_IF_ERROR(expr)            \
  do {                                      \
    ::gradsync::Status gs_status_ = (expr); \
    if (!gs_status_.ok()) return gs_status_; \
  } while (0)
