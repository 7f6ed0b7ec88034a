#include "gpu/step_table_cache.h"

#include <algorithm>

namespace gradsync {

const StepTableCache::Entry* StepTableCache::find(const StepCallKey& key) {
  for (Entry& e : entries_) {
    if (e.key == key) {
      e.used = ++clock_;
      ++hits_;
      return &e;
    }
  }
  return nullptr;
}

void StepTableCache::put(const StepCallKey& key, std::vector<std::unique_ptr<kernels::StepTable>> tables,
                         std::vector<uint64_t> bytes_sent) {
  if (tables.empty() || tables.size() > kMaxTables) return;
  auto at = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.key == key; });
  if (at == entries_.end()) {
    if (entries_.size() < kEntries) {
      at = entries_.insert(entries_.end(), Entry{});
    } else {
      at = std::min_element(entries_.begin(), entries_.end(),
                            [](const Entry& a, const Entry& b) { return a.used < b.used; });
    }
  }
  at->key = key;
  at->tables = std::move(tables);
  at->bytes_sent = std::move(bytes_sent);
  at->used = ++clock_;
}

}  // namespace gradsync
