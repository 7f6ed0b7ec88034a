#include "doctor/doctor.h"

#include <dlfcn.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>

#if GRADSYNC_HAVE_VERBS
#include "transport/verbs/verbs.h"
#endif

namespace gradsync::doctor {
namespace {

// Values from /usr/local/cuda/include/cuda.h (CUDA 13.0), checked by hand; doctor does not
// include cuda.h so it builds and runs where CUDA is absent.
constexpr int kAttrGpuDirectRdmaSupported = 116;      // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED
constexpr int kAttrGpuDirectRdmaWritesOrdering = 118;  // ..._GPU_DIRECT_RDMA_WRITES_ORDERING
constexpr int kAttrDmaBufSupported = 124;              // CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED

using CuInit = int (*)(unsigned);
using CuDriverGetVersion = int (*)(int*);
using CuDeviceGetCount = int (*)(int*);
using CuDeviceGet = int (*)(int*, int);
using CuDeviceGetName = int (*)(char*, int, int);
using CuDeviceGetPCIBusId = int (*)(char*, int, int);
using CuDeviceGetAttribute = int (*)(int*, int, int);
using CuGetErrorName = int (*)(int, const char**);

template <typename F>
F sym(void* lib, const char* name) {
  return reinterpret_cast<F>(dlsym(lib, name));
}

std::string cu_error(void* lib, int rc) {
  std::string text = "error " + std::to_string(rc);
  if (auto name_of = sym<CuGetErrorName>(lib, "cuGetErrorName")) {
    const char* name = nullptr;
    if (name_of(rc, &name) == 0 && name) text = std::string(name) + " (" + std::to_string(rc) + ")";
  }
  return text;
}

}  // namespace

topology::CudaFacts probe_cuda() {
  topology::CudaFacts facts;
  // Kept open for the life of the process: unloading libcuda after cuInit is not supported.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    facts.unavailable_reason = "libcuda.so.1 not found, CUDA not queried";
    return facts;
  }
  auto cu_init = sym<CuInit>(lib, "cuInit");
  auto get_version = sym<CuDriverGetVersion>(lib, "cuDriverGetVersion");
  auto get_count = sym<CuDeviceGetCount>(lib, "cuDeviceGetCount");
  auto get_device = sym<CuDeviceGet>(lib, "cuDeviceGet");
  auto get_name = sym<CuDeviceGetName>(lib, "cuDeviceGetName");
  auto get_bus_id = sym<CuDeviceGetPCIBusId>(lib, "cuDeviceGetPCIBusId");
  auto get_attr = sym<CuDeviceGetAttribute>(lib, "cuDeviceGetAttribute");
  if (!cu_init || !get_version || !get_count || !get_device || !get_name || !get_bus_id ||
      !get_attr) {
    facts.unavailable_reason = "libcuda.so.1 lacks an expected symbol";
    return facts;
  }
  if (int rc = cu_init(0); rc != 0) {
    facts.unavailable_reason = "cuInit failed: " + cu_error(lib, rc);
    return facts;
  }
  int count = 0;
  if (int rc = get_count(&count); rc != 0) {
    facts.unavailable_reason = "cuDeviceGetCount failed: " + cu_error(lib, rc);
    return facts;
  }
  facts.available = true;
  get_version(&facts.driver_version);
  for (int i = 0; i < count; ++i) {
    int dev = 0;
    if (get_device(&dev, i) != 0) continue;
    topology::CudaGpu g;
    char buf[256] = {};
    if (get_name(buf, sizeof(buf) - 1, dev) == 0) g.name = buf;
    char bus[64] = {};
    if (get_bus_id(bus, sizeof(bus) - 1, dev) == 0) {
      g.pci_address = bus;
      for (char& c : g.pci_address) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    int v = 0;
    if (get_attr(&v, kAttrDmaBufSupported, dev) == 0) g.dma_buf_supported = v;
    if (get_attr(&v, kAttrGpuDirectRdmaSupported, dev) == 0) g.gpu_direct_rdma_supported = v;
    if (get_attr(&v, kAttrGpuDirectRdmaWritesOrdering, dev) == 0) g.rdma_writes_ordering = v;
    facts.gpus.push_back(std::move(g));
  }
  return facts;
}

topology::NicDmaBufProbe probe_nic_dmabuf(const std::string& device) {
#if GRADSYNC_HAVE_VERBS
  auto api = verbs::load_libibverbs();
  if (!api.ok()) return {-1, "not probed: " + api.status().message()};
  auto ctx = verbs::Context::open(*api, device);
  if (!ctx.ok()) return {-1, "not probed: " + ctx.status().message()};
  auto pd = verbs::ProtectionDomain::create(*ctx);
  if (!pd.ok()) return {-1, "not probed: " + pd.status().message()};
  std::string note;
  const bool yes = verbs::probe_dmabuf(*pd, &note);
  return {yes ? 1 : 0, note};
#else
  return {-1, "not probed: built without the verbs headers (" + device + ")"};
#endif
}

const char* usage_text() {
  return "  doctor [--require-gdr] [--sysfs-root DIR]\n"
         "                            GPUDirect RDMA readiness from sysfs/procfs (and libcuda if\n"
         "                            present); no coordinator needed. GRADSYNC_GDR_LEVEL=PIX|PXB|\n"
         "                            PHB|NODE|SYS (default PXB) is the farthest GPU-NIC distance\n"
         "                            for GPUDirect; --require-gdr exits 1 unless every GPU can\n"
         "                            use it\n";
}

int run(const std::vector<std::string>& args, FILE* out, FILE* err) {
  bool require_gdr = false;
  topology::SysfsRoot root;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--require-gdr") {
      require_gdr = true;
    } else if (args[i] == "--sysfs-root" && i + 1 < args.size()) {
      root.dir = args[++i];
    } else {
      std::fprintf(err, "gradsyncctl doctor: unexpected argument '%s'\nusage: gradsyncctl\n%s",
                   args[i].c_str(), usage_text());
      return 2;
    }
  }
  if (std::error_code ec; !std::filesystem::is_directory(root.dir, ec)) {
    std::fprintf(err, "gradsyncctl doctor: --sysfs-root %s is not a directory\n", root.dir.c_str());
    return 2;
  }
  topology::PciDistance level = topology::PciDistance::PXB;
  if (const char* env = std::getenv("GRADSYNC_GDR_LEVEL"); env && *env) {
    auto parsed = topology::parse_distance(env);
    if (!parsed) {
      std::fprintf(err,
                   "gradsyncctl doctor: GRADSYNC_GDR_LEVEL='%s' is not one of PIX, PXB, PHB, "
                   "NODE, SYS (or 1..5)\n",
                   env);
      return 2;
    }
    level = *parsed;
  }
  topology::CudaFacts cuda;
  if (root.dir.empty() || root.dir == "/") {
    cuda = probe_cuda();
  } else {
    cuda.unavailable_reason = "CUDA not queried with --sysfs-root";
  }
  // Each NIC's dma-buf support, asked of the device itself (the real tree only).
  std::function<topology::NicDmaBufProbe(const std::string&)> probe;
  if (root.dir.empty() || root.dir == "/") {
    probe = probe_nic_dmabuf;
  } else {
    probe = [](const std::string&) { return topology::NicDmaBufProbe{-1, "not probed with --sysfs-root"}; };
  }
  const topology::GpuReport report = topology::build_report(root, cuda, level, probe);
  std::fputs(topology::render(report).c_str(), out);
  const int rc = topology::doctor_exit_code(report, require_gdr);
  if (rc != 0) {
    std::fprintf(out, "--require-gdr: %s\n",
                 report.gpus.empty() ? "no NVIDIA GPU, so no GPUDirect RDMA"
                                     : "at least one GPU cannot use GPUDirect RDMA");
  }
  return rc;
}

}  // namespace gradsync::doctor
