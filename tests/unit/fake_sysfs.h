// A fake sysfs/procfs tree in a temp directory, for the topology readers (gpudirect.h,
// gpu_topology.h): PCI functions under sys/devices, GPUs, mlx5 RDMA devices with one port.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "topology/gpudirect.h"

namespace gradsync::topology {

class FakeSysfs {
 public:
  FakeSysfs() {
    char tmpl[] = "/tmp/gradsync_doctor_XXXXXX";
    root_ = mkdtemp(tmpl);
    std::filesystem::create_directories(root_ / "sys/bus/pci/devices");
    std::filesystem::create_directories(root_ / "sys/class/infiniband");
    std::filesystem::create_directories(root_ / "proc/sys/kernel");
    write("proc/sys/kernel/osrelease", "6.8.0-45-generic");
  }
  ~FakeSysfs() {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }
  FakeSysfs(const FakeSysfs&) = delete;
  FakeSysfs& operator=(const FakeSysfs&) = delete;

  SysfsRoot root() const { return SysfsRoot{root_.string()}; }

  void write(const std::string& rel, const std::string& text) {
    std::filesystem::create_directories((root_ / rel).parent_path());
    std::ofstream(root_ / rel) << text << "\n";
  }

  // chain: "pci0000:17/0000:17:00.0/.../ADDR" under sys/devices; links sys/bus/pci/devices/ADDR.
  std::filesystem::path add_pci(const std::string& chain, const std::string& vendor, const std::string& device,
                   const std::string& cls, int numa) {
    const std::filesystem::path dir = root_ / "sys/devices" / chain;
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "vendor") << vendor << "\n";
    std::ofstream(dir / "device") << device << "\n";
    std::ofstream(dir / "class") << cls << "\n";
    std::ofstream(dir / "numa_node") << numa << "\n";
    std::filesystem::create_symlink(dir, root_ / "sys/bus/pci/devices" / dir.filename());
    return dir;
  }

  void add_gpu(const std::string& chain, int numa) {
    add_pci(chain, "0x10de", "0x2335", "0x030200", numa);
  }

  void add_mlx5(const std::string& name, const std::string& chain, int numa,
                const std::string& state = "4: ACTIVE") {
    const std::filesystem::path dev = add_pci(chain, "0x15b3", "0x1021", "0x020700", numa);
    const std::filesystem::path ib = dev / "infiniband" / name;
    std::filesystem::create_directories(ib / "ports/1");
    std::filesystem::create_directories(dev / "net" / ("ib_" + name));
    std::filesystem::create_symlink(dev, ib / "device");
    std::ofstream(ib / "ports/1/state") << state << "\n";
    std::ofstream(ib / "ports/1/link_layer") << "InfiniBand\n";
    std::ofstream(ib / "ports/1/rate") << "400 Gb/sec (4X NDR)\n";
    std::filesystem::create_symlink(ib, root_ / "sys/class/infiniband" / name);
  }

  void add_peermem() { write("sys/module/nvidia_peermem/version", "580.159.04"); }

 private:
  std::filesystem::path root_;
};

}  // namespace gradsync::topology
