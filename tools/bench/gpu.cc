// gradsync-bench --device cuda (bench/gpu.h).
//
// One collective (--collective allreduce, reduce_scatter, all_gather or broadcast). Per type,
// op (the reducing collectives; "none" for the others) and size, one row: device buffers
// allocated once for the row, then for gradsync and (with --nccl 1) NCCL, out-of-place then
// in-place like nccl-tests (in place: reduce_scatter's recv is send + rank * count,
// all_gather's send is recv + rank * count):
//   - a checked call: inputs filled on the host with a rank-dependent pattern of small
//     integers whose reduction is exact in every type, copied to the device, run, copied
//     back and compared with the expected result (out of place, the input must also come
//     back untouched);
//   - `warmup` calls, then `iters` calls between two CUDA events on one stream; the time is
//     the elapsed event time / iters, the slowest rank's.
// gradsync and NCCL (ncclAllReduce, ncclReduceScatter, ncclAllGather, ncclBroadcast) see the
// same buffers, counts and stream. gradsync's broadcast has one buffer: its out-of-place group
// is not run, and the ratio columns of broadcast compare the in-place groups. Sizes and
// busbw as nccl-tests: size is the full buffer (reduce_scatter's send, all_gather's recv),
// busbw = algbw x 2(n-1)/n (allreduce), (n-1)/n (reduce_scatter, all_gather), 1 (broadcast).
// The ranks' numbers travel through gradsync's host path (bench::gather), as in host mode.
#include "bench/gpu.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/gpu_data.h"
#include "bench/gpu_timeline_text.h"
#include "gpu/timeline.h"

namespace bench {
namespace {

// ---- the run ------------------------------------------------------------------------------------

class GpuBench {
 public:
  GpuBench(gradsync::Session& session, gradsync::Communicator& comm, const Options& opt)
      : session_(session), comm_(comm), opt_(opt), rank_(comm.rank()), n_(comm.world_size()) {}

