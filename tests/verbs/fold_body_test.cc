// The step kernel's one-pass fold (kernels/cuda_reduce_body.cuh, fold_body) on the host, thread
// by thread: the same bytes as the pairwise passes of reduce_body it replaces (acc = op(x0, x1),
// then acc = op(acc, x[j]) for each further source, the last pass with the final op), for
// float32, float16, bfloat16 and int32; sum, max, min, prod and avg (final and not); 2 to 8
// sources; offsets that vectorise (16-byte packs, with and without a scalar head) and offsets
// that do not (the all-scalar path); the destination apart from every source or equal to one
// (in place), with a second destination or without; 1 and 5 threads. Nothing outside the
// destinations' elements is written.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda_reduce_body.cuh"

namespace gradsync::kernels {
namespace {

using namespace ops;   // NOLINT: the traits and ops
using namespace body;  // NOLINT: the loops

constexpr int kWorld = 3;          // kAvg's divisor
constexpr size_t kArena = 2048;    // bytes per buffer, 16-aligned
constexpr size_t kElemsMax = 300;  // the most elements of a case

// 16-aligned buffers: one per source and for dst2.
struct alignas(16) Arena {
  uint8_t b[kArena];
};

// The NaN this machine's float arithmetic makes (0 x inf): the float32 inputs' only NaN, so
// that every NaN of a result has its bits whichever operand order the host compiler picks for
// a commutative op (x86 keeps the first NaN operand's sign and payload; the GPU makes one
// canonical NaN).
float made_nan() {
  volatile float zero = 0.0f;
  return zero * std::numeric_limits<float>::infinity();
}

// Random elements of each type, with NaNs, infinities and signed zeros for the floats.
template <class Tr>
typename Tr::S random_element(std::mt19937& g) {
  using S = typename Tr::S;
  if constexpr (std::is_same_v<S, float>) {
    static const float nan = made_nan();
    const uint32_t pick = g() % 64;
    if (pick == 0) return nan;
    if (pick == 1) return -std::numeric_limits<float>::infinity();
    if (pick == 2) return -0.0f;
    return std::uniform_real_distribution<float>(-100.0f, 100.0f)(g);
  } else if constexpr (std::is_same_v<S, uint16_t>) {
    // Mostly finite values of a moderate range, now and then any bit pattern (NaNs, infinities).
    if (g() % 16 == 0) return uint16_t(g());
    return Tr::store(std::uniform_real_distribution<float>(-30.0f, 30.0f)(g));
  } else {
    return S(g());
  }
}

// The reference: k - 1 passes of reduce_body over the whole range, one thread, into a separate
// accumulator, the last pass with `last`; every split as the step kernel's reduce_range takes it.
template <class S, class Op, class Last>
void pairwise(S* out1, S* out2, const std::vector<const S*>& x, size_t n, Op op, Last last) {
  std::vector<S> acc(n);
  auto split_of = [&](const void* o, const void* a, const void* b, const void* o2) {
    const unsigned m = unsigned(reinterpret_cast<uintptr_t>(o) & 15u);
    auto mis = [](const void* p) { return unsigned(reinterpret_cast<uintptr_t>(p) & 15u); };
    return split(n, sizeof(S), m, mis(a) == m && mis(b) == m && (o2 == nullptr || mis(o2) == m));
  };
  const S* a = x[0];
  for (size_t j = 1; j < x.size(); ++j) {
    const bool end = j + 1 == x.size();
    S* to = end ? out1 : acc.data();
    S* to2 = end ? out2 : nullptr;
    const Split sp = split_of(to, a, x[j], to2);
    if (end) reduce_body(0, 1, to, to2, a, x[j], sp.head, sp.nvec, n, last);
    else reduce_body(0, 1, to, to2, a, x[j], sp.head, sp.nvec, n, op);
    a = acc.data();
  }
}

// fold_body as the step kernel's fold_range calls it, `threads` threads one after another.
template <class S, class Op, class Last>
Split one_pass(S* out1, S* out2, const std::vector<const S*>& x, size_t n, size_t threads, Op op, Last last) {
  FoldSrcs<S> src{};
  src.k = int(x.size());
  for (size_t j = 0; j < x.size(); ++j) src.p[j] = x[j];
  auto mis = [](const void* p) { return unsigned(reinterpret_cast<uintptr_t>(p) & 15u); };
  const unsigned m = mis(out1);
  bool vec = out2 == nullptr || mis(out2) == m;
  for (const S* p : x) vec = vec && mis(p) == m;
  const Split sp = split(n, sizeof(S), m, vec);
  for (size_t t = 0; t < threads; ++t) fold_body(t, threads, out1, out2, src, sp.head, sp.nvec, n, op, last);
  return sp;
}

enum class Layout { kAligned, kHead, kScalar };
const char* name(Layout l) { return l == Layout::kAligned ? "aligned" : l == Layout::kHead ? "head" : "scalar"; }

// Every case of one type and one (op, last): k, layout, destination, dst2, threads, counts.
template <class Tr, class Op, class Last>
void check_type(const char* what, Op op, Last last) {
  using S = typename Tr::S;
  std::mt19937 g(12345);
  int cases = 0, vectorised = 0;
  for (int k = 2; k <= kMaxFold; ++k) {
    for (Layout layout : {Layout::kAligned, Layout::kHead, Layout::kScalar}) {
      // The byte offset of each buffer (source j, dst2 last): the same modulo 16 for all where
      // it vectorises (0, or one element past a boundary), different where it does not.
      std::vector<size_t> off(size_t(k) + 2);
      for (size_t j = 0; j < off.size(); ++j) {
        off[j] = layout == Layout::kAligned ? 0
                 : layout == Layout::kHead  ? 16 + sizeof(S)
                                            : (j % 2 == 0 ? 0 : 16 + sizeof(S) * ((j / 2) % 3 + 1));
      }
      // Where the destination is: -1 a buffer of its own (offset off[k]), else source j.
      for (int dst_at : {-1, 0, k / 2, k - 1}) {
        for (bool two : {false, true}) {
          for (size_t threads : {size_t(1), size_t(5)}) {
            for (size_t n : {size_t(1), size_t(37), kElemsMax}) {
              std::vector<Arena> fold(size_t(k) + 2), ref(size_t(k) + 2);
              for (Arena& a : fold) {
                S* e = reinterpret_cast<S*>(a.b);
                for (size_t i = 0; i < kArena / sizeof(S); ++i) e[i] = random_element<Tr>(g);
              }
              ref = fold;
              auto at = [&](std::vector<Arena>& a, size_t j) { return reinterpret_cast<S*>(a[j].b + off[j]); };
              std::vector<const S*> xf, xr;
              for (int j = 0; j < k; ++j) {
                xf.push_back(at(fold, size_t(j)));
                xr.push_back(at(ref, size_t(j)));
              }
              const size_t d = dst_at < 0 ? size_t(k) : size_t(dst_at);
              S* d2f = two ? at(fold, size_t(k) + 1) : nullptr;
              S* d2r = two ? at(ref, size_t(k) + 1) : nullptr;
              pairwise(at(ref, d), d2r, xr, n, op, last);
              const Split sp = one_pass(at(fold, d), d2f, xf, n, threads, op, last);
              vectorised += sp.nvec > 0 ? 1 : 0;
              if (layout == Layout::kScalar) {
                EXPECT_EQ(sp.nvec, 0u);
              }
              if (layout == Layout::kHead && n >= 37) {
                EXPECT_GT(sp.head, 0u);
              }
              ++cases;
              for (size_t j = 0; j < fold.size(); ++j) {
                if (std::memcmp(fold[j].b, ref[j].b, kArena) == 0) continue;
                size_t i = 0;
                while (fold[j].b[i] == ref[j].b[i]) ++i;
                ADD_FAILURE() << what << ": k " << k << ", " << name(layout) << ", dst "
                              << (dst_at < 0 ? std::string("apart") : "= source " + std::to_string(dst_at))
                              << (two ? ", dst2" : "") << ", " << threads << " threads, n " << n << ": buffer " << j
                              << " differs at byte " << i << " (element " << (int64_t(i) - int64_t(off[j])) / int64_t(sizeof(S))
                              << ")";
                return;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 7 * 3 * 4 * 2 * 2 * 3);
  EXPECT_GT(vectorised, cases / 3) << what << ": the packs were hardly tested";
}

template <class Tr>
void check_every_op() {
  check_type<Tr>("sum", OpSum<Tr>{}, OpSum<Tr>{});
  check_type<Tr>("max", OpMinMax<Tr, true>{}, OpMinMax<Tr, true>{});
  check_type<Tr>("min", OpMinMax<Tr, false>{}, OpMinMax<Tr, false>{});
  check_type<Tr>("prod", OpProd<Tr>{}, OpProd<Tr>{});
  check_type<Tr>("avg (final)", OpSum<Tr>{}, OpSumDivide<Tr>{kWorld});
}

TEST(FoldBody, Float32IsThePairwisePasses) { check_every_op<Native<float>>(); }
TEST(FoldBody, Float16IsThePairwisePasses) { check_every_op<Half>(); }
TEST(FoldBody, BFloat16IsThePairwisePasses) { check_every_op<BFloat>(); }
TEST(FoldBody, Int32IsThePairwisePasses) { check_every_op<Native<int32_t>>(); }

// The order is the fold's, left to right: float sums of 1e8, 1, -1e8 in that order give 0,
// (x0 + x2) + x1 would give 1; the last step alone divides.
TEST(FoldBody, FoldsLeftInTheSourcesOrder) {
  alignas(16) float x0[8], x1[8], x2[8], out[8];
  for (int i = 0; i < 8; ++i) x0[i] = 1e8f, x1[i] = 1.0f, x2[i] = -1e8f;
  FoldSrcs<float> src{{x0, x1, x2}, 3};
  fold_body(0, 1, out, static_cast<float*>(nullptr), src, 0, 2, 8, OpSum<Native<float>>{},
            OpSumDivide<Native<float>>{2});
  for (float v : out) EXPECT_EQ(v, 0.0f);
  src = FoldSrcs<float>{{x0, x2, x1}, 3};
  fold_body(0, 1, out, static_cast<float*>(nullptr), src, 0, 2, 8, OpSum<Native<float>>{},
            OpSumDivide<Native<float>>{2});
  for (float v : out) EXPECT_EQ(v, 0.5f);
}

}  // namespace
}  // namespace gradsync::kernels
