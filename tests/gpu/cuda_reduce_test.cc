// CUDA reduction and copy kernels (kernels/cuda_reduce.cuh) against the host loops
// (kernels/host_reduce.h), byte for byte, on the same inputs: every type x op for reduce,
// reduce_final (world 1, 2, 3, 8; with and without out2) and finish_avg; lengths 0, 1, 7,
// 4099, 2^20 + 3 and one past the grid cap; aligned, offset by one element, mixed offsets
// (the all-scalar path) and in place (out == a, out == b).
//
// Inputs: random bits for integers; for floating types a mix of random finite bit patterns
// (every exponent, subnormals included), values of similar magnitude (rounding of sums), and
// zeros/subnormals; min/max also get NaNs (quiet and signalling, with payloads and signs) and
// infinities. NaNs produced by arithmetic are not the same bits on x86 and CUDA (see
// cuda_reduce.cuh), so ArithmeticNaN checks sum/prod/avg with NaN and inf inputs by "NaN where
// the host has NaN, same bytes elsewhere".
//
// Every device buffer has a poisoned prefix and guard after the range: writes outside it and
// writes to inputs are caught without compute-sanitizer. Each test skips itself when
// cudaGetDeviceCount reports no device; listing the tests touches no CUDA.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "gradsync/gradsync.h"
#include "kernels/cuda_reduce.cuh"
#include "kernels/half.h"
#include "kernels/host_reduce.h"

namespace gradsync::kernels {
namespace {

// ---- helpers ------------------------------------------------------------------------------

bool have_gpu() {
  static const bool has = [] {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e == cudaSuccess && count > 0;
  }();
  return has;
}

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount)"

#define CUDA_ASSERT(expr)                                                          \
  do {                                                                             \
    const cudaError_t e_ = (expr);                                                 \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);         \
  } while (0)

const DataType kTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                           DataType::kBFloat16, DataType::kInt8,    DataType::kUInt8,
                           DataType::kInt32,   DataType::kInt64};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax,
                         ReduceOp::kAvg};
const size_t kLengths[] = {0, 1, 7, 4099, (size_t(1) << 20) + 3};
const int kWorlds[] = {1, 2, 3, 8};
constexpr size_t kGuard = 64;  // poisoned bytes before (at most) and after every range
constexpr uint8_t kPoison = 0xA5;

size_t esize(DataType t) {
  switch (t) {
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16: return 2;
    default: return 1;
  }
}
const char* tname(DataType t) {
  switch (t) {
    case DataType::kFloat32: return "Float32";
    case DataType::kFloat64: return "Float64";
    case DataType::kFloat16: return "Float16";
    case DataType::kBFloat16: return "BFloat16";
    case DataType::kInt8: return "Int8";
    case DataType::kUInt8: return "UInt8";
    case DataType::kInt32: return "Int32";
    case DataType::kInt64: return "Int64";
  }
  return "?";
}
const char* oname(ReduceOp o) {
  switch (o) {
    case ReduceOp::kSum: return "Sum";
    case ReduceOp::kProd: return "Prod";
    case ReduceOp::kMin: return "Min";
    case ReduceOp::kMax: return "Max";
    case ReduceOp::kAvg: return "Avg";
  }
  return "?";
}
bool is_float(DataType t) { return t <= DataType::kBFloat16; }

// Element i of a buffer of `t` as bits, and whether it is a NaN.
uint64_t elem_bits(DataType t, const uint8_t* p, size_t i) {
  uint64_t v = 0;
  std::memcpy(&v, p + i * esize(t), esize(t));
  return v;
}
bool elem_nan(DataType t, uint64_t v) {
  switch (t) {
    case DataType::kFloat32: return (v & 0x7fffffffu) > 0x7f800000u;
    case DataType::kFloat64: return (v & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
    case DataType::kFloat16: return (v & 0x7fffu) > 0x7c00u;
    case DataType::kBFloat16: return (v & 0x7fffu) > 0x7f80u;
    default: return false;
  }
}

// splitmix64: fast, and a fresh seed per test.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }  // [0, 1)
};
uint64_t seed_for(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a of the test name: reproducible per test
  for (char c : name) h = (h ^ uint8_t(c)) * 1099511628211ull;
  return h;
}

enum class Mix { kFinite, kMinMax, kNaNInf };

