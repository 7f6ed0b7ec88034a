// The one place where the gradsync c10d backend meets torch's version differences.
//
// - torch 1.13: a backend is a c10d::ProcessGroup subclass; register_backend's creator returns
//   it to Python as a ProcessGroup (torch._C._distributed_c10d.ProcessGroup).
// - torch 2.x: ProcessGroup became a dispatcher over per-device c10d::Backend objects; the
//   creator returns a c10d::Backend (torch._C._distributed_c10d.Backend) and
//   register_backend takes devices=[...] (gradsync_torch/__init__.py passes it there).
// The collectives' virtual signatures (tensors, options, intrusive_ptr<Work>) are the same in
// both, so the backend itself is written once against BackendBase.
#pragma once

#include <torch/csrc/api/include/torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
namespace gradsync_torch {
using BackendBase = c10d::Backend;
constexpr const char* kBaseClassName = "Backend";
}  // namespace gradsync_torch
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
namespace gradsync_torch {
using BackendBase = c10d::ProcessGroup;
constexpr const char* kBaseClassName = "ProcessGroup";
}  // namespace gradsync_torch
#endif
