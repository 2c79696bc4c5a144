// The PyTorch backend's entry points as PyTorch reaches them — through the shared library, loaded with
// dlopen (so its thread-locals go through __tls_get_addr, as in a Python process) — on the simulated
// device: 64 blocks in a ring, sizes 512 B to 8 MiB, alloc+free pairs timed in three rounds. Profile it
// with perf to see the plug-in's layers beside the engine (docs/ARCHITECTURE.md, session 14).
//
//   cargo build --release -p genpool-torch && cc -O2 -o /tmp/abi_dlopen benches/host/abi_dlopen.c -ldl
//   /tmp/abi_dlopen target/release/libgenpool_torch.so 2000000
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
typedef int (*mal_t)(size_t, int, uint64_t, void*, void**);
typedef int (*fre_t)(void*, void*);
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec*1e9+t.tv_nsec;}
int main(int argc, char** argv){
  if(argc<3){fprintf(stderr,"usage: %s LIBGENPOOL_TORCH.so PAIRS\n",argv[0]);return 2;}
  setenv("GENPOOL_DEVICE","sim",1);
  void* h = dlopen(argv[1], RTLD_NOW|RTLD_LOCAL); if(!h){fprintf(stderr,"%s\n",dlerror());return 1;}
  if(!dlsym(h,"genpool_backend_malloc")){fprintf(stderr,"no genpool_backend_malloc\n");return 1;}
  mal_t m=(mal_t)dlsym(h,"genpool_backend_malloc"); fre_t f=(fre_t)dlsym(h,"genpool_backend_free");
  int (*init)(int)=(int(*)(int))dlsym(h,"genpool_init"); if(init) init(1);
  const size_t sizes[8]={1024, 1<<20, 4096, 3<<20, 2048, 600000, 512, 8<<20};
  void* live[64]={0}; long n=atol(argv[2]);
  for(int rep=0; rep<3; rep++){
    double t0=now();
    for(long i=0;i<n;i++){
      int k=i&63; if(live[k]){ f(live[k],0); live[k]=0; }
      if(m(sizes[(i*7)&7],0,0,0,&live[k])!=0){fprintf(stderr,"allocation failed\n");return 1;}
    }
    double t1=now(); printf("%.1f ns per alloc+free pair\n",(t1-t0)/n);
  }
  return 0;
}