// Special values by type: [0, kNonNaN) are zeros, subnormals, extremes; then inf; then NaN.
struct Specials {
  std::vector<uint64_t> finite, inf, nan;
};
Specials specials(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return {{0x00000000, 0x80000000, 0x00000001, 0x807fffff, 0x00400000, 0x7f7fffff,
               0xff7fffff, 0x00800000},
              {0x7f800000, 0xff800000},
              {0x7fc00000, 0xffc00000, 0x7f800001, 0xff800123, 0x7fa5a5a5, 0xffffffff}};
    case DataType::kFloat64:
      return {{0x0ull, 0x8000000000000000ull, 0x1ull, 0x800fffffffffffffull,
               0x0008000000000000ull, 0x7fefffffffffffffull, 0xffefffffffffffffull},
              {0x7ff0000000000000ull, 0xfff0000000000000ull},
              {0x7ff8000000000000ull, 0xfff8000000000000ull, 0x7ff0000000000001ull,
               0xfff0000000012345ull, 0x7ffa5a5a5a5a5a5aull}};
    case DataType::kFloat16:
      return {{0x0000, 0x8000, 0x0001, 0x83ff, 0x0200, 0x7bff, 0xfbff, 0x0400},
              {0x7c00, 0xfc00},
              {0x7e00, 0xfe00, 0x7c01, 0xfc55, 0x7d2a, 0xffff}};
    case DataType::kBFloat16:
      return {{0x0000, 0x8000, 0x0001, 0x807f, 0x0040, 0x7f7f, 0xff7f, 0x0080},
              {0x7f80, 0xff80},
              {0x7fc0, 0xffc0, 0x7f81, 0xff95, 0x7faa, 0xffff}};
    default: return {};
  }
}

// One random element of type t as bits.
uint64_t random_elem(DataType t, Mix mix, const Specials& sp, Rng& r) {
  const uint64_t x = r.next();
  if (!is_float(t)) return x;
  const unsigned pick = unsigned(r.next() % 64);
  if (mix != Mix::kFinite) {
    if (pick < 3) return sp.nan[r.next() % sp.nan.size()];
    if (pick < 5) return sp.inf[r.next() % sp.inf.size()];
  }
  if (pick >= 5 && pick < 9) return sp.finite[r.next() % sp.finite.size()];
  const bool similar = pick >= 36;  // about half: values of similar magnitude
  const float f = float((r.uniform() * 8.0 - 4.0));
  switch (t) {
    case DataType::kFloat32: {
      if (similar) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
      uint32_t u = uint32_t(x);
      if ((u & 0x7f800000u) == 0x7f800000u) u &= 0xbfffffffu;  // finite
      return u;
    }
    case DataType::kFloat64: {
      if (similar) {
        const double d = r.uniform() * 8.0 - 4.0;
        uint64_t u;
        std::memcpy(&u, &d, 8);
        return u;
      }
      uint64_t u = x;
      if ((u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull) u &= 0xbfffffffffffffffull;
      return u;
    }
    case DataType::kFloat16: {
      if (similar) return float_to_half_rne(f);
      uint16_t u = uint16_t(x);
      if ((u & 0x7c00u) == 0x7c00u) u &= 0xbfffu;
      return u;
    }
    case DataType::kBFloat16: {
      if (similar) return float_to_bf16_rne(f);
      uint16_t u = uint16_t(x);
      if ((u & 0x7f80u) == 0x7f80u) u &= 0xbfffu;
      return u;
    }
    default: return x;
  }
}

std::vector<uint8_t> random_buffer(DataType t, Mix mix, size_t n, Rng& r) {
  const Specials sp = specials(t);
  const size_t es = esize(t);
  std::vector<uint8_t> v(n * es);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t e = random_elem(t, mix, sp, r);
    std::memcpy(v.data() + i * es, &e, es);
  }
  return v;
}

// A device allocation of exactly `off + bytes + kGuard` bytes, poisoned, with `data` (if any)
// at offset `off`.
struct DevBuf {
  uint8_t* base = nullptr;
  size_t off = 0, bytes = 0;
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    if (base) (void)cudaFree(base);
  }
  size_t total() const { return off + bytes + kGuard; }
  uint8_t* ptr() const { return base + off; }
};

::testing::AssertionResult cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << cudaGetErrorString(e);
}

