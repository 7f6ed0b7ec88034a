// NvmlApi: the one function table through which gradsync reaches NVML (libnvidia-ml.so.1, part
// of the NVIDIA driver). Loaded with dlopen, like libibverbs (transport/verbs/ibv_api.h), so
// the build needs no NVML header or library and a machine without the driver gets a reason,
// not a crash. Tests fill the table with fakes (gpu_topology_test.cc).
//
// Only the few types the calls below use are declared here, with NVML's layouts
// (nvml.h of the R5xx drivers; the _v2/_v3 entry points fix them).
#pragma once

#include <string>

#include "gradsync/status.h"

namespace gradsync::topology {

namespace nvml {
using Return = int;  // nvmlReturn_t
constexpr Return kSuccess = 0;
constexpr Return kErrorInvalidArgument = 2;
constexpr Return kErrorNotSupported = 3;

struct DeviceSt;
using Device = DeviceSt*;  // nvmlDevice_t

// nvmlPciInfo_t as the _v3 (device) and _v2 (NVLink remote) entry points fill it.
struct PciInfo {
  char bus_id_legacy[16];  // "0000:19:00.0"
  unsigned domain;
  unsigned bus;
  unsigned device;
  unsigned pci_device_id;  // device id << 16 | vendor id
  unsigned pci_subsystem_id;
  char bus_id[32];  // "00000000:19:00.0"
};

constexpr unsigned kFeatureEnabled = 1;  // nvmlEnableState_t NVML_FEATURE_ENABLED
// nvmlGpuP2PCapsIndex_t NVML_P2P_CAPS_INDEX_NVLINK and nvmlGpuP2PStatus_t NVML_P2P_STATUS_OK.
constexpr int kP2PCapsNvLink = 2;
constexpr int kP2PStatusOk = 0;
// nvmlIntNvLinkDeviceType_t: what the far end of a link is.
constexpr unsigned kNvLinkDeviceGpu = 0;
constexpr unsigned kNvLinkDeviceSwitch = 2;
// NVML_NVLINK_MAX_LINKS of current drivers (18 on H100/H200); older parts answer
// kErrorInvalidArgument or kErrorNotSupported above their last link.
constexpr unsigned kMaxLinks = 18;
}  // namespace nvml

struct NvmlApi {
  const char* name;  // "libnvidia-ml.so.1", or a test's name
  nvml::Return (*init)();
  nvml::Return (*shutdown)();
  const char* (*error_string)(nvml::Return result);
  nvml::Return (*device_count)(unsigned* count);
  nvml::Return (*device_by_index)(unsigned index, nvml::Device* device);
  nvml::Return (*device_name)(nvml::Device device, char* name, unsigned length);
  nvml::Return (*pci_info)(nvml::Device device, nvml::PciInfo* pci);
  nvml::Return (*nvlink_state)(nvml::Device device, unsigned link, unsigned* is_active);
  nvml::Return (*nvlink_remote_pci)(nvml::Device device, unsigned link, nvml::PciInfo* pci);
  nvml::Return (*p2p_status)(nvml::Device a, nvml::Device b, int caps_index, int* status);
  // Optional (null when the library lacks them): the far end's kind (GPU or NVSwitch), and the
  // link's NVLink version (nvmlNvlinkVersion_t: 7 = NVLink 5.0), for the per-link bandwidth.
  nvml::Return (*nvlink_remote_type)(nvml::Device device, unsigned link, unsigned* type);
  nvml::Return (*nvlink_version)(nvml::Device device, unsigned link, unsigned* version);
};

// dlopen("libnvidia-ml.so.1") once per process and resolve the table. kUnavailable names the
// library or the missing symbol (no driver, a container without the driver's libraries).
Result<const NvmlApi*> load_nvml();

// "NVML_ERROR 3 (Not Supported)": the library's text when it has one.
std::string nvml_error(const NvmlApi& api, nvml::Return r);

}  // namespace gradsync::topology