  ~GpuBench() {
    free_row();
#ifdef GRADSYNC_BENCH_NCCL
    if (nccl_ != nullptr) {
      if (fatal_.empty())
        ncclCommDestroy(nccl_);
      else
        ncclCommAbort(nccl_);  // a peer may never come: do not wait for it
    }
#endif
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int run() {
    if (!setup()) return die();
    if (opt_.timeline) return timeline_run();
    header();
    const std::vector<size_t> all_sizes = sizes(opt_);
    // The copying collectives have no op: one pass, printed as nccl-tests does.
    const std::vector<OpName> ops =
        reduces(opt_.collective) ? opt_.ops : std::vector<OpName>{{ReduceOp::kSum, "none"}};
    for (const auto& t : opt_.types) {
      for (const auto& o : ops) {
        for (size_t bytes : all_sizes) {
          const bool ok = row(t, o, bytes);
          if (!fatal_.empty()) return die();
          if (!ok) break;  // a failed row: skip the larger sizes of this type and op
        }
      }
    }
    footer();
    return (total_wrong_ > 0 || failures_ > 0) ? 1 : 0;
  }

 private:
  // Device, stream, events, NCCL; false with fatal_ set when something is missing.
  bool setup() {
    int count = 0;
    if (!cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount")) return false;
    device_ = comm_.device();
    if (device_ < 0 || device_ >= count) {
      fatal_ = "the communicator's CUDA device is " + std::to_string(device_) + " (gpu path " +
               comm_.gpu_path() + "), this process sees " + std::to_string(count) +
               " device(s) (CUDA_VISIBLE_DEVICES=" + env("CUDA_VISIBLE_DEVICES") + ")";
      return false;
    }
    if (!cuda(cudaSetDevice(device_), "cudaSetDevice")) return false;
    if (opt_.collective == Collective::kBroadcast && opt_.root >= n_) {
      fatal_ = "broadcast root " + std::to_string(opt_.root) + " outside [0, " +
               std::to_string(n_) + ")";
      return false;
    }
    if (!cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"))
      return false;
    if (!cuda(cudaEventCreate(&start_), "cudaEventCreate") ||
        !cuda(cudaEventCreate(&stop_), "cudaEventCreate"))
      return false;

    gradsync::CallOptions call_options{opt_.algo};
    libs_.push_back(
        {"gradsync", true,
         [this, call_options](const Row& w, const void* send, void* recv) {
           gradsync::Status s;
           switch (w.collective) {
             case Collective::kReduceScatter:
               s = comm_.reduce_scatter(send, recv, w.count, w.type, w.op, stream_, call_options);
               break;
             case Collective::kAllGather:
               s = comm_.all_gather(send, recv, w.count, w.type, stream_, call_options);
               break;
             case Collective::kBroadcast:
               s = comm_.broadcast(recv, w.count, w.type, w.root, stream_, call_options);
               break;
             default:
               s = comm_.allreduce(send, recv, w.count, w.type, w.op, stream_, call_options);
               break;
           }
           return s.ok() ? std::string() : s.to_string();
         },
         [this] {
           gradsync::Status s = comm_.async_error();
           return s.ok() ? std::string() : s.to_string();
         }});
#ifdef GRADSYNC_BENCH_NCCL
    if (opt_.nccl) {
      ncclUniqueId id;
      std::memset(&id, 0, sizeof id);
      // On failure die() aborts the job: the others fail in the broadcast, not hang there.
      if (rank_ == 0 && !nccl(ncclGetUniqueId(&id), "ncclGetUniqueId")) return false;
      if (gradsync::Status s = comm_.broadcast(&id, sizeof id, DataType::kUInt8, 0); !s.ok()) {
        fatal_ = "broadcasting the ncclUniqueId: " + s.to_string();
        return false;
      }
      if (!nccl(ncclCommInitRank(&nccl_, n_, id, rank_), "ncclCommInitRank")) return false;
      libs_.push_back(
          {"NCCL", false,
           [this](const Row& w, const void* send, void* recv) {
             const ncclDataType_t t = nccl_type(w.type);
             ncclResult_t r;
             switch (w.collective) {
               case Collective::kReduceScatter:
                 r = ncclReduceScatter(send, recv, w.count, t, nccl_op(w.op), nccl_, stream_);
                 break;
               case Collective::kAllGather:
                 r = ncclAllGather(send, recv, w.count, t, nccl_, stream_);
                 break;
               case Collective::kBroadcast:
                 r = ncclBroadcast(send, recv, w.count, t, w.root, nccl_, stream_);
                 break;
               default:
                 r = ncclAllReduce(send, recv, w.count, t, nccl_op(w.op), nccl_, stream_);
                 break;
             }
             return r == ncclSuccess ? std::string() : nccl_error(r);
           },
           [this] {
             ncclResult_t async = ncclSuccess;
             ncclResult_t r = ncclCommGetAsyncError(nccl_, &async);
             if (r != ncclSuccess) return nccl_error(r);
             return async == ncclSuccess ? std::string() : nccl_error(async);
           }});
    }
#endif
    // Which device each rank uses, for the header.
    cudaDeviceProp prop{};
    if (!cuda(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties")) return false;
    device_name_ = prop.name;
    auto all = bench::gather(comm_, {double(device_), double(prop.pciDomainID), double(prop.pciBusID),
                              double(prop.pciDeviceID)});
    if (!all.ok()) {
      fatal_ = "gathering the ranks' devices: " + all.status().to_string();
      return false;
    }
    devices_ = *all;
    return true;
  }

  void header() {
    if (rank_ != 0) return;
    std::string types, ops;
    for (const auto& t : opt_.types) types += std::string(types.empty() ? "" : ",") + t.name;
    for (const auto& o : opt_.ops) ops += std::string(ops.empty() ? "" : ",") + o.name;
    std::printf("# gradsync-bench %s  nranks %d  node %s  pid %d\n", name(opt_.collective), n_,
                session_.node_name().c_str(), int(getpid()));
    std::printf(
        "# minBytes %zu maxBytes %zu step: %zu(factor) warmup iters: %d iters: %d "
        "validation: %d\n# type %s  redop %s  algo %s  device %s  nccl %d\n",
        opt_.min_bytes, opt_.max_bytes, opt_.factor, opt_.warmup, opt_.iters, int(opt_.check),
        types.c_str(), ops.c_str(), name(opt_.algo), name(opt_.device), int(opt_.nccl));
    std::printf("# gpu path: %s\n", comm_.gpu_path().c_str());
    if (opt_.collective == Collective::kBroadcast) {
      std::printf(
          "# root %d; gradsync's broadcast has one buffer: no out-of-place group, the "
          "ratios compare the in-place groups\n",
          opt_.root);
    }
    int runtime = 0, driver = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    std::printf("# CUDA runtime %d.%d, driver %d.%d; rank 0's device: %s\n", runtime / 1000,
                runtime % 1000 / 10, driver / 1000, driver % 1000 / 10, device_name_.c_str());
#ifdef GRADSYNC_BENCH_NCCL
    if (opt_.nccl) {
      int v = 0;
      ncclGetVersion(&v);
      std::printf("# NCCL version %d.%d.%d (built against %d.%d.%d)\n", v / 10000, v % 10000 / 100,
                  v % 100, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
    }
#endif
    std::printf("# CUDA_VISIBLE_DEVICES=%s  NCCL_NVLS_ENABLE=%s\n",
                env("CUDA_VISIBLE_DEVICES").c_str(), env("NCCL_NVLS_ENABLE").c_str());
    for (int r = 0; r < n_; ++r) {
      const double* d = &devices_[r * 4];
      std::printf("#  rank %2d  device %2d  [%04x:%02x:%02x]\n", r, int(d[0]), unsigned(d[1]),
                  unsigned(d[2]), unsigned(d[3]));
    }
    std::printf("#\n# %10s  %12s  %8s  %6s  %-31s  %-31s", "", "", "", "", "gradsync out-of-place",
                "gradsync in-place");
    if (opt_.nccl)
      std::printf("  %-23s  %-15s  %s", "NCCL out-of-place", "NCCL in-place",
                  ratio_in_place() ? "gradsync/NCCL, in-place" : "gradsync/NCCL, out-of-place");
    std::printf("\n# %10s  %12s  %8s  %6s", "size", "count", "type", "redop");
    for (int g = 0; g < 2; ++g) std::printf("  %7s  %6s  %6s  %6s", "time", "algbw", "busbw", "#wrong");
    if (opt_.nccl)
      std::printf("  %7s  %6s  %6s  %7s  %6s  %11s  %10s", "time", "busbw", "#wrong", "time",
                  "busbw", "busbw ratio", "time ratio");
    std::printf("\n# %10s  %12s  %8s  %6s", "(B)", "(elements)", "", "");
    for (int g = 0; g < 2; ++g) std::printf("  %7s  %6s  %6s  %6s", "(us)", "(GB/s)", "(GB/s)", "");
    if (opt_.nccl)
      std::printf("  %7s  %6s  %6s  %7s  %6s  %11s  %10s", "(us)", "(GB/s)", "", "(us)", "(GB/s)",
                  "", "");
    std::printf("\n");
    std::fflush(stdout);
  }

  // Frees the previous row and describes the next: type, op, sizes of its buffers.
  Row& start_row(const TypeName& t, const OpName& o, size_t bytes) {
    Row& w = row_;
    free_row();
    w.collective = opt_.collective;
    w.type = t.type;
    w.op = o.op;
    w.root = opt_.root;
    w.rank = rank_;
    w.esize = esize_of(t.type);
    const Geometry g = geometry(opt_.collective, bytes, w.esize, n_);
    w.count = g.count;
    w.bytes = g.bytes;
    w.send_elems = g.send_elems;
    w.recv_elems = g.recv_elems;
    w.alloc = std::max(g.send_elems, g.recv_elems) * w.esize;
    w.bus_factor = g.bus_factor;
    return w;
  }

  // One row; false when a group failed (the caller skips the larger sizes of its type/op).
  bool row(const TypeName& t, const OpName& o, size_t bytes) {
    Row& w = start_row(t, o, bytes);
    // Allocated once for the row, shared by every group (at least 1 byte: -b 0); both the size
    // of the larger buffer, for the in-place layouts.
    if (!cuda(cudaMalloc(&w.d_send, std::max<size_t>(w.alloc, 1)), "cudaMalloc") ||
        !cuda(cudaMalloc(&w.d_recv, std::max<size_t>(w.alloc, 1)), "cudaMalloc"))
      return false;
    make_data(w, rank_, n_);
    w.out.resize(w.alloc);
    const std::string label =
        std::string(name(opt_.collective)) + " " + t.name +
        (reduces(opt_.collective) ? std::string(" ") + o.name : std::string());

    Cell cells[kCells];
    for (size_t li = 0; li < libs_.size(); ++li) {
      for (int ip = 0; ip < 2; ++ip) {
        const bool in_place = ip == 1;
        if (in_place ? !opt_.in_place : !opt_.out_of_place) continue;
        if (!in_place && w.collective == Collective::kBroadcast && libs_[li].one_buffer_broadcast)
          continue;
        // NCCL's in-place group has no #wrong column: it is timed, not checked.
        const bool check = opt_.check && !(li == 1 && in_place);
        Cell& c = cells[li * 2 + ip];
        c = group(libs_[li], w, in_place, check, label);
        if (!fatal_.empty()) return false;
        if (c.failed) break;  // this library's in-place group would fail the same way
      }
    }

    std::vector<double> mine;
    for (const Cell& c : cells) {
      mine.insert(mine.end(), {c.time_us, double(c.wrong / size_t(kHalf)),
                               double(c.wrong % size_t(kHalf)), c.failed ? 1.0 : 0.0,
                               c.ran ? 1.0 : 0.0});
    }
    auto all = bench::gather(comm_, mine);
    if (!all.ok()) {
      fatal_ = label + " " + std::to_string(w.bytes) + " B: gathering results failed: " +
               all.status().to_string();
      return false;
    }
    // Every rank takes the same decisions from the same gathered numbers; rank 0 prints.
    Cell sum[kCells];
    for (int ci = 0; ci < kCells; ++ci) {
      for (int r = 0; r < n_; ++r) {
        const double* f = &(*all)[(r * kCells + ci) * kFields];
        sum[ci].time_us = std::max(sum[ci].time_us, f[0]);
        sum[ci].wrong += size_t(f[1] * kHalf + f[2]);
        sum[ci].failed |= f[3] != 0;
        sum[ci].ran |= f[4] != 0;
      }
    }
    bool failed = false;
    std::string line;
    auto bw = [&](const Cell& c) { return c.time_us > 0 ? double(w.bytes) / c.time_us / 1e3 : 0; };
    for (int ci = 0; ci < kCells; ++ci) {
      const Cell& c = sum[ci];
      const bool is_nccl = ci >= 2;
      if (is_nccl && !opt_.nccl) break;
      const bool checked = opt_.check && ci != 3;
      total_wrong_ += c.wrong;
      (is_nccl ? nccl_wrong_ : gs_wrong_) += c.wrong;
      failed |= c.failed;
      if (c.failed) (is_nccl ? nccl_failures_ : gs_failures_)++;
      const double algbw = bw(c), busbw = algbw * w.bus_factor;
      if (c.ran && !c.failed) {
        (is_nccl ? nccl_bw_sum_ : gs_bw_sum_) += busbw;
        (is_nccl ? nccl_bw_lines_ : gs_bw_lines_)++;
      }
      const std::string wrong = checked ? std::to_string(c.wrong) : "N/A";
      char cell[96];
      const char* mark = !c.ran ? "-" : c.failed ? "FAILED" : nullptr;  // instead of numbers
      if (!is_nccl) {
        if (mark)
          std::snprintf(cell, sizeof cell, "  %7s  %6s  %6s  %6s", mark, "-", "-", "-");
        else
          std::snprintf(cell, sizeof cell, "  %7s  %6.2f  %6.2f  %6s", time_str(c.time_us).c_str(),
                        algbw, busbw, wrong.c_str());
      } else if (ci == 2) {
        if (mark)
          std::snprintf(cell, sizeof cell, "  %7s  %6s  %6s", mark, "-", "-");
        else
          std::snprintf(cell, sizeof cell, "  %7s  %6.2f  %6s", time_str(c.time_us).c_str(), busbw,
                        wrong.c_str());
      } else {
        if (mark)
          std::snprintf(cell, sizeof cell, "  %7s  %6s", mark, "-");
        else
          std::snprintf(cell, sizeof cell, "  %7s  %6.2f", time_str(c.time_us).c_str(), busbw);
      }
      line += cell;
    }
    if (opt_.nccl) {
      const Cell &gs = sum[ratio_in_place() ? 1 : 0], &nc = sum[ratio_in_place() ? 3 : 2];
      char cell[64];
      if (gs.ran && nc.ran && !gs.failed && !nc.failed && gs.time_us > 0 && nc.time_us > 0) {
        // busbw ratio = (bytes / gs time) / (bytes / NCCL time): the bus factor cancels.
        const double busbw_ratio = nc.time_us / gs.time_us, time_ratio = gs.time_us / nc.time_us;
        std::snprintf(cell, sizeof cell, "  %11.3f  %10.3f", busbw_ratio, time_ratio);
        log_ratio_sum_ += std::log(busbw_ratio);
        ++ratios_;
        if (busbw_ratio < worst_ratio_) worst_ratio_ = busbw_ratio, worst_bytes_ = w.bytes;
      } else {
        std::snprintf(cell, sizeof cell, "  %11s  %10s", "-", "-");
      }
      line += cell;
    }
    if (rank_ == 0) {
      std::printf("%12zu  %12zu  %8s  %6s%s\n", w.bytes, w.count, t.name, o.name, line.c_str());
      if (failed) {
        std::printf(
            "# %s failed (each failing rank printed why on stderr); skipping its larger sizes\n",
            label.c_str());
      }
      std::fflush(stdout);
    }
    if (failed) ++failures_;
    return !failed;
  }

  // Checked call, warm-up, timed iterations of one library on the row's buffers.
  Cell group(const Library& lib, Row& w, bool in_place, bool check, const std::string& label) {
    Cell c;
    c.ran = true;
    // Layouts as nccl-tests: in place, reduce_scatter's recv is this rank's block of send and
    // all_gather's send this rank's block of recv; a one-buffer broadcast uses recv.
    auto* const r0 = static_cast<uint8_t*>(w.d_recv);
    const size_t block = size_t(rank_) * w.count * w.esize;
    const bool bcast = w.collective == Collective::kBroadcast;
    void* recv = w.collective == Collective::kReduceScatter && in_place ? r0 + block : r0;
    void* send = !in_place && !(bcast && lib.one_buffer_broadcast) ? w.d_send
                 : w.collective == Collective::kAllGather          ? r0 + block
                                                                   : r0;
    const size_t send_bytes = w.send_elems * w.esize, recv_bytes = w.recv_elems * w.esize;
    const char* title = in_place ? "in-place" : "out-of-place";
    auto failed = [&](const std::string& why) {
      std::fprintf(stderr, "gradsync-bench: rank %d: %s %s %zu B %s failed: %s\n", rank_, lib.name,
                   label.c_str(), w.bytes, title, why.c_str());
      std::fflush(stderr);
      c.failed = true;
      return c;
    };
    auto async_failed = [&](const char* when) {
      if (std::string e = lib.async_error(); !e.empty()) {
        fatal_ = std::string(lib.name) + " " + label + " " + std::to_string(w.bytes) + " B " +
                 title + ": asynchronous error " + when + ": " + e;
        return true;
      }
      return false;
    };
    if (check) {
      // Poison the output (0x7f bytes: NaN or a huge value in the float types, 127 or more in
      // the integer types, all outside the patterns' results), then upload the input.
      // Both on the legacy stream, which does not order against stream_ (non-blocking), and
      // cudaMemcpy from pageable memory may return before the data landed: synchronise the
      // device before the call reads the buffers.
      // A broadcast's input is uploaded on the root only: the others must receive it.
      const bool upload = !bcast || rank_ == w.root;
      if (!cuda(cudaMemset(w.d_recv, 0x7f, w.alloc), "cudaMemset") ||
          (upload && !cuda(cudaMemcpy(send, w.in.data(), send_bytes, cudaMemcpyHostToDevice),
                           "cudaMemcpy")) ||
          !cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (uploads)"))
        return c;
      if (std::string e = lib.call(w, send, recv); !e.empty()) return failed(e);
      if (!cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (checked call)")) return c;
      if (async_failed("in the checked call")) return c;
      if (!cuda(cudaMemcpy(w.out.data(), recv, recv_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy"))
        return c;
      c.wrong = count_wrong(w, w.out.data());
      if (!in_place && !bcast) {
        if (!cuda(cudaMemcpy(w.out.data(), send, send_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy"))
          return c;
        c.wrong += count_changed(w, w.out.data());
      }
    }
    // Timed data. In place the result feeds the next call: a fixed point of the op (0 for sum,
    // 1 otherwise). Out of place the input as checked (or uploaded now).
    if (in_place) {
      fill_constant(w, w.op == ReduceOp::kSum ? 0 : 1);
      if (!cuda(cudaMemcpy(w.d_recv, w.out.data(), w.alloc, cudaMemcpyHostToDevice), "cudaMemcpy"))
        return c;
    } else if (!check) {
      if (!cuda(cudaMemcpy(w.d_send, w.in.data(), send_bytes, cudaMemcpyHostToDevice),
                "cudaMemcpy"))
        return c;
    }
    if (!cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (uploads)")) return c;
    for (int i = 0; i < opt_.warmup; ++i) {
      if (std::string e = lib.call(w, send, recv); !e.empty()) return failed(e);
    }
    if (!cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (warm-up)")) return c;
    if (async_failed("in the warm-up calls")) return c;
    // Start together, so that the slowest rank's time is the collective's.
    if (gradsync::Status s = bench::sync(comm_); !s.ok()) {
      fatal_ = "host barrier before timing: " + s.to_string();
      return c;
    }
    if (!cuda(cudaEventRecord(start_, stream_), "cudaEventRecord")) return c;
    for (int i = 0; i < opt_.iters; ++i) {
      if (std::string e = lib.call(w, send, recv); !e.empty()) {
        cudaStreamSynchronize(stream_);  // what was queued drains before the next group
        return failed(e);
      }
    }
    if (!cuda(cudaEventRecord(stop_, stream_), "cudaEventRecord") ||
        !cuda(cudaEventSynchronize(stop_), "cudaEventSynchronize (timed calls)"))
      return c;
    if (async_failed("in the timed calls")) return c;
    float ms = 0;
    if (!cuda(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime")) return c;
    c.time_us = double(ms) * 1e3 / opt_.iters;
    return c;
  }

  // ---- --timeline 1 --------------------------------------------------------------------------
  //
  // Per type, op and size: `warmup` calls queued back to back, then one more whose in-kernel
  // timeline (runtime/gpu/timeline.h) every rank reads; all ranks' timelines meet on rank 0
  // (host int64 allreduces), which prints. kRecorded such calls per size; the figures are
  // their means (hidden: also the lowest and highest). Sizes that take the low-latency
  // protocol have no timeline and get a comment line.
  static constexpr int kRecorded = 3;

  int timeline_run() {
    if (comm_.gpu_path() != "cuda-ipc") {
      fatal_ = "--timeline 1 needs the cuda-ipc path (every rank on one node); this "
               "communicator's GPU path is " + comm_.gpu_path();
      return die();
    }
    if (rank_ == 0) {
      std::printf("# gradsync-bench --timeline 1: %s  nranks %d  node %s  warmup %d, %d recorded "
                  "calls per size\n",
                  name(opt_.collective), n_, session_.node_name().c_str(), opt_.warmup, kRecorded);
      std::printf(
          "# In-kernel %%globaltimer stamps of every block's thread 0 (runtime/gpu/timeline.h):\n"
          "#   push = a chunk's stores into the peers' slots until fenced (complete), fold = the\n"
          "#   reduction (copy for all_gather/broadcast) of a chunk the peers pushed.\n"
          "#   push(U), fold(U): time at least one block of the rank's GPU pushes, resp. folds;\n"
          "#   both: the time both happen; hidden = both / push(U), the fraction of transfer time\n"
          "#   spent while the GPU also reduced (mean, and [lowest highest] of the calls); fold\n"
          "#   hid = both / fold(U), the same overlap from the reduce side. GPU-wide: some block\n"
          "#   folds while others push (the profile under each size says how many).\n"
          "#   blk push/fold/credit/ready: one block's mean busy and wait times in the call;\n"
          "#   same-blk: push and fold of one block overlapping (0 by construction: a block\n"
          "#   fences its push of chunk i+1 before it folds chunk i). dropped: chunks a call\n"
          "#   ran beyond the recorded ones (the figures cover the recorded ones; wall is the\n"
          "#   whole call). tick: smallest step between distinct stamps (at most the timer's).\n"
          "#   peer lines: the peer's pushes (landing in this rank's slots) against rank 0's\n"
          "#   folds, the peer's clock mapped by the offset range its flag hand-offs allow.\n");
      std::printf("# %10s  %4s  %6s  %9s  %9s  %9s  %9s  %-17s  %8s  %8s  %8s  %8s  %8s  %8s  %7s  %5s\n",
                  "size", "rank", "chunks", "wall", "push(U)", "fold(U)", "both", "hidden",
                  "fold hid", "blk push", "blk fold", "credit", "ready", "same-blk", "dropped", "tick");
      std::printf("# %10s  %4s  %6s  %9s  %9s  %9s  %9s  %-17s  %8s  %8s  %8s  %8s  %8s  %8s  %7s  %5s\n",
                  "(B)", "", "/block", "(us)", "(us)", "(us)", "(us)", "mean [low high]", "(mean)",
                  "(us)", "(us)", "(us)", "(us)", "(us)", "", "(ns)");
      std::fflush(stdout);
    }
    const std::vector<OpName> ops =
        reduces(opt_.collective) ? opt_.ops : std::vector<OpName>{{ReduceOp::kSum, "none"}};
    int malformed = 0;
    for (const auto& t : opt_.types) {
      for (const auto& o : ops) {
        for (size_t bytes : sizes(opt_)) {
          if (!timeline_size(t, o, bytes, &malformed)) return die();
        }
      }
    }
    if (rank_ == 0) {
      std::printf("# %d malformed timelines\n#\n", malformed);
      std::fflush(stdout);
    }
    return malformed > 0 ? 1 : 0;
  }

  // One size; false with fatal_ set when the bench cannot go on.
  bool timeline_size(const TypeName& t, const OpName& o, size_t bytes, int* malformed) {
    Row& w = start_row(t, o, bytes);
    if (w.count == 0) return true;
    if (!cuda(cudaMalloc(&w.d_send, std::max<size_t>(w.alloc, 1)), "cudaMalloc") ||
        !cuda(cudaMalloc(&w.d_recv, std::max<size_t>(w.alloc, 1)), "cudaMalloc"))
      return false;
    make_data(w, rank_, n_);
    const bool bcast = w.collective == Collective::kBroadcast;
    void* send = bcast ? w.d_recv : w.d_send;
    void* recv = w.d_recv;
    if (!cuda(cudaMemcpy(send, w.in.data(), w.in.size(), cudaMemcpyHostToDevice), "cudaMemcpy") ||
        !cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (uploads)"))
      return false;
    const std::string label = std::string(name(opt_.collective)) + " " + t.name +
                              (reduces(opt_.collective) ? std::string(" ") + o.name : "");

    struct Sums {
      double wall = 0, push = 0, fold = 0, both = 0, hidden = 0, fold_hidden = 0, bpush = 0,
             bfold = 0, credit = 0, ready = 0, same = 0;
      double hidden_lo = 1, hidden_hi = 0;
      uint64_t dropped = 0, tick = 0;
      uint32_t chunks = 0;
      int calls = 0;
      // the peer's pushes against rank 0's folds
      double peer_lo = 1, peer_hi = 0, off_lo = 0, off_hi = 0;
      int peer_calls = 0;
      std::string peer_note;
    };
    std::vector<Sums> per(static_cast<size_t>(n_));
    std::vector<gradsync::gpu::Timeline> last;
    for (int k = 0; k < kRecorded; ++k) {
      if (gradsync::Status s = bench::sync(comm_); !s.ok()) {
        fatal_ = "host barrier before the timeline calls: " + s.to_string();
        return false;
      }
      for (int i = 0; i <= opt_.warmup; ++i) {
        if (std::string e = libs_[0].call(w, send, recv); !e.empty()) {
          fatal_ = label + " " + std::to_string(w.bytes) + " B: " + e;
          return false;
        }
      }
      auto tl = gradsync::gpu::last_timeline(comm_);
      if (!tl.ok() && tl.status().code() != gradsync::Code::kFailedPrecondition) {
        fatal_ = label + " " + std::to_string(w.bytes) + " B: timeline: " + tl.status().to_string();
        return false;
      }
      if (!tl.ok()) {
        // The low-latency protocol (the same decision on every rank): nothing recorded.
        if (!cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")) return false;
        if (rank_ == 0) {
          if (said_no_timeline_)
            std::printf("  %10zu  no timeline (low-latency protocol)\n", w.bytes);
          else
            std::printf("  %10zu  %s: no timeline: %s\n", w.bytes, label.c_str(),
                        tl.status().message().c_str());
          said_no_timeline_ = true;
          std::fflush(stdout);
        }
        return true;
      }
      auto all = gradsync::gpu::all_timelines(comm_, &*tl);
      if (!all.ok()) {
        fatal_ = "exchanging the timelines: " + all.status().to_string();
        return false;
      }
      if (rank_ != 0) continue;
      for (int r = 0; r < n_; ++r) {
        const gradsync::gpu::Timeline& x = (*all)[size_t(r)];
        if (x.world == 0) {
          fatal_ = "rank " + std::to_string(r) + "'s timeline did not arrive";
          return false;
        }
        if (std::string why = gradsync::gpu::check_well_formed(x); !why.empty()) {
          std::printf("# MALFORMED timeline, rank %d, %zu B: %s\n", r, w.bytes, why.c_str());
          ++*malformed;
        }
        const auto& m = x.summary;
        Sums& a = per[size_t(r)];
        a.wall += m.wall_us;
        a.push += m.push_us;
        a.fold += m.fold_us;
        a.both += m.overlap_us;
        a.hidden += m.hidden;
        a.fold_hidden += m.fold_hidden;
        a.hidden_lo = std::min(a.hidden_lo, m.hidden);
        a.hidden_hi = std::max(a.hidden_hi, m.hidden);
        a.bpush += m.block_push_us;
        a.bfold += m.block_fold_us;
        a.credit += m.block_credit_wait_us;
        a.ready += m.block_ready_wait_us;
        a.same += m.same_block_overlap_us;
        a.dropped += m.dropped_chunks;
        a.tick = a.tick == 0 ? m.granularity_ns : std::min(a.tick, m.granularity_ns);
        a.chunks = m.max_chunks_per_block;
        ++a.calls;
        if (r == 0) continue;
        const auto p = gradsync::gpu::overlap_with_peer((*all)[0], x);
        if (!p.ok) {
          a.peer_note = p.why;
          continue;
        }
        if (!p.why.empty()) a.peer_note = p.why;
        a.peer_lo = std::min(a.peer_lo, p.hidden_lo);
        a.peer_hi = std::max(a.peer_hi, p.hidden_hi);
        if (a.peer_calls == 0 || p.offset_lo_ns < a.off_lo) a.off_lo = p.offset_lo_ns;
        if (a.peer_calls == 0 || p.offset_hi_ns > a.off_hi) a.off_hi = p.offset_hi_ns;
        ++a.peer_calls;
      }
      last = std::move(*all);
    }
    if (rank_ != 0) return true;
    for (int r = 0; r < n_; ++r) {
      const Sums& a = per[size_t(r)];
      const double c = std::max(1, a.calls);
      char hidden[32];
      std::snprintf(hidden, sizeof hidden, "%.3f [%.3f %.3f]", a.hidden / c, a.hidden_lo, a.hidden_hi);
      std::printf("  %10zu  %4d  %6u  %9.1f  %9.1f  %9.1f  %9.1f  %-17s  %8.3f  %8.1f  %8.1f  %8.1f  %8.1f  %8.2f  %7llu  %5llu\n",
                  w.bytes, r, a.chunks, a.wall / c, a.push / c, a.fold / c, a.both / c, hidden,
                  a.fold_hidden / c, a.bpush / c, a.bfold / c, a.credit / c, a.ready / c, a.same / c,
                  static_cast<unsigned long long>(a.dropped / uint64_t(c)),
                  static_cast<unsigned long long>(a.tick));
    }
    for (int r = 1; r < n_; ++r) {
      const Sums& a = per[size_t(r)];
      if (a.peer_calls == 0) {
        std::printf("#   peer %d -> rank 0: no figure: %s\n", r, a.peer_note.c_str());
        continue;
      }
      std::printf("#   peer %d -> rank 0: peer's push(U) under rank 0's fold(U): hidden [%.3f %.3f] "
                  "over clock offsets [%.2f %.2f] us (%d calls)%s%s\n",
                  r, a.peer_lo, a.peer_hi, a.off_lo / 1e3, a.off_hi / 1e3, a.peer_calls,
                  a.peer_note.empty() ? "" : "; ", a.peer_note.c_str());
    }
    print_text_timeline(last);
    std::fflush(stdout);
    return true;
  }

  // The first chunks of block 0 on every rank (peers mapped onto rank 0's clock by the
  // middle of their offset range), and rank 0's activity profile, from the last call.
  void footer() {
    if (rank_ != 0) return;
    std::printf("# Errors: %zu wrong elements, %d failed runs\n", total_wrong_, failures_);
    std::printf("#   gradsync: %zu wrong elements, %d failed groups", gs_wrong_, gs_failures_);
    if (opt_.nccl) std::printf("; NCCL: %zu wrong elements, %d failed groups", nccl_wrong_, nccl_failures_);
    std::printf("\n# Avg bus bandwidth    : %.4f \n", gs_bw_lines_ ? gs_bw_sum_ / gs_bw_lines_ : 0.0);
    if (opt_.nccl) {
      std::printf("# Avg NCCL bus bandwidth: %.4f \n",
                  nccl_bw_lines_ ? nccl_bw_sum_ / nccl_bw_lines_ : 0.0);
      if (ratios_ > 0) {
        std::printf(
            "# busbw ratio gradsync/NCCL, %s: geometric mean %.3f over %d rows, "
            "lowest %.3f at %zu B\n",
            ratio_in_place() ? "in-place" : "out-of-place", std::exp(log_ratio_sum_ / ratios_),
            ratios_, worst_ratio_, worst_bytes_);
      }
    }
    std::printf("#\n");
    std::fflush(stdout);
  }

  // Something this bench cannot go on from (a CUDA error, an asynchronous error, the host
  // path gone): say so loudly everywhere and end the job.
  int die() {
    std::fprintf(stderr, "gradsync-bench: rank %d: FATAL: %s\n", rank_, fatal_.c_str());
    std::fflush(stderr);
    if (rank_ == 0) {
      std::printf("# FATAL (rank 0): %s\n", fatal_.c_str());
      std::fflush(stdout);
    }
    // The other ranks may wait for this one in a gradsync collective: end theirs now.
    (void)comm_.abort("gradsync-bench rank " + std::to_string(rank_) + ": " + fatal_);
    return 1;
  }

  // gradsync's broadcast has no out-of-place group: its ratio columns compare the in-place ones.
  bool ratio_in_place() const { return opt_.collective == Collective::kBroadcast; }

  bool cuda(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return true;
    if (fatal_.empty()) {
      fatal_ = std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
    }
    return false;
  }

#ifdef GRADSYNC_BENCH_NCCL
  bool nccl(ncclResult_t r, const char* what) {
    if (r == ncclSuccess) return true;
    if (fatal_.empty()) fatal_ = std::string(what) + ": " + nccl_error(r);
    return false;
  }
  std::string nccl_error(ncclResult_t r) const {
    std::string s = ncclGetErrorString(r);
    const char* last = ncclGetLastError(nccl_);
    if (last != nullptr && *last != '\0') s += std::string(" (") + last + ")";
    return s;
  }
#endif

  static std::string env(const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr ? v : "<unset>";
  }

  void free_row() {
    if (row_.d_send != nullptr) cudaFree(row_.d_send);
    if (row_.d_recv != nullptr) cudaFree(row_.d_recv);
    row_.d_send = row_.d_recv = nullptr;
  }

  gradsync::Session& session_;
  gradsync::Communicator& comm_;
  const Options& opt_;
  const int rank_, n_;
  int device_ = -1;
  std::string device_name_;
  std::vector<double> devices_;  // per rank: ordinal, PCI domain, bus, device
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
#ifdef GRADSYNC_BENCH_NCCL
  ncclComm_t nccl_ = nullptr;
#endif
  std::vector<Library> libs_;  // gradsync, then NCCL
  Row row_;
  std::string fatal_;
  bool said_no_timeline_ = false;  // --timeline 1: the low-latency note was printed in full

  size_t total_wrong_ = 0, gs_wrong_ = 0, nccl_wrong_ = 0;
  int failures_ = 0, gs_failures_ = 0, nccl_failures_ = 0;
  double gs_bw_sum_ = 0, nccl_bw_sum_ = 0;
  int gs_bw_lines_ = 0, nccl_bw_lines_ = 0;
  double log_ratio_sum_ = 0, worst_ratio_ = 1e300;
  size_t worst_bytes_ = 0;
  int ratios_ = 0;
};

}  // namespace

int run_gpu(gradsync::Session& session, gradsync::Communicator& comm, const Options& opt) {
  GpuBench bench(session, comm, opt);
  return bench.run();
}

}  // namespace bench
