// The host-staged path of the GPU communicator (gpu/device_comm.h): the stream copies pieces
// to pinned host memory, the worker runs the host collective on them, the stream copies the
// results back.
#include <cstring>

#include "common/log.h"
#include "gpu/device_comm_impl.h"
#include "kernels/cuda_reduce.cuh"

namespace gradsync {

using namespace device_comm_detail;

Status DeviceComm::setup_staged() {
  Impl& m = *impl_;
  const long fixed = env_positive("GRADSYNC_STAGE_PIECE", 0);
  m.piece_bytes = fixed > 0 ? std::max<size_t>(4096, size_t(fixed) / 64 * 64) : 0;
  // A reduce_scatter or all_gather piece holds at least one element (8 bytes at most) of every
  // rank's segment.
  m.slot_bytes =
      std::max(m.piece_bytes ? m.piece_bytes : kMaxPiece, (size_t(cfg_.world_size) * 8 + 63) / 64 * 64);
  int pitch = 0;
  GS_CUDA(cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, cfg_.device),
          "cudaDeviceGetAttribute");
  m.max_pitch = size_t(std::max(pitch, 0));
  void* p = nullptr;
  GS_CUDA(cudaHostAlloc(&p, Impl::kStagingSlots * m.slot_bytes, cudaHostAllocDefault),
          "cudaHostAlloc of the staging slots");
  m.staging = static_cast<uint8_t*>(p);
  m.held.pinned_host_bytes += Impl::kStagingSlots * m.slot_bytes;
  return Status::Ok();
}

