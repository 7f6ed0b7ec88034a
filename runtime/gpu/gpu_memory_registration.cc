#include "gpu/gpu_memory_registration.h"

#include <cuda.h>  // types and enums only: the driver API is reached through entry points
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "common/log.h"

namespace gradsync {
namespace {

// Driver API functions, resolved once through the runtime (cudaGetDriverEntryPointByVersion,
// the CUDA 13 replacement of cudaGetDriverEntryPoint, with the version each symbol first had).
// A null entry has its reason in `why`.
struct DriverApi {
  PFN_cuMemGetHandleForAddressRange_v11070 get_handle = nullptr;
  PFN_cuFlushGPUDirectRDMAWrites_v11030 flush = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_attribute = nullptr;
  PFN_cuPointerSetAttribute_v6000 pointer_set_attribute = nullptr;
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  std::string why;  // what was missing, "" when all are there
};

// Resolves one entry; false when the runtime cannot reach the driver at all (then `why` says
// so once and the remaining entries are not tried).
template <typename Fn>
bool resolve(const char* symbol, unsigned version, Fn& out, std::string& why) {
  out = nullptr;
  if (why.rfind("no CUDA driver", 0) == 0) return false;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &found);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    why = std::string("no CUDA driver entry points (cudaGetDriverEntryPointByVersion: ") + cudaGetErrorName(e) +
          ", " + cudaGetErrorString(e) + ")";
    return false;
  }
  if (fn == nullptr || found != cudaDriverEntryPointSuccess) {
    const std::string what = found == cudaDriverEntryPointVersionNotSufficent
                                 ? "driver older than CUDA " + std::to_string(version / 1000) + "." +
                                       std::to_string(version % 1000 / 10)
                                 : "not in this driver";
    why += (why.empty() ? "" : "; ") + std::string(symbol) + ": " + what;
    return true;
  }
  out = reinterpret_cast<Fn>(fn);
  return true;
}

const DriverApi& driver() {
  static const DriverApi api = [] {
    DriverApi a;
    resolve("cuMemGetHandleForAddressRange", 11070, a.get_handle, a.why);
    resolve("cuFlushGPUDirectRDMAWrites", 11030, a.flush, a.why);
    resolve("cuDeviceGet", 2000, a.device_get, a.why);
    resolve("cuDeviceGetAttribute", 2000, a.device_attribute, a.why);
    resolve("cuPointerSetAttribute", 6000, a.pointer_set_attribute, a.why);
    resolve("cuGetErrorName", 6000, a.error_name, a.why);
    return a;
  }();
  return api;
}

std::string cu_error(CUresult rc) {
  const char* name = nullptr;
  if (driver().error_name && driver().error_name(rc, &name) == CUDA_SUCCESS && name)
    return std::string(name) + " (" + std::to_string(static_cast<int>(rc)) + ")";
  return "CUresult " + std::to_string(static_cast<int>(rc));
}

std::string cuda_error(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// nvidia-peermem (or the older Mellanox nv_peer_mem) loaded: the files NCCL and UCX check.
// Empty when loaded, else why not.
std::string peermem_missing() {
  std::error_code ec;
  for (const char* p : {"/sys/module/nvidia_peermem", "/sys/module/nv_peer_mem",
                        "/sys/kernel/mm/memory_peers/nv_mem/version"}) {
    if (std::filesystem::exists(p, ec)) return "";
  }
  return "nvidia-peermem is not loaded (no /sys/module/nvidia_peermem, /sys/module/nv_peer_mem or "
         "/sys/kernel/mm/memory_peers/nv_mem)";
}

// The dma-buf attempt: on success fills *fd_out and *mr_out, else returns the reason.
Status try_dmabuf(const verbs::ProtectionDomain& pd, uint64_t ptr, size_t bytes, int device, int access,
                  Fd* fd_out, verbs::MemoryRegion* mr_out) {
  const DriverApi& d = driver();
  if (!d.get_handle || !d.device_get || !d.device_attribute)
    return Status(Code::kUnavailable, "CUDA driver entry points missing: " + d.why);
  CUdevice cudev = 0;
  if (CUresult rc = d.device_get(&cudev, device); rc != CUDA_SUCCESS)
    return Status(Code::kUnavailable, "cuDeviceGet(" + std::to_string(device) + ") failed: " + cu_error(rc));
  int supported = 0;
  if (CUresult rc = d.device_attribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, cudev);
      rc != CUDA_SUCCESS)
    return Status(Code::kUnavailable, "reading DMA_BUF_SUPPORTED failed: " + cu_error(rc));
  if (!supported)
    return Status(Code::kUnavailable, "GPU " + std::to_string(device) +
                                          " reports DMA_BUF_SUPPORTED=0 (needs the open kernel module, "
                                          "driver >= 515, Turing or newer)");
  if (pd.api()->reg_dmabuf_mr == nullptr)
    return Status(Code::kUnavailable, pd.api()->reg_dmabuf_mr_missing ? pd.api()->reg_dmabuf_mr_missing
                                                                       : "no reg_dmabuf_mr in the verbs table");
  // The export must be host-page aligned: start rounded down, end rounded up.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t start = ptr & ~(page - 1);
  const uint64_t end = (ptr + bytes + page - 1) & ~(page - 1);
  int fd = -1;
  if (CUresult rc = d.get_handle(&fd, static_cast<CUdeviceptr>(start), end - start,
                                 CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
      rc != CUDA_SUCCESS)
    return Status(Code::kUnavailable, "cuMemGetHandleForAddressRange(" + hex(start) + ", " +
                                          std::to_string(end - start) + " bytes) failed: " + cu_error(rc) +
                                          " (the page-aligned range must lie in one allocation)");
  Fd owned(fd);
  auto mr = verbs::MemoryRegion::create_dmabuf(pd, owned.get(), 0, end - start, start, access);
  if (!mr.ok()) return mr.status();
  *fd_out = std::move(owned);
  *mr_out = std::move(mr).value();
  return Status::Ok();
}

}  // namespace

