#include "common/limits.h"

namespace gradsync {

Status check_job_id(const std::string& id) {
  if (id.empty()) return {Code::kInvalidArgument, "empty job id"};
  if (id.size() > kMaxJobIdBytes) {
    return {Code::kInvalidArgument, "job id of " + std::to_string(id.size()) + " bytes (at most " +
                                        std::to_string(kMaxJobIdBytes) + ")"};
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(id[i]);
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '@' || c == '+' || c == '-';
    if (!ok) {
      return {Code::kInvalidArgument, "job id has character code " + std::to_string(c) + " at " +
                                          std::to_string(i) + " (allowed: letters, digits and ._:@+-)"};
    }
  }
  return Status::Ok();
}

}  // namespace gradsync
