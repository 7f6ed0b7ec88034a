// Where a slot of relative counts is (kernels/cuda_step.cuh, "Slots of relative counts"): the
// step kernel moves each slot operand on by its base, and the CPU tests' streams do the same
// with this one function. No CUDA needed to include it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define GRADSYNC_HOST_DEVICE __host__ __device__
#else
#define GRADSYNC_HOST_DEVICE
#endif

namespace gradsync::kernels {

// A slot operand's index: none (plain memory, or a slot of absolute counts, taken as it is).
constexpr uint16_t kNoSlot = 0xffff;

// Where slot `slot` of a ring of `slots` slots `stride` bytes apart (p its address) is once
// the base moves it on: slot (slot + base) mod slots of the same ring.
GRADSYNC_HOST_DEVICE inline void* step_slot(void* p, uint16_t slot, uint64_t base, uint32_t slots, uint32_t stride) {
  if (slot == kNoSlot || slots == 0) return p;
  const uint32_t to = uint32_t((uint64_t(slot) + base % slots) % slots);
  return static_cast<uint8_t*>(p) + (int64_t(to) - int64_t(slot)) * int64_t(stride);
}

}  // namespace gradsync::kernels
