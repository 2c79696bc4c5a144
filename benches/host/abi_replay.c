// A trace replayed through the PyTorch backend's entry points as torch_replay.py drives them on the GPU
// (benches/gpu/torch_replay.py: raw_alloc_with_stream / raw_delete in a C++ loop), without PyTorch: the
// plug-in loaded with dlopen, genpool_backend_malloc / _free called in a tight loop. Set beside
// `genpool replay` on the same trace, the difference is what the plug-in's layers add to the engine
// (docs/ARCHITECTURE.md, "What PyTorch's path adds").
//
// Several libraries (e.g. two builds) are loaded side by side, each with its own engines, and take
// turns pass by pass, so a host whose speed drifts during the run (some GPU hosts do, by 2x) slows
// them alike. GENPOOL_DEVICE picks the device as for the plug-in (default here: sim).
//
//   cargo build --release -p genpool-torch && cc -O2 -o /tmp/abi_replay benches/host/abi_replay.c -ldl
//   python3 benches/host/ops.py benches/traces/resnet50_train.csv.gz /tmp/resnet.ops
//   /tmp/abi_replay /tmp/resnet.ops 8 target/release/libgenpool_torch.so [OTHER.so ...]
//
// Prints, per library, each pass's ns per call and the median of passes 2.. (pass 1 is cold).
// The ops file: a little-endian u64 count, then per op three u64s: size (0 = free), slot, stream index.
// Streams are numbered from 1; on a GPU they are created (index 1 is the legacy default stream); on the
// simulator each index is its own handle, which the plug-in's simulated device takes as a stream on first use.
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*mal_t)(size_t, int, uint64_t, void*, void**);
typedef int (*fre_t)(void*, void*);
typedef int (*stream_create_t)(void**, unsigned int);

#define MAX_LIBS 4
#define MAX_STREAMS 64

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s OPS_FILE PASSES LIBGENPOOL_TORCH.so [MORE.so ...]\n", argv[0]);
    return 2;
  }
  setenv("GENPOOL_DEVICE", "sim", 0);
  int passes = atoi(argv[2]);
  int nlibs = argc - 3;
  if (nlibs > MAX_LIBS || passes < 1 || passes > 1000) {
    fprintf(stderr, "at most %d libraries, 1..1000 passes\n", MAX_LIBS);
    return 2;
  }
  FILE* in = fopen(argv[1], "rb");
  if (!in) {
    perror(argv[1]);
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
  uint64_t nslots = 0, nstreams = 0;
  for (uint64_t i = 0; i < n; i++) {
    if (ops[3 * i + 1] + 1 > nslots) nslots = ops[3 * i + 1] + 1;
    if (ops[3 * i + 2] > nstreams) nstreams = ops[3 * i + 2];
  }
  if (nstreams >= MAX_STREAMS) {
    fprintf(stderr, "too many streams\n");
    return 1;
  }
  // Stream handles: on the simulator any number; on a GPU, real streams (1: the legacy default stream).
  void* streams[MAX_STREAMS] = {0};
  int gpu = strcmp(getenv("GENPOOL_DEVICE"), "sim") != 0;
  if (gpu && nstreams > 1) {
    void* rt = dlopen("libcudart.so", RTLD_NOW | RTLD_GLOBAL);
    if (!rt) rt = dlopen("libcudart.so.13", RTLD_NOW | RTLD_GLOBAL);
    stream_create_t sc = rt ? (stream_create_t)dlsym(rt, "cudaStreamCreateWithFlags") : NULL;
    if (!sc) {
      fprintf(stderr, "a multi-stream trace on a GPU needs libcudart\n");
      return 1;
    }
    for (uint64_t s = 2; s <= nstreams; s++) {
      if (sc(&streams[s], 1) != 0) {
        fprintf(stderr, "cudaStreamCreateWithFlags failed\n");
        return 1;
      }
    }
  } else {
    for (uint64_t s = 1; s <= nstreams; s++) streams[s] = gpu ? NULL : (void*)(uintptr_t)s;
  }
  mal_t m[MAX_LIBS];
  fre_t f[MAX_LIBS];
  for (int l = 0; l < nlibs; l++) {
    void* h = dlopen(argv[3 + l], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      fprintf(stderr, "%s\n", dlerror());
      return 1;
    }
    m[l] = (mal_t)dlsym(h, "genpool_backend_malloc");
    f[l] = (fre_t)dlsym(h, "genpool_backend_free");
    int (*init)(int) = (int (*)(int))dlsym(h, "genpool_init");
    if (!m[l] || !f[l] || !init) {
      fprintf(stderr, "%s: missing genpool_backend_malloc / _free / genpool_init\n", argv[3 + l]);
      return 1;
    }
    init(1);
  }
  void** slots = calloc(nslots, sizeof(void*));
  double* ns = calloc((size_t)passes * nlibs, sizeof(double));
  if (!slots || !ns) return 1;
  for (int p = 0; p < passes; p++) {
    for (int l = 0; l < nlibs; l++) {
      double t0 = now();
      for (uint64_t i = 0; i < n; i++) {
        uint64_t size = ops[3 * i], slot = ops[3 * i + 1];
        if (size) {
          if (m[l](size, 0, 0, streams[ops[3 * i + 2]], &slots[slot]) != 0) {
            fprintf(stderr, "allocation of %llu failed at op %llu\n", (unsigned long long)size,
                    (unsigned long long)i);
            return 1;
          }
        } else {
          f[l](slots[slot], NULL);
          slots[slot] = NULL;
        }
      }
      ns[l * passes + p] = (now() - t0) / n;
      for (uint64_t s = 0; s < nslots; s++) {
        if (slots[s]) {
          f[l](slots[s], NULL);
          slots[s] = NULL;
        }
      }
    }
  }
  for (int l = 0; l < nlibs; l++) {
    printf("%s:", argv[3 + l]);
    for (int p = 0; p < passes; p++) printf(" %.1f", ns[l * passes + p]);
    if (passes > 1) {
      qsort(ns + l * passes + 1, passes - 1, sizeof(double), cmp);
      printf("  median %.1f ns/op", ns[l * passes + 1 + (passes - 1) / 2]);
    }
    printf("\n");
  }
  free(ns);
  free(slots);
  free(ops);
  return 0;
}
