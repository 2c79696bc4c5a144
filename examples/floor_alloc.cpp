// The "floor" pluggable allocator: what PyTorch's CUDAPluggableAllocator hook costs by itself.
//
// examples/train.py --allocator floor compiles this (c++ -O2 -shared -fPIC, no CUDA headers) and installs
// it through torch.cuda.memory.CUDAPluggableAllocator, the same hook genpool uses. Behind the hook it
// does the least an allocator can: an exact-size LIFO cache (request rounded up to 512 B) over
// cuMemAlloc, one mutex, memory never returned to the driver, one stream assumed (a block freed on a
// stream is handed out again without any ordering; train.py's models use one stream). So lock-step
// runs native-vs-floor measure the hook's own overhead (the extra indirection, PyTorch's metadata map and
// mutex around each call), and floor-vs-genpool measure what genpool's engine adds over a trivial cache.
// It is a measuring instrument only: no fragmentation control, no out-of-memory handling beyond NULL.

#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {
using MemAlloc = int (*)(unsigned long long *, size_t);

std::mutex mu;
std::unordered_map<size_t, std::vector<void *>> bins;
MemAlloc mem_alloc = nullptr;

MemAlloc driver_alloc() {
  if (mem_alloc == nullptr) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) h = dlopen("libcuda.so.1", RTLD_NOW);
    if (h != nullptr) mem_alloc = reinterpret_cast<MemAlloc>(dlsym(h, "cuMemAlloc_v2"));
    if (mem_alloc == nullptr) std::fprintf(stderr, "floor_alloc: cuMemAlloc_v2 not found\n");
  }
  return mem_alloc;
}

size_t round_up(size_t size) { return (size + 511) & ~static_cast<size_t>(511); }
}  // namespace

extern "C" {
void *floor_malloc(size_t size, int device, void *stream) {
  (void)device;
  (void)stream;
  if (size == 0) return nullptr;
  size = round_up(size);
  std::lock_guard<std::mutex> g(mu);
  auto &bin = bins[size];
  if (!bin.empty()) {
    void *p = bin.back();
    bin.pop_back();
    return p;
  }
  MemAlloc alloc = driver_alloc();
  unsigned long long p = 0;
  if (alloc == nullptr || alloc(&p, size) != 0) return nullptr;
  return reinterpret_cast<void *>(p);
}

void floor_free(void *ptr, size_t size, int device, void *stream) {
  (void)device;
  (void)stream;
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> g(mu);
  bins[round_up(size)].push_back(ptr);
}
}
