// A trace replayed through the PyTorch backend's entry points as torch_replay.py drives them on the GPU
// (benches/gpu/torch_replay.py: raw_alloc_with_stream / raw_delete in a C++ loop), but on the simulated
// device and without PyTorch: the plug-in loaded with dlopen, genpool_backend_malloc / _free called in a
// tight loop. Set beside `genpool replay --device sim` on the same trace, the difference is what the
// plug-in's layers add to the engine (docs/ARCHITECTURE.md, "What PyTorch's path adds").
//
//   cargo build --release -p genpool-torch && cc -O2 -o /tmp/abi_replay benches/host/abi_replay.c -ldl
//   python3 benches/host/ops.py benches/traces/resnet50_train.csv.gz /tmp/resnet.ops
//   /tmp/abi_replay target/release/libgenpool_torch.so /tmp/resnet.ops 5
//
// The ops file: a little-endian u64 count, then per op three u64s: size (0 = free), slot, stream index.
// Streams are numbered from 1 (a sim stream handle); slot ids are dense, as torch_replay's.
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int (*mal_t)(size_t, int, uint64_t, void*, void**);
typedef int (*fre_t)(void*, void*);

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s LIBGENPOOL_TORCH.so OPS_FILE PASSES\n", argv[0]);
    return 2;
  }
  setenv("GENPOOL_DEVICE", "sim", 0);
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "%s\n", dlerror());
    return 1;
  }
  mal_t m = (mal_t)dlsym(h, "genpool_backend_malloc");
  fre_t f = (fre_t)dlsym(h, "genpool_backend_free");
  int (*init)(int) = (int (*)(int))dlsym(h, "genpool_init");
  if (!m || !f || !init) {
    fprintf(stderr, "missing genpool_backend_malloc / _free / genpool_init\n");
    return 1;
  }
  init(1);
  FILE* in = fopen(argv[2], "rb");
  if (!in) {
    perror(argv[2]);
    return 1;
  }
  uint64_t n = 0;
  if (fread(&n, 8, 1, in) != 1 || n == 0 || n > (1ull << 32)) {
    fprintf(stderr, "bad ops file\n");
    return 1;
  }
  uint64_t* ops = malloc(n * 24);
  if (!ops || fread(ops, 24, n, in) != n) {
    fprintf(stderr, "short ops file\n");
    return 1;
  }
  fclose(in);
  uint64_t nslots = 0;
  for (uint64_t i = 0; i < n; i++) {
    if (ops[3 * i + 1] + 1 > nslots) nslots = ops[3 * i + 1] + 1;
  }
  void** slots = calloc(nslots, sizeof(void*));
  int passes = atoi(argv[3]);
  for (int p = 0; p < passes; p++) {
    double t0 = now();
    for (uint64_t i = 0; i < n; i++) {
      uint64_t size = ops[3 * i], slot = ops[3 * i + 1], stream = ops[3 * i + 2];
      if (size) {
        if (m(size, 0, 0, (void*)(uintptr_t)stream, &slots[slot]) != 0) {
          fprintf(stderr, "allocation of %llu failed at op %llu\n", (unsigned long long)size,
                  (unsigned long long)i);
          return 1;
        }
      } else {
        f(slots[slot], NULL);
        slots[slot] = NULL;
      }
    }
    double t1 = now();
    for (uint64_t s = 0; s < nslots; s++) {
      if (slots[s]) {
        f(slots[s], NULL);
        slots[s] = NULL;
      }
    }
    printf("pass %d: %.1f ns/op\n", p + 1, (t1 - t0) / n);
  }
  free(slots);
  free(ops);
  return 0;
}
