#include "collectives/topology.h"

#include <algorithm>
#include <tuple>

namespace gradsync {

TreeLinks tree_links(const std::vector<uint32_t>& ring, uint32_t rank, uint32_t tree) {
  const int n = static_cast<int>(ring.size());
  int pos = static_cast<int>(std::find(ring.begin(), ring.end(), rank) - ring.begin());
  // Virtual position in the heap, and back.
  auto virt = [&](int p) { return tree == 0 ? p : n - 1 - p; };
  auto rank_at = [&](int v) { return static_cast<int>(ring[tree == 0 ? v : n - 1 - v]); };
  TreeLinks links;
  int v = virt(pos);
  if (v > 0) links.parent = rank_at((v - 1) / 2);
  for (int c = 0; c < 2; ++c) {
    int child = 2 * v + 1 + c;
    if (child < n) links.children[c] = rank_at(child);
  }
  return links;
}

std::vector<Edge> channel_edges(const std::vector<uint32_t>& ring, uint32_t rings) {
  std::vector<Edge> edges;
  const size_t n = ring.size();
  if (n < 2) return edges;
  for (uint32_t r = 0; r < rings; ++r) {
    for (size_t p = 0; p < n; ++p) edges.push_back({ring_tag(r), ring[p], ring[(p + 1) % n]});
  }
  for (uint32_t t = 0; t < kNumTrees; ++t) {
    for (uint32_t rank : ring) {
      TreeLinks l = tree_links(ring, rank, t);
      if (l.parent >= 0) {
        edges.push_back({tree_up_tag(t), rank, uint32_t(l.parent)});
        edges.push_back({tree_down_tag(t), uint32_t(l.parent), rank});
      }
    }
  }
  std::sort(edges.begin(), edges.end(), [](const Edge& a, const Edge& b) {
    return std::tie(a.tag, a.src, a.dst) < std::tie(b.tag, b.src, b.dst);
  });
  return edges;
}

}  // namespace gradsync
