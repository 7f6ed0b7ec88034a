#include "collectives/topology.h"

#include <algorithm>
#include <tuple>

namespace gradsync {

TreeLinks tree_links(const std::vector<uint32_t>& ring, uint32_t rank, uint32_t tree) {
  return tree_links_at(ring, size_t(std::find(ring.begin(), ring.end(), rank) - ring.begin()), tree);
}

TreeLinks tree_links_at(const std::vector<uint32_t>& ring, size_t pos, uint32_t tree) {
  const int n = static_cast<int>(ring.size());
  // Virtual position in the heap, and back.
  auto virt = [&](int p) { return tree == 0 ? p : n - 1 - p; };
  auto rank_at = [&](int v) { return static_cast<int>(ring[tree == 0 ? v : n - 1 - v]); };
  TreeLinks links;
  int v = virt(static_cast<int>(pos));
  if (v > 0) links.parent = rank_at((v - 1) / 2);
  for (int c = 0; c < 2; ++c) {
    int child = 2 * v + 1 + c;
    if (child < n) links.children[c] = rank_at(child);
  }
  return links;
}

namespace {

void sort_unique(std::vector<Edge>& edges) {
  auto key = [](const Edge& e) { return std::tie(e.tag, e.src, e.dst); };
  std::sort(edges.begin(), edges.end(), [&](const Edge& a, const Edge& b) { return key(a) < key(b); });
  edges.erase(std::unique(edges.begin(), edges.end()), edges.end());
}

}  // namespace

std::vector<Edge> channel_edges(const std::vector<uint32_t>& ring, uint32_t rings) {
  std::vector<size_t> all(ring.size());
  for (size_t p = 0; p < all.size(); ++p) all[p] = p;
  return channel_edges_at(ring, all, rings);
}

std::vector<Edge> channel_edges_at(const std::vector<uint32_t>& ring, const std::vector<size_t>& positions,
                                   uint32_t rings) {
  std::vector<Edge> edges;
  const size_t n = ring.size();
  if (n < 2) return edges;
  for (size_t p : positions) {
    for (uint32_t r = 0; r < rings; ++r) {
      edges.push_back({ring_tag(r), ring[p], ring[(p + 1) % n]});
      edges.push_back({ring_tag(r), ring[(p + n - 1) % n], ring[p]});
    }
    for (uint32_t t = 0; t < kNumTrees; ++t) {
      TreeLinks l = tree_links_at(ring, p, t);
      const uint32_t rank = ring[p];
      if (l.parent >= 0) {
        edges.push_back({tree_up_tag(t), rank, uint32_t(l.parent)});
        edges.push_back({tree_down_tag(t), uint32_t(l.parent), rank});
      }
      for (int child : l.children) {
        if (child < 0) continue;
        edges.push_back({tree_up_tag(t), uint32_t(child), rank});
        edges.push_back({tree_down_tag(t), rank, uint32_t(child)});
      }
    }
  }
  sort_unique(edges);
  return edges;
}

}  // namespace gradsync
