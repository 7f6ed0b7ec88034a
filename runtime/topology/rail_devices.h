// Which RDMA device each GPU rank's own queue pairs (GPUDirect RDMA) use: its GPU's rail, the
// NIC gpu_topology.h assigns it, where gradsyncd can use that NIC in place of its own device;
// otherwise the daemon's device. gradsyncd works out the list for every GPU of its node at
// start (rail_devices) and sends it in each join reply (daemon.proto VerbsDevice.rail_devices);
// a rank takes its GPU's entry (rank_rdma_device).
//
// Why every rank can reach every other: a NIC is listed only when it opens through the
// daemon's verbs library, on the daemon's port number, ACTIVE, with the daemon's link layer and
// the GID index the daemon's rule picks on its own device (VerbsNode::stand_in_refusal). So
// every rank's device sits on the same fabric, addressed the same way, as the daemons' own
// devices, which already reach each other; like NCCL, gradsync takes a RoCE or InfiniBand
// fabric to connect every NIC to every NIC (a fabric where rail i reaches only rail i of the
// other nodes is not supported: a flat ring's hop from GPU 7 to GPU 0 crosses rails). The
// emulated test fabric connects any device to any.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "topology/gpu_topology.h"
#include "topology/topo_file.h"

namespace gradsync::topology {

// Bounds of the list in the join reply: one entry per GPU of the node, at most
// kMaxTopoGpus; a name of at most 64 bytes (IBV_SYSFS_NAME_MAX, with its NUL, is 64 too).
constexpr size_t kMaxRailDevices = kMaxTopoGpus;
constexpr size_t kMaxRailDeviceName = 64;

struct RailDevices {
  std::vector<std::string> devices;  // per GPU of the node: its rail's RDMA device, "" for none
  std::vector<std::string> why;      // per GPU: "" where listed, else why it is not
};

// Per GPU of `topo` (its index in topo.gpus; the first kMaxRailDevices): the name of its rail
// NIC when `refusal(name)` is "" (the daemon can use it in place of its own device), else ""
// with the reason. `refusal` is asked once per distinct NIC.
RailDevices rail_devices(const NodeTopology& topo, const std::function<std::string(const std::string& nic)>& refusal);

// For gradsyncd's log: "GPU0 mlx5_0, GPU1 mlx5_1, GPU2 the daemon's (no NIC is its rail)".
std::string describe(const RailDevices& rails);

// A rank's RDMA device and why. `gpu` is the rank's GPU ordinal on the node (its CUDA
// device); `rail_devices` the daemon's list; `daemon_device` the daemon's own device.
struct RankDevice {
  std::string device;
  std::string why;
};
RankDevice rank_rdma_device(const std::vector<std::string>& rail_devices, int gpu, const std::string& daemon_device);

}  // namespace gradsync::topology
