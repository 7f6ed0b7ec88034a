#include "gradsync/status.h"

namespace gradsync {

const char* code_name(Code code) {
  switch (code) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "INVALID_ARGUMENT";
    case Code::kNotFound: return "NOT_FOUND";
    case Code::kAlreadyExists: return "ALREADY_EXISTS";
    case Code::kPermissionDenied: return "PERMISSION_DENIED";
    case Code::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case Code::kUnavailable: return "UNAVAILABLE";
    case Code::kAborted: return "ABORTED";
    case Code::kInternal: return "INTERNAL";
    case Code::kFailedPrecondition: return "FAILED_PRECONDITION";
    case Code::kMismatch: return "MISMATCH";
    case Code::kUnimplemented: return "UNIMPLEMENTED";
  }
  return "UNKNOWN";
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  return std::string(code_name(code_)) + ": " + message_;
}

}  // namespace gradsync
