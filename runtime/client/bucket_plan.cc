// The GradientReducer's bucket planner (bucket_plan.h).
#include "client/bucket_plan.h"

#include <algorithm>
#include <map>
#include <utility>

namespace gradsync {

std::vector<int> reverse_registration_order(int n) {
  std::vector<int> order(size_t(std::max(n, 0)));
  for (int i = 0; i < n; ++i) order[size_t(i)] = n - 1 - i;
  return order;
}

bool is_permutation_of(const std::vector<int>& order, int n) {
  if (order.size() != size_t(n)) return false;
  std::vector<bool> seen(size_t(n), false);
  for (int i : order) {
    if (i < 0 || i >= n || seen[size_t(i)]) return false;
    seen[size_t(i)] = true;
  }
  return true;
}

std::vector<BucketInfo> plan_buckets(const std::vector<GradientSpec>& gradients,
                                     const std::vector<int>& order, size_t first_cap, size_t cap) {
  struct Open {
    BucketInfo bucket;
    size_t first_position = 0;  // in `order`, of its first gradient
    size_t bytes = 0;
    int closed_before = 0;      // buckets of this key closed already: picks the cap
  };
  using Key = std::pair<int, int>;  // (type, device)
  std::map<Key, Open> open;
  std::vector<std::pair<size_t, BucketInfo>> done;  // (first position, bucket)
  for (size_t pos = 0; pos < order.size(); ++pos) {
    const int g = order[pos];
    const GradientSpec& s = gradients[size_t(g)];
    const Key key{int(s.type), s.device};
    Open& o = open[key];
    if (o.bucket.gradients.empty()) {
      o.bucket.type = s.type;
      o.bucket.device = s.device;
      o.first_position = pos;
    }
    o.bucket.gradients.push_back(g);
    o.bucket.offsets.push_back(o.bucket.count);
    o.bucket.count += s.count;
    o.bytes += s.count * element_size(s.type);
    const size_t limit = o.closed_before == 0 ? first_cap : cap;
    if (o.bytes >= limit) {
      done.emplace_back(o.first_position, std::move(o.bucket));
      o = Open{BucketInfo{}, 0, 0, o.closed_before + 1};
    }
  }
  for (auto& [key, o] : open) {
    if (!o.bucket.gradients.empty()) done.emplace_back(o.first_position, std::move(o.bucket));
  }
  std::sort(done.begin(), done.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<BucketInfo> out;
  out.reserve(done.size());
  for (auto& d : done) out.push_back(std::move(d.second));
  return out;
}

}  // namespace gradsync