Result<GpuRegistration> register_gpu_memory(const verbs::ProtectionDomain& pd, void* dptr, size_t bytes,
                                            int access) {
  const uint64_t ptr = reinterpret_cast<uint64_t>(dptr);
  const std::string what = "GPU memory " + hex(ptr) + " (" + std::to_string(bytes) + " bytes)";
  if (dptr == nullptr || bytes == 0)
    return Status(Code::kInvalidArgument, "register_gpu_memory: null pointer or empty range (" + what + ")");
  cudaPointerAttributes attr{};
  if (cudaError_t e = cudaPointerGetAttributes(&attr, dptr); e != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(Code::kInvalidArgument, "register_gpu_memory: cannot tell what " + hex(ptr) +
                                              " is: cudaPointerGetAttributes: " + cuda_error(e));
  }
  if (attr.type != cudaMemoryTypeDevice) {
    const char* kind = attr.type == cudaMemoryTypeHost      ? "pinned host memory"
                       : attr.type == cudaMemoryTypeManaged ? "managed memory"
                                                            : "host memory unknown to CUDA";
    return Status(Code::kInvalidArgument,
                  "register_gpu_memory: " + hex(ptr) + " is " + kind +
                      ", not CUDA device memory (cudaMalloc); register host buffers with "
                      "verbs::MemoryRegion::create");
  }
  const int device = attr.device;
  auto log = log::get("gpu");
  // The driver calls below act on the current context: make it the buffer's GPU, and put the
  // caller's device back afterwards.
  struct DeviceGuard {
    int previous = -1;
    explicit DeviceGuard(int device) {
      if (cudaGetDevice(&previous) != cudaSuccess || (previous != device && cudaSetDevice(device) != cudaSuccess)) {
        (void)cudaGetLastError();
      }
    }
    ~DeviceGuard() {
      int now = -1;
      if (previous >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous &&
          cudaSetDevice(previous) != cudaSuccess)
        (void)cudaGetLastError();
    }
  } guard(device);

  GpuRegistration reg;
  reg.ptr_ = ptr;
  reg.bytes_ = bytes;
  reg.device_ = device;

  // 1. dma-buf.
  Status dmabuf = try_dmabuf(pd, ptr, bytes, device, access, &reg.fd_, &reg.mr_);
  if (dmabuf.ok()) {
    reg.method_ = "dma-buf";
  } else {
    // 2. nvidia-peermem: ibv_reg_mr straight on the device pointer.
    std::string peermem = peermem_missing();
    if (peermem.empty()) {
      auto mr = verbs::MemoryRegion::create(pd, dptr, bytes, access);
      if (mr.ok()) {
        reg.mr_ = std::move(mr).value();
        reg.method_ = "peermem";
        log->info("{} on GPU {} registered with {} via nvidia-peermem (dma-buf: {})", what, device,
                  pd.device(), dmabuf.message());
      } else {
        peermem = "nvidia-peermem is loaded but " + mr.status().message();
      }
    }
    if (reg.method_.empty())
      return Status(Code::kUnavailable, what + " on GPU " + std::to_string(device) +
                                            " cannot be registered with verbs device " + pd.device() +
                                            ": host staging will be used. dma-buf: " + dmabuf.message() +
                                            ". peermem: " + peermem);
  }
  // Best effort (rdma-core's CUDA dma-buf test and UCX do it): synchronous copies into the
  // buffer complete before they return, so the NIC never reads a half-landed cudaMemcpy.
  if (driver().pointer_set_attribute) {
    const unsigned int one = 1;
    if (CUresult rc = driver().pointer_set_attribute(&one, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                                                     static_cast<CUdeviceptr>(ptr));
        rc != CUDA_SUCCESS)
      log->warn("{}: CU_POINTER_ATTRIBUTE_SYNC_MEMOPS not set: {}", what, cu_error(rc));
  }
  if (reg.method_ == "dma-buf")
    log->debug("{} on GPU {} registered with {} via dma-buf (fd {}, MR {} + {} bytes)", what, device,
               pd.device(), reg.fd_.get(), hex(reg.mr_.addr()), reg.mr_.length());
  return reg;
}

Result<bool> gdr_flush_needed(int device) {
  int ordering = 0;
  if (cudaError_t e = cudaDeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, device);
      e != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(Code::kUnavailable, "GPU " + std::to_string(device) +
                                          ": reading GPU_DIRECT_RDMA_WRITES_ORDERING failed: " + cuda_error(e));
  }
  return ordering < CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER;
}

Status flush_gdr_writes() {
  if (!driver().flush)
    return Status(Code::kUnavailable, "cuFlushGPUDirectRDMAWrites unavailable: " + driver().why);
  // The driver call acts on the current context: make the current device's primary context
  // current (cudaSetDevice initialises it since CUDA 12).
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(Code::kUnavailable, "flush_gdr_writes: no current CUDA device: " + cuda_error(e));
  }
  if (CUresult rc = driver().flush(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                                   CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER);
      rc != CUDA_SUCCESS)
    return Status(Code::kInternal, "GPU " + std::to_string(device) +
                                       ": cuFlushGPUDirectRDMAWrites failed: " + cu_error(rc));
  return Status::Ok();
}

}  // namespace gradsync
