#include "topology/nvml_api.h"

#include <dlfcn.h>

#include "common/dlsym.h"

namespace gradsync::topology {
namespace {

constexpr const char* kLibName = "libnvidia-ml.so.1";

Result<const NvmlApi*> load_once() {
  void* handle = dlopen(kLibName, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return Status(Code::kUnavailable, std::string(kLibName) + " not found (no NVIDIA driver here, or its libraries "
                                                                "are not in the container): " +
                                          (why ? why : "dlopen failed"));
  }
  static NvmlApi api{};
  api.name = kLibName;
  std::string missing;
  resolve_symbol(handle, "nvmlInit_v2", api.init, missing);
  resolve_symbol(handle, "nvmlShutdown", api.shutdown, missing);
  resolve_symbol(handle, "nvmlErrorString", api.error_string, missing);
  resolve_symbol(handle, "nvmlDeviceGetCount_v2", api.device_count, missing);
  resolve_symbol(handle, "nvmlDeviceGetHandleByIndex_v2", api.device_by_index, missing);
  resolve_symbol(handle, "nvmlDeviceGetName", api.device_name, missing);
  resolve_symbol(handle, "nvmlDeviceGetPciInfo_v3", api.pci_info, missing);
  resolve_symbol(handle, "nvmlDeviceGetNvLinkState", api.nvlink_state, missing);
  resolve_symbol(handle, "nvmlDeviceGetNvLinkRemotePciInfo_v2", api.nvlink_remote_pci, missing);
  resolve_symbol(handle, "nvmlDeviceGetP2PStatus", api.p2p_status, missing);
  if (!missing.empty()) {
    dlclose(handle);
    return Status(Code::kUnavailable, std::string(kLibName) + " lacks " + missing + " (driver too old?)");
  }
  std::string optional_missing;  // not needed: the links are classified without them
  resolve_symbol(handle, "nvmlDeviceGetNvLinkRemoteDeviceType", api.nvlink_remote_type, optional_missing);
  resolve_symbol(handle, "nvmlDeviceGetNvLinkVersion", api.nvlink_version, optional_missing);
  return static_cast<const NvmlApi*>(&api);
}

}  // namespace

Result<const NvmlApi*> load_nvml() {
  static Result<const NvmlApi*> loaded = load_once();  // a failure is remembered too
  return loaded;
}

std::string nvml_error(const NvmlApi& api, nvml::Return r) {
  const char* text = api.error_string ? api.error_string(r) : nullptr;
  return "NVML error " + std::to_string(r) + (text ? std::string(" (") + text + ")" : std::string());
}

}  // namespace gradsync::topology