::testing::AssertionResult make(DevBuf& b, size_t off, size_t bytes, const uint8_t* data) {
  b.off = off;
  b.bytes = bytes;
  void* p = nullptr;
  if (auto r = cuda_ok(cudaMalloc(&p, b.total()), "cudaMalloc"); !r) return r;
  b.base = static_cast<uint8_t*>(p);
  if (auto r = cuda_ok(cudaMemset(b.base, kPoison, b.total()), "cudaMemset"); !r) return r;
  if (data && bytes)
    if (auto r = cuda_ok(cudaMemcpy(b.ptr(), data, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
        !r)
      return r;
  // cudaMemset is asynchronous, and cudaMemcpy from pageable memory may return before the
  // data has landed; the kernels run on a non-blocking stream that does not wait for the
  // legacy stream, so wait here (seen: the tail of a 1 MiB input still poison at launch).
  return cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

// Reads b back and checks: poison outside the range, `expect` inside (bytes), or where
// nan_ok, NaN where expect has NaN.
::testing::AssertionResult check(const DevBuf& b, DataType t, const uint8_t* expect,
                                 const char* what, bool nan_ok = false) {
  std::vector<uint8_t> got(b.total());
  if (auto r = cuda_ok(cudaMemcpy(got.data(), b.base, b.total(), cudaMemcpyDeviceToHost),
                       "cudaMemcpy back");
      !r)
    return r;
  for (size_t i = 0; i < b.off; ++i)
    if (got[i] != kPoison)
      return ::testing::AssertionFailure() << what << ": wrote before the range";
  for (size_t i = b.off + b.bytes; i < b.total(); ++i)
    if (got[i] != kPoison)
      return ::testing::AssertionFailure() << what << ": wrote " << (i - b.off - b.bytes)
                                           << " bytes past the range";
  const uint8_t* g = got.data() + b.off;
  if (std::memcmp(g, expect, b.bytes) == 0) return ::testing::AssertionSuccess();
  const size_t es = esize(t), n = b.bytes / es;
  size_t bad = 0, first = n;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t x = elem_bits(t, g, i), y = elem_bits(t, expect, i);
    if (x == y || (nan_ok && elem_nan(t, x) && elem_nan(t, y))) continue;
    if (first == n) first = i;
    ++bad;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  char buf[160];
  std::snprintf(buf, sizeof buf,
                "%s: %zu of %zu elements differ, first [%zu]: gpu 0x%llx host 0x%llx", what,
                bad, n, first, (unsigned long long)elem_bits(t, g, first),
                (unsigned long long)elem_bits(t, expect, first));
  return ::testing::AssertionFailure() << buf;
}

// Pointer layouts: offsets in elements of a, b, out1 (out2 like out1); Alias* put out1 on an
// input.
enum class Layout { kAligned, kOffset, kMixed, kAliasA, kAliasBOffset };
const Layout kLayouts[] = {Layout::kAligned, Layout::kOffset, Layout::kMixed, Layout::kAliasA,
                           Layout::kAliasBOffset};
const char* lname(Layout l) {
  switch (l) {
    case Layout::kAligned: return "aligned";
    case Layout::kOffset: return "offset+1";
    case Layout::kMixed: return "mixed";
    case Layout::kAliasA: return "out=a";
    case Layout::kAliasBOffset: return "out=b,offset+1";
  }
  return "?";
}

// One GPU call of reduce (final == false) or reduce_final, checked against the host on the
// first n elements of a and b.
::testing::AssertionResult run_binary(DataType t, ReduceOp op, bool final, int world,
                                      bool with_out2, Layout layout, size_t n,
                                      const std::vector<uint8_t>& a,
                                      const std::vector<uint8_t>& b, cudaStream_t stream,
                                      bool nan_ok = false) {
  const size_t es = esize(t), bytes = n * es;
  // Host reference.
  std::vector<uint8_t> ref(bytes), ref2(bytes);
  if (final) reduce_final(t, op, ref.data(), ref2.data(), a.data(), b.data(), n, world);
  else reduce(t, op, ref.data(), a.data(), b.data(), n);
  if (final && std::memcmp(ref.data(), ref2.data(), bytes) != 0)
    return ::testing::AssertionFailure() << "host out1 != out2";

  size_t oa = 0, ob = 0, oo = 0;
  switch (layout) {
    case Layout::kAligned:
    case Layout::kAliasA: break;
    case Layout::kOffset:
    case Layout::kAliasBOffset: oa = ob = oo = es; break;
    case Layout::kMixed: oa = es; break;  // a off by one element, b and out aligned
  }
  DevBuf da, db, dout, dout2;
  if (auto r = make(da, oa, bytes, a.data()); !r) return r;
  if (auto r = make(db, ob, bytes, b.data()); !r) return r;
  const bool alias_a = layout == Layout::kAliasA, alias_b = layout == Layout::kAliasBOffset;
  if (!alias_a && !alias_b)
    if (auto r = make(dout, oo, bytes, nullptr); !r) return r;
  if (with_out2)
    if (auto r = make(dout2, oo, bytes, nullptr); !r) return r;
  void* out1 = alias_a ? da.ptr() : alias_b ? db.ptr() : dout.ptr();
  void* out2 = with_out2 ? dout2.ptr() : nullptr;

  const cudaError_t e =
      final ? launch_reduce_final(t, op, out1, out2, da.ptr(), db.ptr(), n, world, stream)
            : launch_reduce(t, op, out1, da.ptr(), db.ptr(), n, stream);
  if (auto r = cuda_ok(e, "launch"); !r) return r;
  if (auto r = cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize"); !r) return r;
  if (auto r = cuda_ok(cudaGetLastError(), "cudaGetLastError"); !r) return r;

  if (auto r = check(da, t, alias_a ? ref.data() : a.data(), "a", nan_ok); !r) return r;
  if (auto r = check(db, t, alias_b ? ref.data() : b.data(), "b", nan_ok); !r) return r;
  if (!alias_a && !alias_b)
    if (auto r = check(dout, t, ref.data(), "out1", nan_ok); !r) return r;
  if (with_out2)
    if (auto r = check(dout2, t, ref.data(), "out2", nan_ok); !r) return r;
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult run_finish(DataType t, int world, size_t off_elems, size_t n,
                                      const std::vector<uint8_t>& in, cudaStream_t stream,
                                      bool nan_ok = false) {
  const size_t es = esize(t), bytes = n * es;
  std::vector<uint8_t> ref(in.begin(), in.begin() + bytes);
  finish_avg(t, ref.data(), n, world);
  DevBuf d;
  if (auto r = make(d, off_elems * es, bytes, in.data()); !r) return r;
  if (auto r = cuda_ok(launch_finish_avg(t, d.ptr(), n, world, stream), "launch"); !r) return r;
  if (auto r = cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize"); !r) return r;
  return check(d, t, ref.data(), "buf", nan_ok);
}

// A non-blocking stream per test: the launchers must honour the stream they are given.
class StreamTest {
 public:
  StreamTest() { ok_ = cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking) == cudaSuccess; }
  ~StreamTest() {
    if (ok_) (void)cudaStreamDestroy(s_);
  }
  cudaStream_t get() const { return s_; }
  bool ok() const { return ok_; }

 private:
  cudaStream_t s_ = nullptr;
  bool ok_ = false;
};

std::string test_name() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

// ---- reduce and reduce_final, every type x op ------------------------------------------------

using TypeOp = std::tuple<DataType, ReduceOp>;
std::string type_op_name(const ::testing::TestParamInfo<TypeOp>& p) {
  return std::string(tname(std::get<0>(p.param))) + oname(std::get<1>(p.param));
}

class GpuReduce : public ::testing::TestWithParam<TypeOp> {};

TEST_P(GpuReduce, ReduceMatchesHost) {
  REQUIRE_GPU();
  const auto [t, op] = GetParam();
  StreamTest s;
  ASSERT_TRUE(s.ok());
  Rng rng{seed_for(test_name())};
  const Mix mix = (op == ReduceOp::kMin || op == ReduceOp::kMax) ? Mix::kMinMax : Mix::kFinite;
  const size_t max_n = kLengths[std::size(kLengths) - 1];
  const auto a = random_buffer(t, mix, max_n, rng), b = random_buffer(t, mix, max_n, rng);
  for (size_t n : kLengths)
    for (Layout l : kLayouts)
      EXPECT_TRUE(run_binary(t, op, false, 1, false, l, n, a, b, s.get()))
          << "n=" << n << " " << lname(l);
}

TEST_P(GpuReduce, ReduceFinalMatchesHost) {
  REQUIRE_GPU();
  const auto [t, op] = GetParam();
  StreamTest s;
  ASSERT_TRUE(s.ok());
  Rng rng{seed_for(test_name())};
  const Mix mix = (op == ReduceOp::kMin || op == ReduceOp::kMax) ? Mix::kMinMax : Mix::kFinite;
  const size_t max_n = kLengths[std::size(kLengths) - 1];
  const auto a = random_buffer(t, mix, max_n, rng), b = random_buffer(t, mix, max_n, rng);
  for (size_t n : kLengths)
    for (int world : kWorlds)
      for (Layout l : kLayouts)
        for (bool out2 : {false, true})
          EXPECT_TRUE(run_binary(t, op, true, world, out2, l, n, a, b, s.get()))
              << "n=" << n << " world=" << world << " " << lname(l) << (out2 ? " +out2" : "");
}

INSTANTIATE_TEST_SUITE_P(All, GpuReduce,
                         ::testing::Combine(::testing::ValuesIn(kTypes), ::testing::ValuesIn(kOps)),
                         type_op_name);

// ---- finish_avg, every type ------------------------------------------------------------------

class GpuFinishAvg : public ::testing::TestWithParam<DataType> {};

TEST_P(GpuFinishAvg, MatchesHost) {
  REQUIRE_GPU();
  const DataType t = GetParam();
  StreamTest s;
  ASSERT_TRUE(s.ok());
  Rng rng{seed_for(test_name())};
  const size_t max_n = kLengths[std::size(kLengths) - 1];
  const auto in = random_buffer(t, Mix::kFinite, max_n, rng);
  for (size_t n : kLengths)
    for (int world : kWorlds)
      for (size_t off : {0, 1})
        EXPECT_TRUE(run_finish(t, world, off, n, in, s.get()))
            << "n=" << n << " world=" << world << " offset=" << off;
}

INSTANTIATE_TEST_SUITE_P(All, GpuFinishAvg, ::testing::ValuesIn(kTypes),
                         [](const ::testing::TestParamInfo<DataType>& p) {
                           return std::string(tname(p.param));
                         });

// ---- NaN and inf through arithmetic: NaN-ness matches, everything else bytes ----------------

class GpuArithmeticNaN : public ::testing::TestWithParam<DataType> {};

TEST_P(GpuArithmeticNaN, NaNWhereHostHasNaN) {
  REQUIRE_GPU();
  const DataType t = GetParam();
  StreamTest s;
  ASSERT_TRUE(s.ok());
  Rng rng{seed_for(test_name())};
  const size_t n = 4099;
  const auto a = random_buffer(t, Mix::kNaNInf, n, rng), b = random_buffer(t, Mix::kNaNInf, n, rng);
  for (ReduceOp op : kOps) {
    EXPECT_TRUE(run_binary(t, op, false, 1, false, Layout::kOffset, n, a, b, s.get(), true))
        << oname(op);
    EXPECT_TRUE(run_binary(t, op, true, 3, true, Layout::kAligned, n, a, b, s.get(), true))
        << oname(op) << " final world=3";
  }
  EXPECT_TRUE(run_finish(t, 3, 0, n, a, s.get(), true));
}

INSTANTIATE_TEST_SUITE_P(Floats, GpuArithmeticNaN,
                         ::testing::Values(DataType::kFloat32, DataType::kFloat64,
                                           DataType::kFloat16, DataType::kBFloat16),
                         [](const ::testing::TestParamInfo<DataType>& p) {
                           return std::string(tname(p.param));
                         });

// ---- past the grid cap: grid-stride loops with several iterations ----------------------------

TEST(GpuReduceLarge, GridStrideLoops) {
  REQUIRE_GPU();
  StreamTest s;
  ASSERT_TRUE(s.ok());
  Rng rng{seed_for(test_name())};
  // 1024 blocks x 512 threads x 2 packs of 16 bytes = 16 MiB a sweep; 40 MiB + a few bytes
  // takes three sweeps with a partial one and a tail.
  const size_t bytes = (size_t(40) << 20) + 24;
  struct Case {
    DataType t;
    ReduceOp op;
    bool final;
    int world;
    bool out2;
    Layout layout;
  };
  const Case cases[] = {
      {DataType::kFloat32, ReduceOp::kSum, false, 1, false, Layout::kAligned},
      {DataType::kBFloat16, ReduceOp::kAvg, true, 3, true, Layout::kOffset},
      {DataType::kInt8, ReduceOp::kMax, true, 8, false, Layout::kAliasA},
      {DataType::kFloat64, ReduceOp::kProd, false, 1, false, Layout::kMixed},
      {DataType::kFloat16, ReduceOp::kMin, true, 2, true, Layout::kAliasBOffset},
  };
  for (const Case& c : cases) {
    const size_t n = bytes / esize(c.t);
    const Mix mix = c.op == ReduceOp::kMin || c.op == ReduceOp::kMax ? Mix::kMinMax : Mix::kFinite;
    const auto a = random_buffer(c.t, mix, n, rng), b = random_buffer(c.t, mix, n, rng);
    EXPECT_TRUE(run_binary(c.t, c.op, c.final, c.world, c.out2, c.layout, n, a, b, s.get()))
        << tname(c.t) << oname(c.op) << " " << lname(c.layout);
  }
  const size_t n = bytes / 4 + 1;
  const auto in = random_buffer(DataType::kInt32, Mix::kFinite, n, rng);
  EXPECT_TRUE(run_finish(DataType::kInt32, 3, 1, n, in, s.get()));
}

// ---- copy -------------------------------------------------------------------------------------

TEST(GpuCopy, AllOffsetsAndLengths) {
  REQUIRE_GPU();
  StreamTest s;
  ASSERT_TRUE(s.ok());
  Rng rng{seed_for(test_name())};
  const size_t lengths[] = {0, 1, 15, 16, 17, 4099, (size_t(1) << 20) + 3, (size_t(40) << 20) + 7};
  const size_t dst_offs[] = {0, 1, 2, 4, 8, 12};
  const size_t src_offs[] = {0, 1, 2, 3, 4, 8, 13};
  std::vector<uint8_t> src(lengths[std::size(lengths) - 1]);
  for (auto& x : src) x = uint8_t(rng.next());
  for (size_t len : lengths)
    for (size_t od : dst_offs)
      for (size_t os : src_offs) {
        if (len > (size_t(1) << 21) && (od > 1 || os > 1)) continue;  // largest: a few only
        DevBuf d, sb;
        ASSERT_TRUE(make(d, od, len, nullptr));
        ASSERT_TRUE(make(sb, os, len, src.data()));
        CUDA_ASSERT(launch_copy(d.ptr(), sb.ptr(), len, s.get()));
        CUDA_ASSERT(cudaStreamSynchronize(s.get()));
        EXPECT_TRUE(check(d, DataType::kUInt8, src.data(), "dst"))
            << "len=" << len << " dst+" << od << " src+" << os;
        EXPECT_TRUE(check(sb, DataType::kUInt8, src.data(), "src"))
            << "len=" << len << " dst+" << od << " src+" << os;
      }
}

// ---- argument checks ---------------------------------------------------------------------------

TEST(GpuLaunch, RejectsBadArguments) {
  REQUIRE_GPU();
  DevBuf d;
  ASSERT_TRUE(make(d, 0, 1024, nullptr));
  void* p = d.ptr();
  const auto bad_type = static_cast<DataType>(99);
  const auto bad_op = static_cast<ReduceOp>(99);
  EXPECT_EQ(launch_reduce(bad_type, ReduceOp::kSum, p, p, p, 4, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(launch_reduce(DataType::kFloat32, bad_op, p, p, p, 4, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(launch_reduce_final(DataType::kFloat32, ReduceOp::kAvg, p, nullptr, p, p, 4, 0,
                                nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(launch_finish_avg(DataType::kFloat32, p, 4, 0, nullptr), cudaErrorInvalidValue);
  // Not aligned to the element size.
  void* odd = d.ptr() + 1;
  EXPECT_EQ(launch_reduce(DataType::kFloat32, ReduceOp::kSum, odd, p, p, 4, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(launch_finish_avg(DataType::kInt64, d.ptr() + 4, 4, 2, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(launch_reduce(DataType::kFloat32, ReduceOp::kSum, nullptr, p, p, 4, nullptr),
            cudaErrorInvalidValue);
  // n == 0: nothing to do, no pointers needed.
  EXPECT_EQ(launch_reduce(DataType::kFloat32, ReduceOp::kSum, nullptr, nullptr, nullptr, 0,
                          nullptr),
            cudaSuccess);
  EXPECT_EQ(launch_copy(nullptr, nullptr, 0, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // Nothing was written.
  std::vector<uint8_t> poison(1024, kPoison);
  EXPECT_TRUE(check(d, DataType::kUInt8, poison.data(), "buf"));
}

}  // namespace
}  // namespace gradsync::kernels
