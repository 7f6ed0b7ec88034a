// gradsyncctl doctor: the GPUDirect RDMA readiness report (docs/gpudirect.md).
//
// The logic (sysfs reading, PCIe distance letters, path decision, rendering) is in
// runtime/topology/gpudirect.{h,cc}; this layer parses the command line, queries CUDA through
// a dlopen of libcuda.so.1 when it is there, and prints.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "topology/gpudirect.h"

namespace gradsync::doctor {

// CUDA facts from libcuda.so.1 (cuInit, cuDeviceGetCount, cuDeviceGetName,
// cuDeviceGetPCIBusId, cuDeviceGetAttribute, cuDriverGetVersion); available == false with a
// reason when the library or a device is not there.
topology::CudaFacts probe_cuda();

// Opens `device` through libibverbs and asks it to register a dma-buf fd of -1
// (verbs::probe_dmabuf); supported -1 with the reason when it cannot be asked.
topology::NicDmaBufProbe probe_nic_dmabuf(const std::string& device);

// args: what follows "doctor" on the command line ("--require-gdr", "--sysfs-root DIR").
// Returns the process exit status: 0, 1 (--require-gdr and some GPU cannot use GPUDirect),
// 2 (bad usage or bad GRADSYNC_GDR_LEVEL).
int run(const std::vector<std::string>& args, FILE* out, FILE* err);

// The usage lines gradsyncctl prints for this subcommand.
const char* usage_text();

}  // namespace gradsync::doctor
