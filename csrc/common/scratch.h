// Per-thread scratch memory that outlives a call. A buffer allocated per call is a fresh allocation
// every time: above glibc's mmap threshold (128 KiB by default, adapted upwards) a fresh mmap whose
// first-touch page faults can cost more than the work done in it (the palette decode route's 4 MiB
// chunk: tcq2_1mad 4096^2 at M = 9 took 22 ms, mostly the kernel's page-fault path).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace torch_lowbit {

// `bytes` bytes aligned to `align` (a power of two), owned by the calling thread and reused by its next
// call with the same Tag (one type per call site: two sites never share a buffer). Valid until the
// thread's next thread_scratch<Tag> call; the memory stays allocated for the thread's life.
template <typename Tag>
inline uint8_t* thread_scratch(size_t bytes, size_t align = 64) {
  static thread_local std::vector<uint8_t> storage;
  if (storage.size() < bytes + align) storage.resize(bytes + align);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + align - 1) &
                                    ~static_cast<uintptr_t>(align - 1));
}

}  // namespace torch_lowbit