// Host-staged. Everything the GPU does is queued now, on the caller's stream; the worker
// makes no CUDA call (one could wait behind a synchronous copy the caller makes while the
// stream waits for the worker). Pieces cycle through kStagingSlots pinned slots:
//   D2H p0, signal(landed) ... D2H p(K-1), signal(landed),
//   for each piece i: wait(reduced >= i), H2D p_i, D2H p_(i+K), signal(landed),
//   signal(done).
// The worker waits for `landed`, runs the host collective on the slot, publishes `reduced`.
// Stream order makes slot reuse safe: D2H of piece i + K is queued after H2D of piece i (and
// after the wait for the worker's piece i, where a rank copies nothing back).
// Piece i covers element offsets [i * per, i * per + len(i)) of the segment; reduce_scatter
// and all_gather stage that range of every rank's segment, as `rows` rows of len(i) elements.
Status DeviceComm::run_staged(const CollectiveCall& c, cudaStream_t stream, uint64_t number) {
  Impl& m = *impl_;
  const int n = cfg_.world_size, me = cfg_.rank;
  const size_t es = element_size(c.type);
  const int rows = strided(c.kind) ? n : 1;
  const size_t piece = m.piece_bytes ? m.piece_bytes : piece_for(c.count * es * size_t(rows));
  const size_t per = std::max<size_t>(1, piece / (es * size_t(rows)));
  const size_t pieces = (c.count + per - 1) / per;
  const size_t K = Impl::kStagingSlots;
  const uint64_t seq = ++m.staged_seq;
  const uint64_t base = m.pieces_queued;
  m.pieces_queued += pieces;
  const uint64_t timeout_ns = uint64_t(cfg_.op_timeout.count()) * 1'000'000ull;
  const bool root = c.kind == CollectiveKind::kBroadcast && c.root == me;
  const bool leaf = c.kind == CollectiveKind::kBroadcast && c.root != me;
  const auto* send = static_cast<const uint8_t*>(c.send);
  auto* recv = static_cast<uint8_t*>(c.recv);
  const size_t seg_pitch = c.count * es;  // from one segment to the next in a strided buffer
  HostWords* w = m.words_dev;
  auto width = [&](size_t i) { return std::min(per, c.count - i * per) * es; };
  auto slot_mem = [&](size_t i) { return m.staging + (i % K) * m.slot_bytes; };
  // rows x `bytes`: one 2D copy where the pitches allow it, else a copy per row.
  auto copy_rows = [&](uint8_t* dst, size_t dpitch, const uint8_t* src, size_t spitch, size_t bytes,
                       cudaMemcpyKind kind) -> Status {
    if (dpitch <= m.max_pitch && spitch <= m.max_pitch) {
      GS_CUDA(cudaMemcpy2DAsync(dst, dpitch, src, spitch, bytes, size_t(rows), kind, stream),
              "cudaMemcpy2DAsync");
      return Status::Ok();
    }
    for (int r = 0; r < rows; ++r) {
      GS_CUDA(cudaMemcpyAsync(dst + r * dpitch, src + r * spitch, bytes, kind, stream),
              "cudaMemcpyAsync");
    }
    return Status::Ok();
  };
  auto d2h = [&](size_t i) -> Status {
    const size_t off = i * per * es, len = width(i);
    uint8_t* slot = slot_mem(i);
    if (c.kind == CollectiveKind::kReduceScatter) {
      GS_RETURN_IF_ERROR(copy_rows(slot, len, send + off, seg_pitch, len, cudaMemcpyDeviceToHost));
    } else if (!leaf) {  // a broadcast's non-root sends nothing
      uint8_t* at = c.kind == CollectiveKind::kAllGather ? slot + size_t(me) * len : slot;
      GS_CUDA(cudaMemcpyAsync(at, send + off, len, cudaMemcpyDeviceToHost, stream),
              "cudaMemcpyAsync device-to-host");
    }
    GS_CUDA(kernels::launch_signal_host(&w->landed, base + i + 1, nullptr, stream), "signal kernel");
    return Status::Ok();
  };
  auto h2d = [&](size_t i) -> Status {
    const size_t off = i * per * es, len = width(i);
    const uint8_t* slot = slot_mem(i);
    if (c.kind == CollectiveKind::kAllGather) {
      return copy_rows(recv + off, seg_pitch, slot, len, len, cudaMemcpyHostToDevice);
    }
    if (root) return Status::Ok();  // the root's buffer is the data
    const uint8_t* from = c.kind == CollectiveKind::kReduceScatter ? slot + size_t(me) * len : slot;
    GS_CUDA(cudaMemcpyAsync(recv + off, from, len, cudaMemcpyHostToDevice, stream),
            "cudaMemcpyAsync host-to-device");
    return Status::Ok();
  };
  // The ring entry of this call: the worker read the one of seq - kStampRing long ago.
  HostWords::Stamps* stamp_dev = &w->stamps[seq % HostWords::kStampRing];
  m.words->stamps[seq % HostWords::kStampRing].waited_ns = 0;
  auto queue_stream = [&]() -> Status {
    GS_CUDA(kernels::launch_signal_host(nullptr, 0, &stamp_dev->start_ns, stream), "signal kernel");
    for (size_t i = 0; i < std::min(K, pieces); ++i) GS_RETURN_IF_ERROR(d2h(i));
    for (size_t i = 0; i < pieces; ++i) {
      GS_CUDA(kernels::launch_wait_host(&w->reduced, base + i + 1, &w->abort, &w->error, timeout_ns,
                                        &stamp_dev->waited_ns, stream), "wait kernel");
      GS_RETURN_IF_ERROR(h2d(i));
      if (i + K < pieces) GS_RETURN_IF_ERROR(d2h(i + K));
    }
    GS_CUDA(kernels::launch_signal_host(&w->done, seq, &stamp_dev->done_ns, stream), "signal kernel");
    return Status::Ok();
  };
  // Wait kernels already queued would wait for pieces no worker task will reduce (and the
  // pieces' numbers are taken): the abort word ends them and the job fails together.
  if (Status s = queue_stream(); !s.ok()) return failed_to_queue(c, number, s);

  // One host collective per piece, numbered now (HostOps::enqueue).
  ops_.enqueue(pieces, [this, c, number, seq, base, pieces, per, rows, es, me](uint32_t first_seq) -> Status {
    Impl& m = *impl_;
    const auto deadline = Clock::now() + cfg_.op_timeout;
    auto word = [](const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); };
    const size_t K = Impl::kStagingSlots;
    const std::string what =
        std::string("staged ") + to_string(c.kind) + " #" + std::to_string(number);
    double network_us = 0;
    const auto t0 = Clock::now();
    Status s = Status::Ok();
    for (size_t i = 0; i < pieces && s.ok(); ++i) {
      auto landed = [&] { return word(&m.words->landed) >= base + i + 1 || !ops_.abort_reason().empty(); };
      if (!poll_until(landed, deadline)) {
        s = {Code::kDeadlineExceeded,
             who() + ": " + what + ": the stream did not copy piece " + std::to_string(i) +
                 " to host memory within the op timeout "
                 "(work queued before it on the stream is not finishing?)"};
        break;
      }
      if (std::string r = ops_.abort_reason(); !r.empty()) {
        s = {Code::kAborted, r};
        break;
      }
      // The host collective of the same kind on the slot, in place (the host API's in-place
      // layouts: reduce_scatter's recv is row `rank` of send, all_gather's send row `rank`).
      uint8_t* mem = m.staging + (i % K) * m.slot_bytes;
      CollectiveCall h = c;
      h.seq = first_seq + uint32_t(i);
      h.count = std::min(per, c.count - i * per);
      h.send = mem;
      h.recv = mem;
      if (c.kind == CollectiveKind::kReduceScatter) h.recv = mem + size_t(me) * h.count * es;
      if (c.kind == CollectiveKind::kAllGather) h.send = mem + size_t(me) * h.count * es;
      const auto n0 = Clock::now();
      s = ops_.run_on_worker(h);
      network_us += std::chrono::duration<double, std::micro>(Clock::now() - n0).count();
      if (s.ok()) __atomic_store_n(&m.words->reduced, base + i + 1, __ATOMIC_RELEASE);
    }
    if (!s.ok()) {
      {
        std::lock_guard lock(m.mu);
        if (m.staged_error.ok()) m.staged_error = s;
      }
      // Let the stream run on (its data is garbage now; every later call reports the error).
      __atomic_store_n(&m.words->reduced, ~uint64_t(0) >> 1, __ATOMIC_RELEASE);
      return s;
    }
    StagedTiming t;
    t.pieces = int(pieces);
    t.network_us = network_us;
    t.wall_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    if (m.log_timing) {
      // For the overlap figure only: wait (briefly) for the stream to finish this call, then
      // read its GPU-clock span and the time its wait kernels waited for the worker, from the
      // call's own ring entry (the stream may already be running later calls).
      const HostWords::Stamps* st = &m.words->stamps[seq % HostWords::kStampRing];
      if (poll_until([&] { return word(&m.words->done) >= seq; }, Clock::now() + std::chrono::seconds(5)) &&
          word(&st->done_ns) > word(&st->start_ns)) {
        const double span_us = double(word(&st->done_ns) - word(&st->start_ns)) / 1e3;
        const double waited_us = double(word(&st->waited_ns)) / 1e3;
        t.wall_us = span_us;
        t.copy_us = span_us - waited_us;  // the stream's busy time: copies (and its tiny kernels)
      }
    }
    {
      std::lock_guard lock(m.mu);
      m.timing = t;
    }
    if (m.log_timing && cfg_.rank == 0) {
      // The stream copies (busy time c) while the network reduces (n): of c, what did not
      // lengthen the call (span - n) was hidden.
      const double cp = t.copy_us,
                   hidden =
                       cp > 0 ? std::clamp(1.0 - (t.wall_us - t.network_us) / cp, 0.0, 1.0) : 0;
      log::get("gpu")->info(
          "{} {} bytes, {} pieces: span {:.0f} us, host {} {:.0f} us, stream "
          "copying {:.0f} us, copy time hidden {:.0f}%",
          what, c.count * es * size_t(rows), t.pieces, t.wall_us, to_string(c.kind), t.network_us,
          cp, 100 * hidden);
    }
    return s;
  });
  return Status::Ok();
}
}  // namespace gradsync
