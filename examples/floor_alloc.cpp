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
using CtxGet = int (*)(void **);
using CtxSet = int (*)(void *);
using PrimaryRetain = int (*)(void **, int);

std::mutex mu;
std::unordered_map<size_t, std::vector<void *>> bins;
MemAlloc mem_alloc = nullptr;
CtxGet ctx_get = nullptr;
CtxSet ctx_set = nullptr;
PrimaryRetain primary_retain = nullptr;

// cuMemAlloc on device `device`'s primary context (autograd's worker threads may have none current).
int driver_alloc(unsigned long long *p, size_t size, int device) {
  if (mem_alloc == nullptr) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) h = dlopen("libcuda.so.1", RTLD_NOW);
    if (h == nullptr) return -1;
    mem_alloc = reinterpret_cast<MemAlloc>(dlsym(h, "cuMemAlloc_v2"));
    ctx_get = reinterpret_cast<CtxGet>(dlsym(h, "cuCtxGetCurrent"));
    ctx_set = reinterpret_cast<CtxSet>(dlsym(h, "cuCtxSetCurrent"));
    primary_retain = reinterpret_cast<PrimaryRetain>(dlsym(h, "cuDevicePrimaryCtxRetain_v2"));
    if (primary_retain == nullptr)
      primary_retain = reinterpret_cast<PrimaryRetain>(dlsym(h, "cuDevicePrimaryCtxRetain"));
    if (!mem_alloc || !ctx_get || !ctx_set || !primary_retain) {
      std::fprintf(stderr, "floor_alloc: driver entry points not found\n");
      mem_alloc = nullptr;
      return -1;
    }
  }
  void *ctx = nullptr;
  if (ctx_get(&ctx) != 0 || ctx == nullptr) {
    if (primary_retain(&ctx, device) != 0 || ctx_set(ctx) != 0) return -1;
  }
  return mem_alloc(p, size);
}

size_t round_up(size_t size) { return (size + 511) & ~static_cast<size_t>(511); }
}  // namespace

extern "C" {
void *floor_malloc(size_t size, int device, void *stream) {
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
  unsigned long long p = 0;
  if (driver_alloc(&p, size, device) != 0) {
    std::fprintf(stderr, "floor_alloc: cuMemAlloc of %zu bytes failed\n", size);
    return nullptr;
  }
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
