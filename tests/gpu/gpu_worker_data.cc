// gpu_worker_data.h.
#include "gpu_worker_data.h"

#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>

#include "kernels/half.h"
#include "kernels/host_reduce.h"

namespace gpu_worker {

std::vector<size_t> parse_counts(const std::string& s) {
  std::vector<size_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoull(item));
  return out;
}

// Small integers per (rank, index, op), chosen so that every reduction is exact in every type.
double value(int rank, size_t i, ReduceOp op, bool is_unsigned) {
  switch (op) {
    case ReduceOp::kProd: {
      const double v = (rank + i) % 3 == 0 ? 2 : 1;
      return (!is_unsigned && i % 5 == 0 && rank == 0) ? -v : v;
    }
    case ReduceOp::kMin:
    case ReduceOp::kMax: {
      const long v = long((rank * 13 + i * 7) % 41) - 20;
      return is_unsigned ? double(v + 20) : double(v);
    }
    default: {
      const long v = long((rank * 7 + i * 3) % 7) - 3;
      return is_unsigned ? double(v + 3) : double(v);
    }
  }
}

void store(DataType t, void* base, size_t i, double v) {
  switch (t) {
    case DataType::kFloat32: static_cast<float*>(base)[i] = float(v); break;
    case DataType::kFloat64: static_cast<double*>(base)[i] = v; break;
    case DataType::kFloat16: static_cast<uint16_t*>(base)[i] = gradsync::kernels::float_to_half_rne(float(v)); break;
    case DataType::kBFloat16: static_cast<uint16_t*>(base)[i] = gradsync::kernels::float_to_bf16_rne(float(v)); break;
    case DataType::kInt8: static_cast<int8_t*>(base)[i] = int8_t(v); break;
    case DataType::kUInt8: static_cast<uint8_t*>(base)[i] = uint8_t(v); break;
    case DataType::kInt32: static_cast<int32_t*>(base)[i] = int32_t(v); break;
    case DataType::kInt64: static_cast<int64_t*>(base)[i] = int64_t(v); break;
  }
}

void fill(DataType t, ReduceOp op, int rank, size_t count, std::vector<uint8_t>* buf) {
  const bool u = t == DataType::kUInt8;
  for (size_t i = 0; i < count; ++i) store(t, buf->data(), i, value(rank, i, op, u));
}

// The expected result: rank 0's input folded with every other rank's in rank order, the last
// step dividing for avg (host loops; exact inputs make the order irrelevant anyway).
std::vector<uint8_t> expected(DataType t, ReduceOp op, int world, size_t count) {
  const size_t es = gradsync::element_size(t);
  std::vector<uint8_t> acc(count * es + 16), x(count * es + 16);
  fill(t, op, 0, count, &acc);
  if (world == 1) {
    if (op == ReduceOp::kAvg) gradsync::kernels::finish_avg(t, acc.data(), count, 1);
    return acc;
  }
  for (int r = 1; r < world; ++r) {
    fill(t, op, r, count, &x);
    if (r + 1 < world) gradsync::kernels::reduce(t, op, acc.data(), acc.data(), x.data(), count);
    else gradsync::kernels::reduce_final(t, op, acc.data(), nullptr, acc.data(), x.data(), count, world);
  }
  return acc;
}

// ---- reporting --------------------------------------------------------------------------

double decode(DataType t, const uint8_t* p) {
  switch (t) {
    case DataType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DataType::kFloat64: {
      double f;
      std::memcpy(&f, p, 8);
      return f;
    }
    case DataType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return gradsync::kernels::half_to_float(h);
    }
    case DataType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return gradsync::kernels::bf16_to_float(h);
    }
    case DataType::kInt8:
      return double(int8_t(p[0]));
    case DataType::kUInt8:
      return double(p[0]);
    case DataType::kInt32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return double(v);
    }
    case DataType::kInt64: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return double(v);
    }
  }
  return 0;
}

// "0x3c00 (1)": an element's bits and value.
std::string element_str(DataType t, const uint8_t* p) {
  const size_t es = gradsync::element_size(t);
  uint64_t bits = 0;
  std::memcpy(&bits, p, es);
  char b[80];
  std::snprintf(b, sizeof b, "0x%0*llx (%.9g)", int(2 * es), static_cast<unsigned long long>(bits),
                decode(t, p));
  return b;
}

// What a call was, for failure messages: "reduce_scatter float16 op=sum count=1000 in-place,
// rank 1 of 2 (path cuda-ipc)".
std::string label(gradsync::Communicator& comm, const char* collective, DataType t,
                  const std::string& extra, size_t count, const char* placement) {
  return std::string(collective) + " " + gradsync::to_string(t) +
         (extra.empty() ? "" : " " + extra) + " count=" + std::to_string(count) +
         (*placement ? std::string(" ") + placement : "") + ", rank " +
         std::to_string(comm.rank()) + " of " + std::to_string(comm.world_size()) + " (path " +
         comm.gpu_path() + ")";
}

// 0 when got equals want bit for bit (count elements); else prints the first difference, how
// many elements differ and the last one, and returns 1.
int compare(const std::string& what, const char* buffer, DataType t, const uint8_t* got,
            const uint8_t* want, size_t count) {
  const size_t es = gradsync::element_size(t);
  if (std::memcmp(got, want, count * es) == 0) return 0;
  size_t first = count, last = 0, wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(got + i * es, want + i * es, es) != 0) {
      if (first == count) first = i;
      last = i;
      ++wrong;
    }
  }
  std::fprintf(stderr,
               "FAIL %s: %s element %zu differs: expected %s, got %s (%zu of %zu elements differ, "
               "the last at %zu)\n",
               what.c_str(), buffer, first, element_str(t, want + first * es).c_str(),
               element_str(t, got + first * es).c_str(), wrong, count, last);
  return 1;
}

// Arbitrary bits per (rank, element): NaNs, infinities, subnormals and all; the copying
// collectives must move them unchanged, and every rank's differ.
void fill_bits(DataType t, int rank, size_t count, uint8_t* out) {
  const size_t es = gradsync::element_size(t);
  for (size_t i = 0; i < count; ++i) {
    uint64_t h = (uint64_t(rank) + 1) * 0x9E3779B97F4A7C15ull + uint64_t(i) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 29;
    std::memcpy(out + i * es, &h, es);
  }
}

// A refusal: kInvalidArgument, and the message names the rank and its host.
int expect_refused(const char* what, const gradsync::Status& s) {
  std::printf("refused %s: %s\n", what, s.to_string().c_str());
  if (s.code() != gradsync::Code::kInvalidArgument) {
    std::fprintf(stderr, "FAIL %s was not refused with INVALID_ARGUMENT: %s\n", what,
                 s.to_string().c_str());
    return 1;
  }
  if (s.message().find("rank ") == std::string::npos ||
      s.message().find("host ") == std::string::npos) {
    std::fprintf(stderr, "FAIL the refusal of %s does not name the rank and host: %s\n", what,
                 s.to_string().c_str());
    return 1;
  }
  return 0;
}

}  // namespace gpu_worker
