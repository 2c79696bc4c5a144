// genpool as PyTorch's CUDA allocator: a c10::cuda::CUDACachingAllocator::CUDAAllocator of its own,
// over genpool's C ABI (libgenpool_torch.so, include/genpool.h).
//
// Built at first use against the torch that imports it (genpool_torch/backend.py): the allocator
// interface is C++ without a stable ABI, so one binary per torch version and C++ ABI, cached.
//
// What lives where:
// - The engine (Rust) owns every block, its stream, its requested size and the statistics PyTorch's
//   DeviceStats wants; the hot path here is one C call each way, no lock, no map.
// - This file owns what only PyTorch has words for: DataPtrs and their deleter, memory history
//   (stack contexts, the trace ring), OOM observers, trace trackers, the profiler's memory events, and
//   the mapping of PyTorch's MempoolId_t (CUDA graphs, torch.cuda.MemPool) to genpool's private pools,
//   the captures the engine is told of, graph trees' checkpoints, and CUDA IPC's byte strings.
//
// Errors: methods PyTorch calls throw c10::Error as PyTorch's own allocator does (an OutOfMemoryError on
// out-of-memory); the deleter never throws (a refused free is logged by the engine and ignored). Every
// CUDA runtime call is checked.

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/headeronly/version.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "genpool.h"

// Interface differences between the torch versions the backend was built against (2.11, 2.15); the
// versions between were not checked.
#define GENPOOL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace genpool_backend {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::TraceEntry;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;

constexpr int kMaxDevices = GENPOOL_MAX_DEVICES;

std::string last_error() {
  std::string msg(512, '\0');
  size_t n = genpool_last_error(msg.data(), msg.size());
  if (n >= msg.size()) {
    msg.assign(n + 1, '\0');
    n = genpool_last_error(msg.data(), msg.size());
  }
  msg.resize(std::min(n, msg.size()));
  return msg;
}

void copy_stat(Stat& dst, const GenpoolStat& src) {
  dst.current = src.current;
  dst.peak = src.peak;
  dst.allocated = src.allocated;
  dst.freed = src.freed;
}

void copy_stats(StatArray& dst, const GenpoolStat (&src)[3]) {
  for (size_t i = 0; i < 3; ++i) {
    copy_stat(dst[i], src[i]);
  }
}

struct MempoolIdHash {
  size_t operator()(const c10::MempoolId_t& id) const noexcept {
    return std::hash<c10::CaptureId_t>{}(id.first) * 31 ^ std::hash<c10::CaptureId_t>{}(id.second);
  }
};

// A PyTorch pool (a CUDA graph's private pool, a torch.cuda.MemPool) on one device.
struct PrivatePool {
  uint64_t genpool_id = 0;  // genpool's private pool; 0 when `custom` serves it
  int use_count = 0;
  bool use_on_oom = false;
  std::shared_ptr<cca::CUDAAllocator> custom;  // a MemPool made with another allocator
};

// A block of a MemPool made with another allocator (NCCL's ncclMemAlloc, say): served by that allocator,
// shown in snapshots as a segment of its own (ProcessGroupNCCL's register_mem_pool registers them).
struct CustomBlock {
  std::shared_ptr<cca::CUDAAllocator> allocator;
  c10::DeviceIndex device = 0;
  size_t size = 0;
  cudaStream_t stream = nullptr;
  c10::MempoolId_t pool{0, 0};
};

// An active beginAllocateToPool: allocations whose stream passes `filter` go to `id`.
struct PoolContext {
  c10::MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
};

// A private pool's state for CUDA graph trees (getCheckpointState): its live blocks.
struct GenpoolPoolState final : cca::AllocatorState {
  c10::DeviceIndex device = 0;
  c10::MempoolId_t id{0, 0};
  std::vector<GenpoolBlock> blocks;
};

// CUDA IPC byte strings (shareIpcHandle / getIpcDevPtr). PyTorch's own layout for pages shared by file
// descriptor (expandable segments, torch 2.11-2.12): a version byte, a type byte, then this header and
// one int descriptor per page. A process running PyTorch's allocator opens genpool's handles, and genpool
// opens the ones of PyTorch's expandable segments and of cudaMalloc ('c'). torch 2.13 changed the
// expandable-segment layout: genpool then tags its handles 'g' (only a genpool receiver opens them).
constexpr char kIpcVersion = 2;
constexpr char kIpcCudaMalloc = 'c';
constexpr char kIpcExpandable = 'e';
constexpr char kIpcGenpool = 'g';
constexpr size_t kCudaIpcHandleSize = 64;  // sizeof(cudaIpcMemHandle_t): a bare one predates versions
struct IpcHeader {
  pid_t pid;
  size_t page_size;
  size_t num_pages;
};
#if GENPOOL_TORCH_AT_LEAST(2, 13)
constexpr char kIpcOwnType = kIpcGenpool;
#else
constexpr char kIpcOwnType = kIpcExpandable;
#endif

// The debug switch of the compatibility suite's unsafe variant: graph captures allocate from the device
// pool, so blocks a graph frees during capture are handed to later allocations (corruption the suite
// must see). Never for real use.
bool unsafe_graph_pools() {
  static const bool on = [] {
    const char* v = std::getenv("GENPOOL_DEBUG_UNSAFE_GRAPH_POOLS");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

class GenpoolAllocator;
std::shared_ptr<GenpoolAllocator>& the_allocator();
void raw_delete_fn(void* ptr);

class GenpoolAllocator final : public cca::CUDAAllocator {
 public:
  // ----- allocation -----------------------------------------------------------------------------

  void* malloc(c10::DeviceIndex device, size_t size, cudaStream_t stream) {
    if (size == 0) {
      return nullptr;
    }
    uint64_t pool = 0;
    if (n_contexts_[device].load(std::memory_order_acquire) != 0) {
      std::shared_ptr<cca::CUDAAllocator> custom;
      c10::MempoolId_t custom_id{0, 0};
      pool = route(device, stream, &custom, &custom_id);
      if (custom) {
        return custom_alloc(custom, device, size, stream, custom_id);
      }
    }
    void* ptr = nullptr;
    int rc = genpool_backend_malloc(size, device, pool, stream, &ptr);
    if (rc != GENPOOL_OK) {
      ptr = on_failure(rc, device, size, pool, stream);
    }
    on_alloc(device, ptr, size, stream, pool);
    return ptr;
  }

  void free_ptr(void* ptr) noexcept {
    if (ptr == nullptr) {
      return;
    }
    if (n_custom_.load(std::memory_order_acquire) != 0 && custom_free(ptr)) {
      return;
    }
    GenpoolFreed f{};
    if (genpool_backend_free(ptr, &f) != GENPOOL_OK) {
      // Refused (a pointer genpool did not hand out, or a double free): logged once by the engine.
      return;
    }
    try {
      on_free(ptr, f);
    } catch (const std::exception& e) {
      // History and profiler bookkeeping only; the block itself is freed.
      std::fprintf(stderr, "genpool: after a free: %s\n", e.what());
    }
  }

  // The calling thread's current device. With one visible device that is device 0, whatever the thread
  // did: c10::cuda::GetDevice (a thread-local check, then cudaGetDevice and the runtime's lock) was ~8 %
  // of an allocation through PyTorch's entry points in session 15's profile, paid on every allocation.
  // With several devices (or before init) it is asked. Every call that needs the current device uses it.
  c10::DeviceIndex current_device() const {
    if (device_count_.load(std::memory_order_relaxed) == 1) {
      return 0;
    }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return device;
  }

  c10::DataPtr allocate(size_t size) override {
    const c10::DeviceIndex device = current_device();
    void* ptr = nullptr;
    if (size != 0) {
      ptr = malloc(device, size, c10::cuda::getCurrentCUDAStream(device));
    }
    return {ptr, ptr, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &raw_delete_fn;
  }

  void* raw_alloc(size_t nbytes) override {
    const c10::DeviceIndex device = current_device();
    return malloc(device, nbytes, c10::cuda::getCurrentCUDAStream(device));
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    const c10::DeviceIndex device = current_device();
    return malloc(device, nbytes, stream);
  }

  void raw_delete(void* ptr) override {
    free_ptr(ptr);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // ----- lifecycle and settings -----------------------------------------------------------------

  void init(int device_count) override {
    genpool_init(device_count);
    device_count_.store(std::min(device_count, kMaxDevices));
    initialized_.store(true);
  }

  bool initialized() override {
    return initialized_.load();
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    check_device(device);
    return genpool_backend_memory_fraction(device);
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check_device(device);
    TORCH_CHECK(
        fraction > 0 && fraction <= 1,
        "genpool: invalid memory fraction ",
        fraction,
        " (expected a value in (0, 1])");
    genpool_set_memory_fraction(fraction, device);
  }

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};  // genpool has no expandable segments: every tier maps pages on demand
  }

  void enable(bool value) override {
    enabled_.store(value);
    genpool_backend_set_caching(value ? 1 : 0);
  }

  bool isEnabled() const override {
    return enabled_.load();
  }

  void emptyCache(c10::MempoolId_t mempool_id) override {
    if (mempool_id.first == 0 && mempool_id.second == 0) {
      genpool_reset();
      return;
    }
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (int d = 0; d < kMaxDevices; ++d) {
      auto it = pools_[d].find(mempool_id);
      if (it != pools_[d].end() && it->second.genpool_id != 0) {
        genpool_pool_trim(d, it->second.genpool_id);
      }
    }
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    check_device(device);
    uint64_t best = genpool_backend_cache_info(device);
    if (largestBlock != nullptr && best > *largestBlock) {
      *largestBlock = best;
    }
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    GenpoolBlock b{};
    if (genpool_backend_block(ptr, &b) == GENPOOL_OK && size != nullptr) {
      *size = b.size;
    }
    return ptr;  // a block is its own base: genpool hands out no sub-allocations of a segment
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr || ptr.get_deleter() != &raw_delete_fn) {
      return;  // an empty tensor, or memory another allocator owns
    }
    genpool_record_stream(ptr.get(), stream.stream());
  }

  // ----- statistics -----------------------------------------------------------------------------

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device(device);
    GenpoolTorchStats s{};
    TORCH_CHECK(
        genpool_backend_stats(device, &s) == GENPOOL_OK,
        "genpool: statistics of device ",
        static_cast<int>(device),
        ": ",
        last_error());
    DeviceStats out;
    copy_stats(out.allocation, s.allocation);
    copy_stats(out.segment, s.segment);
    copy_stats(out.active, s.active);
    copy_stats(out.inactive_split, s.inactive_split);
    copy_stats(out.allocated_bytes, s.allocated_bytes);
    copy_stats(out.reserved_bytes, s.reserved_bytes);
    copy_stats(out.active_bytes, s.active_bytes);
    copy_stats(out.inactive_split_bytes, s.inactive_split_bytes);
    copy_stats(out.requested_bytes, s.requested_bytes);
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    out.num_sync_all_streams = s.num_sync_all_streams;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    out.max_split_size = s.max_split_size;
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device(device);
    TORCH_CHECK(genpool_backend_reset_accumulated(device) == GENPOOL_OK, "genpool: ", last_error());
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    TORCH_CHECK(genpool_backend_reset_peaks(device) == GENPOOL_OK, "genpool: ", last_error());
  }

  // ----- memory history and snapshots -----------------------------------------------------------

  void recordHistory(
      bool enabled,
      cca::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      cca::RecordContext when,
      bool clearHistory,
      const std::vector<std::string>& skip_actions) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    recorder_ = context_recorder;
    when_ = when;
    max_entries_ = std::max<size_t>(alloc_trace_max_entries, 1);
    skip_.clear();
    for (const auto& a : skip_actions) {
      skip_.insert(c10::CachingDeviceAllocator::parseTraceEntryAction(a));
    }
    if (clearHistory) {
      for (auto& t : traces_) {
        t.clear();
      }
    }
    if (!enabled) {
      contexts_.clear();
    }
    history_.store(enabled, std::memory_order_release);
  }

  bool isHistoryEnabled() override {
    return history_.load(std::memory_order_acquire);
  }

  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (!history_.load(std::memory_order_acquire)) {
      return;
    }
    const c10::DeviceIndex device = current_device();
    c10::CachingDeviceAllocator::AnnotationEntry ae(device, c10::getApproximateTime());
    for (const auto& [k, v] : md) {
      ae.recordUserMetadata(k, v);
    }
    std::lock_guard<std::mutex> lock(history_mu_);
    annotations_.push_back(std::move(ae));
  }

  void pushCompileContext(std::string& md) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    compile_context_.push_back(md);
  }

  void popCompileContext() override {
    std::lock_guard<std::mutex> lock(history_mu_);
    if (!compile_context_.empty()) {
      compile_context_.pop_back();
    }
  }

  void setUserMetadata(const std::string& metadata) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    user_metadata_ = metadata;
  }

  std::string getUserMetadata() override {
    std::lock_guard<std::mutex> lock(history_mu_);
    return user_metadata_;
  }

  cca::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override {
    cca::SnapshotInfo out;
    const bool all = mempool_id.first == 0 && mempool_id.second == 0;
    std::unordered_map<uint64_t, c10::MempoolId_t> owner;  // genpool pool -> PyTorch pool
    uint64_t only[kMaxDevices];
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      for (int d = 0; d < kMaxDevices; ++d) {
        only[d] = all ? UINT64_MAX : 0;
        for (const auto& [id, p] : pools_[d]) {
          if (p.genpool_id != 0) {
            owner[p.genpool_id] = id;
            if (!all && id == mempool_id) {
              only[d] = p.genpool_id;
            }
          }
        }
      }
    }
    const int devices = device_count_.load();
    for (int d = 0; d < devices; ++d) {
      if (!all && only[d] == 0) {
        continue;  // the pool does not exist on this device
      }
      append_segments(d, only[d], owner, out.segments);
    }
    if (n_custom_.load(std::memory_order_acquire) != 0) {
      append_custom_segments(all, mempool_id, out.segments);
    }
    std::lock_guard<std::mutex> lock(history_mu_);
    if (include_traces) {
      for (int d = 0; d < devices; ++d) {
        out.device_traces.emplace_back(traces_[d].begin(), traces_[d].end());
      }
      out.external_annotations = annotations_;
    }
    out.config_metadata.garbage_collection_threshold = 0;
    out.config_metadata.max_split_size = SIZE_MAX;
    out.config_metadata.pinned_num_register_threads = 0;
    out.config_metadata.expandable_segments = false;
    out.config_metadata.release_lock_on_malloc = false;
    out.config_metadata.pinned_use_host_register = false;
    out.config_metadata.graph_capture_record_stream_reuse = false;
    const char* conf = std::getenv("GENPOOL_CONF");
    out.config_metadata.last_allocator_settings =
        std::string("genpool") + (conf != nullptr ? std::string(" GENPOOL_CONF=") + conf : "");
    return out;
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    oom_observers_.push_back(std::move(observer));
  }

#if GENPOOL_TORCH_AT_LEAST(2, 15)
  // An allocation PyTorch refused before asking the allocator (torch 2.15): told like an OOM.
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    oom_rejection_observers_.push_back(std::move(observer));
  }

  bool supportsUserMetadata() override {
    return true;  // recorded on every trace entry (record_trace)
  }

  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    auto it = contexts_.find(const_cast<void*>(ptr));
    return it == contexts_.end() ? nullptr : it->second;
  }
#endif

  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    trackers_.push_back(std::move(tracker));
    has_trackers_.store(true, std::memory_order_release);
  }

  // ----- private pools: CUDA graphs and torch.cuda.MemPool --------------------------------------

  void beginAllocateToPool(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(pools_mu_);
    // A capture that ended without its endAllocateToPool (an exception in capture_end) ends here.
    sweep_captures_locked();
    auto& p = pools_[device][mempool_id];
    if (p.use_count == 0) {
      // A graph's pool seen first here (MemPools come through createOrIncrefPool).
      create_locked(device, p, nullptr);
    } else {
      ++p.use_count;  // as PyTorch's allocator: each capture into a pool holds it
    }
    contexts_by_device_[device].push_back(PoolContext{mempool_id, std::move(filter)});
    n_contexts_[device].store(contexts_by_device_[device].size(), std::memory_order_release);
    if (unsafe_graph_pools()) {
      TORCH_WARN_ONCE(
          "genpool: GENPOOL_DEBUG_UNSAFE_GRAPH_POOLS=1: CUDA graphs allocate from the device pool and "
          "their freed blocks are handed to later allocations (a test of the compatibility suite only)");
    }
    // PyTorch calls this just before cudaStreamBeginCapture; a capture begun earlier is seen here, the
    // others at their first allocation (route).
    note_capture_locked(device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(pools_mu_);
    // One context per call, the oldest of the pool's first (as PyTorch's allocator): a pool may be
    // allocated to by several contexts at once (a thread's MemPool context and a capture).
    auto& v = contexts_by_device_[device];
    auto it = std::find_if(v.begin(), v.end(), [&](const PoolContext& c) { return c.id == mempool_id; });
    if (it != v.end()) {
      v.erase(it);
    }
    n_contexts_[device].store(v.size(), std::memory_order_release);
    // Called after cudaStreamEndCapture: tell the engine of the captures that ended.
    sweep_captures_locked();
  }

  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = pools_[device].find(mempool_id);
    if (it == pools_[device].end()) {
      return;
    }
    if (--it->second.use_count > 0) {
      return;
    }
    if (it->second.genpool_id != 0 &&
        genpool_pool_release(device, it->second.genpool_id) != GENPOOL_OK) {
      TORCH_WARN("genpool: releasing pool: ", last_error());
    }
    pools_[device].erase(it);
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = pools_[device].find(mempool_id);
    return it == pools_[device].end() ? 0 : it->second.use_count;
  }

  void createOrIncrefPool(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      std::shared_ptr<cca::CUDAAllocator> allocator) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto& p = pools_[device][mempool_id];
    if (p.use_count == 0) {
      create_locked(device, p, allocator.get() == this ? nullptr : std::move(allocator));
    } else {
      ++p.use_count;
    }
  }

  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(pools_mu_);
    // A MemPool's destructor may call this after releasePool: nothing to do for a pool that is gone.
    auto it = pools_[device].find(mempool_id);
    if (it != pools_[device].end()) {
      it->second.use_on_oom = use_on_oom;
    }
  }

  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    // genpool never hands out part of another block: every pool is "no split" already.
    check_device(device);
  }

  bool checkPoolLiveAllocations(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override {
    check_device(device);
    uint64_t id = 0;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      auto it = pools_[device].find(mempool_id);
      if (it == pools_[device].end() || it->second.genpool_id == 0) {
        return expected_live_allocations.empty();
      }
      id = it->second.genpool_id;
    }
    std::vector<GenpoolSegment> segs;
    std::vector<GenpoolBlock> blocks;
    fetch_snapshot(device, id, segs, blocks);
    size_t live = 0;
    for (const auto& b : blocks) {
      if (b.allocated == 0) {
        continue;
      }
      ++live;
      if (expected_live_allocations.count(reinterpret_cast<void*>(b.address)) == 0) {
        return false;
      }
    }
    return live == expected_live_allocations.size();
  }

  // CUDA graph trees (torch.compile(mode="reduce-overhead")): a private pool's live blocks now, and the
  // pool put back to them later at the same addresses (crates/genpool-torch/src/graphs.rs).
  std::shared_ptr<cca::AllocatorState> getCheckpointState(
      c10::DeviceIndex device,
      c10::MempoolId_t id) override {
    check_device(device);
    auto st = std::make_shared<GenpoolPoolState>();
    st->device = device;
    st->id = id;
    const uint64_t gid = genpool_pool_of(device, id, "getCheckpointState");
    size_t n = 0;
    for (int attempt = 0; attempt < 8; ++attempt) {
      int rc = genpool_pool_live(device, gid, st->blocks.data(), st->blocks.size(), &n);
      if (rc == GENPOOL_OK) {
        st->blocks.resize(n);
        return st;
      }
      TORCH_CHECK(
          rc == GENPOOL_E_INVALID && n > st->blocks.size(),
          "genpool: checkpointing a private pool: ",
          last_error());
      st->blocks.resize(n + n / 4 + 8);
    }
    TORCH_CHECK(false, "genpool: checkpointing a private pool: it kept changing");
  }

  cca::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<cca::AllocatorState> as) override {
    check_device(device);
    auto st = std::dynamic_pointer_cast<GenpoolPoolState>(as);
    TORCH_CHECK(st != nullptr, "genpool: setCheckpointPoolState: not a state genpool's getCheckpointState made");
    TORCH_CHECK(
        st->device == device,
        "genpool: setCheckpointPoolState: a checkpoint of device ",
        static_cast<int>(st->device),
        " applied to device ",
        static_cast<int>(device));
    const uint64_t gid = genpool_pool_of(device, st->id, "setCheckpointPoolState");
    std::vector<uint64_t> freed(64);
    size_t n = 0;
    int rc = GENPOOL_E_INTERNAL;
    for (int attempt = 0; attempt < 8; ++attempt) {
      rc = genpool_pool_restore(
          device, gid, st->blocks.data(), st->blocks.size(), freed.data(), freed.size(), &n);
      if (rc == GENPOOL_E_INVALID && n > freed.size()) {
        freed.resize(n + n / 4 + 8);
        continue;
      }
      break;
    }
    TORCH_CHECK(rc == GENPOOL_OK, "genpool: restoring a private pool to a checkpoint: ", last_error());
    freed.resize(n);
    cca::CheckpointDelta delta;
    {
      std::lock_guard<std::mutex> lock(history_mu_);
      for (uint64_t p : freed) {
        contexts_.erase(reinterpret_cast<void*>(p));
      }
    }
    for (uint64_t p : freed) {
      delta.ptrs_freed.push_back(reinterpret_cast<void*>(p));
    }
    for (const auto& b : st->blocks) {
      void* p = reinterpret_cast<void*>(b.address);
      delta.dataptrs_allocd.emplace_back(p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // ----- IPC and peers --------------------------------------------------------------------------

  // The pages under the block at `ptr`, each as a POSIX file descriptor the other process takes with
  // pidfd_getfd (crates/genpool-torch/src/ipc.rs), in PyTorch's byte layout.
  cca::ShareableHandle shareIpcHandle(void* ptr) override {
    if (n_custom_.load(std::memory_order_acquire) != 0) {
      std::shared_ptr<cca::CUDAAllocator> a;
      {
        std::lock_guard<std::mutex> lock(pools_mu_);
        auto it = custom_blocks_.find(ptr);
        if (it != custom_blocks_.end()) {
          a = it->second.allocator;
        }
      }
      if (a) {
        return a->shareIpcHandle(ptr);  // a MemPool made with another allocator
      }
    }
    std::vector<int> fds(8);
    size_t n = 0;
    uint64_t first = 0;
    uint64_t page = 0;
    uint64_t size = 0;
    int rc = genpool_ipc_export(ptr, fds.data(), fds.size(), &n, &first, &page, &size);
    if (rc == GENPOOL_E_INVALID && n > fds.size()) {
      fds.resize(n);
      rc = genpool_ipc_export(ptr, fds.data(), fds.size(), &n, &first, &page, &size);
    }
    TORCH_CHECK(
        rc == GENPOOL_OK,
        "genpool: sending a CUDA tensor to another process (CUDA IPC): ",
        last_error());
    fds.resize(n);
    IpcHeader header{};  // zeroed padding: equal tensors give equal strings (the receiver caches by them)
    header.pid = getpid();
    header.page_size = page;
    header.num_pages = n;
    std::string out;
    out.reserve(2 + sizeof(header) + n * sizeof(int));
    out.push_back(kIpcVersion);
    out.push_back(kIpcOwnType);
    out.append(reinterpret_cast<const char*>(&header), sizeof(header));
    out.append(reinterpret_cast<const char*>(fds.data()), n * sizeof(int));
    return cca::ShareableHandle{
        static_cast<ptrdiff_t>(reinterpret_cast<uint64_t>(ptr) - first), std::move(out)};
  }

  // Another process's memory, from a handle genpool, PyTorch's expandable segments or cudaMalloc wrote;
  // one mapping per handle while any tensor uses it.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard<std::mutex> lock(ipc_mu_);
    for (auto it = ipc_cache_.begin(); it != ipc_cache_.end();) {
      it = it->second.expired() ? ipc_cache_.erase(it) : std::next(it);
    }
    auto cached = ipc_cache_.find(handle);
    if (cached != ipc_cache_.end()) {
      if (auto p = cached->second.lock()) {
        return p;
      }
    }
    const c10::DeviceIndex device = current_device();
    char type = kIpcCudaMalloc;
    size_t at = 0;
    if (handle.size() != kCudaIpcHandleSize) {
      TORCH_CHECK(handle.size() >= 2, "genpool: an empty CUDA IPC handle");
      TORCH_CHECK(
          handle[0] <= kIpcVersion,
          "genpool: a CUDA IPC handle from a newer torch (version ",
          static_cast<int>(handle[0]),
          ")");
      type = handle[1];
      at = 2;
    }
    std::shared_ptr<void> out;
    if (type == kIpcCudaMalloc) {
      TORCH_CHECK(handle.size() >= at + sizeof(cudaIpcMemHandle_t), "genpool: a short CUDA IPC handle");
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handle.data() + at, sizeof(h));
      void* p = nullptr;
      C10_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
      out = std::shared_ptr<void>(p, [device](void* q) {
        c10::cuda::CUDAGuard guard(device);
        cudaError_t err = cudaIpcCloseMemHandle(q);
        if (err != cudaSuccess) {
          (void)cudaGetLastError();
          std::fprintf(stderr, "genpool: cudaIpcCloseMemHandle: %s\n", cudaGetErrorString(err));
        }
      });
    } else if (type == kIpcExpandable || type == kIpcGenpool) {
      IpcHeader header{};
      TORCH_CHECK(handle.size() >= at + sizeof(header), "genpool: a short CUDA IPC handle");
      std::memcpy(&header, handle.data() + at, sizeof(header));
      at += sizeof(header);
      TORCH_CHECK(
          header.num_pages > 0 && handle.size() == at + header.num_pages * sizeof(int),
          "genpool: a malformed CUDA IPC handle (",
          header.num_pages,
          " pages in ",
          handle.size(),
          " bytes)");
      std::vector<int> fds(header.num_pages);
      std::memcpy(fds.data(), handle.data() + at, fds.size() * sizeof(int));
      uint64_t base = 0;
      TORCH_CHECK(
          genpool_ipc_open(device, header.pid, header.page_size, fds.data(), fds.size(), &base) ==
              GENPOOL_OK,
          "genpool: opening a CUDA tensor another process sent: ",
          last_error());
      out = std::shared_ptr<void>(reinterpret_cast<void*>(base), [](void* q) {
        if (genpool_ipc_close(reinterpret_cast<uint64_t>(q)) != GENPOOL_OK) {
          std::fprintf(stderr, "genpool: closing a CUDA IPC mapping: %s\n", last_error().c_str());
        }
      });
    } else {
      TORCH_CHECK(false, "genpool: unknown CUDA IPC handle type ", static_cast<int>(type));
    }
    ipc_cache_[handle] = out;
    return out;
  }

  // `dev` may access `dev_to_access`'s memory: the peer access of the runtime, and genpool's VMM pages
  // of `dev_to_access` (now and as they are mapped) opened to `dev` with cuMemSetAccess.
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    check_device(dev);
    check_device(dev_to_access);
    {
      c10::cuda::CUDAGuard guard(dev);
      cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // clear it: access is what was asked for
      } else {
        C10_CUDA_CHECK(err);
      }
    }
    TORCH_CHECK(
        genpool_enable_peer_access(dev_to_access, dev) == GENPOOL_OK,
        "genpool: opening device ",
        static_cast<int>(dev_to_access),
        "'s memory to device ",
        static_cast<int>(dev),
        ": ",
        last_error());
  }

  cudaError_t memcpyAsync(
      void* dst,
      int dstDevice,
      const void* src,
      int srcDevice,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled) override {
    // VMM-mapped memory of another device needs the peer copy unless peer access is on.
    if (p2p_enabled || dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::string name() override {
    return "genpool";
  }

 private:
  void check_device(c10::DeviceIndex device) const {
    const int n = device_count_.load();
    TORCH_CHECK(
        device >= 0 && device < (n > 0 ? n : kMaxDevices),
        "genpool: invalid device index ",
        static_cast<int>(device));
  }

  // The genpool pool of PyTorch pool `id` on `device`, for a call PyTorch makes on graph pools.
  uint64_t genpool_pool_of(c10::DeviceIndex device, c10::MempoolId_t id, const char* what) {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = pools_[device].find(id);
    TORCH_CHECK(
        it != pools_[device].end(),
        "genpool: ",
        what,
        ": no private pool (",
        id.first,
        ", ",
        id.second,
        ") on device ",
        static_cast<int>(device));
    TORCH_CHECK(
        it->second.genpool_id != 0,
        "genpool: ",
        what,
        ": the pool is a MemPool of another allocator, which genpool cannot checkpoint");
    return it->second.genpool_id;
  }

  // pools_mu_ held. The first time `stream` is seen capturing, tell the engine (no call a capture forbids
  // until the matching end).
  void note_capture_locked(c10::DeviceIndex device, cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    cudaError_t err = cudaStreamGetCaptureInfo(stream, &status, &id);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // an unusable stream: no capture to tell of
      return;
    }
    if (status != cudaStreamCaptureStatusActive || !captures_.emplace(id, std::make_pair(device, stream)).second) {
      return;
    }
    if (genpool_capture_begin(device) != GENPOOL_OK) {
      captures_.erase(id);
      TORCH_WARN("genpool: telling the engine of a capture: ", last_error());
    }
  }

  // pools_mu_ held. Tell the engine of the captures that ended (their stream captures no more, or
  // another capture).
  void sweep_captures_locked() {
    for (auto it = captures_.begin(); it != captures_.end();) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      unsigned long long id = 0;
      cudaError_t err = cudaStreamGetCaptureInfo(it->second.second, &status, &id);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();  // the stream is gone: so is its capture
      }
      if (err == cudaSuccess && status != cudaStreamCaptureStatusNone && id == it->first) {
        ++it;
        continue;
      }
      if (genpool_capture_end(it->second.first) != GENPOOL_OK) {
        TORCH_WARN("genpool: telling the engine a capture ended: ", last_error());
      }
      it = captures_.erase(it);
    }
  }

  // pools_mu_ held.
  void create_locked(
      c10::DeviceIndex device,
      PrivatePool& p,
      std::shared_ptr<cca::CUDAAllocator> custom) {
    if (custom) {
      p.custom = std::move(custom);
    } else {
      p.genpool_id = genpool_pool_create(device);
      TORCH_CHECK(p.genpool_id != 0, "genpool: cannot create a private pool: ", last_error());
    }
    p.use_count = 1;
  }

  // The genpool pool an allocation on `stream` goes to (0: the default), or the custom allocator that
  // serves it. The newest context whose filter accepts the stream wins.
  uint64_t route(
      c10::DeviceIndex device,
      cudaStream_t stream,
      std::shared_ptr<cca::CUDAAllocator>* custom,
      c10::MempoolId_t* custom_id) {
    std::lock_guard<std::mutex> lock(pools_mu_);
    note_capture_locked(device, stream);
    const auto& v = contexts_by_device_[device];
    for (auto it = v.rbegin(); it != v.rend(); ++it) {
      if (it->filter(stream)) {
        auto p = pools_[device].find(it->id);
        if (p == pools_[device].end()) {
          continue;
        }
        if (p->second.custom) {
          *custom = p->second.custom;
          *custom_id = it->id;
          return 0;
        }
        return unsafe_graph_pools() ? 0 : p->second.genpool_id;
      }
    }
    return 0;
  }

  void* custom_alloc(
      const std::shared_ptr<cca::CUDAAllocator>& a,
      c10::DeviceIndex device,
      size_t size,
      cudaStream_t stream,
      c10::MempoolId_t id) {
    void* ptr = a->raw_alloc_with_stream(size, stream);
    TORCH_CHECK_WITH(
        OutOfMemoryError, ptr != nullptr, "CUDA out of memory: the MemPool's allocator returned NULL");
    std::lock_guard<std::mutex> lock(pools_mu_);
    custom_blocks_[ptr] = CustomBlock{a, device, size, stream, id};
    n_custom_.store(custom_blocks_.size(), std::memory_order_release);
    return ptr;
  }

  // Segments of the blocks MemPools made with another allocator hold: one per block, as PyTorch's
  // allocator reports them (`all`, or pool `id` only).
  void append_custom_segments(
      bool all,
      c10::MempoolId_t id,
      std::vector<c10::CachingDeviceAllocator::SegmentInfo>& out) {
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (const auto& [ptr, b] : custom_blocks_) {
      if (!all && !(b.pool == id)) {
        continue;
      }
      c10::CachingDeviceAllocator::SegmentInfo si;
      si.device = b.device;
      si.address = reinterpret_cast<size_t>(ptr);
      si.total_size = b.size;
      si.requested_size = b.size;
      si.allocated_size = b.size;
      si.active_size = b.size;
      si.stream = b.stream;
      si.is_large = b.size > (1u << 20);
      si.is_expandable = false;
      si.owner_private_pool_id = b.pool;
      // ProcessGroupNCCL's register_mem_pool refuses segments whose counter was never set (-1).
      si.registration_counter = 0;
      c10::CachingDeviceAllocator::BlockInfo bi;
      bi.size = b.size;
      bi.requested_size = b.size;
      bi.allocated = true;
      bi.active = true;
      si.blocks.push_back(std::move(bi));
      out.push_back(std::move(si));
    }
  }

  bool custom_free(void* ptr) noexcept {
    std::shared_ptr<cca::CUDAAllocator> a;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      auto it = custom_blocks_.find(ptr);
      if (it == custom_blocks_.end()) {
        return false;
      }
      a = std::move(it->second.allocator);
      custom_blocks_.erase(it);
      n_custom_.store(custom_blocks_.size(), std::memory_order_release);
    }
    try {
      a->raw_delete(ptr);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "genpool: a MemPool allocator's free failed: %s\n", e.what());
    }
    return true;
  }

  // A failed allocation: a MemPool marked use_on_oom may take it; else observers, trace, profiler and
  // the exception PyTorch's own allocator would throw.
  void* on_failure(int rc, c10::DeviceIndex device, size_t size, uint64_t pool, cudaStream_t stream) {
    std::string why = last_error();
    if (rc == GENPOOL_E_OOM && pool == 0) {
      std::vector<uint64_t> fallbacks;
      {
        std::lock_guard<std::mutex> lock(pools_mu_);
        for (const auto& [id, p] : pools_[device]) {
          if (p.use_on_oom && p.genpool_id != 0) {
            fallbacks.push_back(p.genpool_id);
          }
        }
      }
      for (uint64_t id : fallbacks) {
        void* ptr = nullptr;
        if (genpool_backend_malloc(size, device, id, stream, &ptr) == GENPOOL_OK) {
          return ptr;
        }
      }
    }
    TORCH_CHECK(rc == GENPOOL_E_OOM, "genpool: cannot allocate ", size, " bytes on device ",
        static_cast<int>(device), ": ", why);
    size_t device_free = 0;
    size_t device_total = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(&device_free, &device_total));
    }
    uint64_t allocated = 0;
    uint64_t reserved = 0;
    genpool_backend_totals(device, &allocated, &reserved);
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(history_mu_);
      observers = oom_observers_;
    }
    record_trace(TraceEntry::OOM, device, device_free, size, stream, nullptr);
    for (const auto& o : observers) {
      o(device, allocated, device_total, device_free);
    }
    c10::reportOutOfMemoryToProfiler(
        static_cast<int64_t>(size), allocated, reserved, c10::Device(c10::DeviceType::CUDA, device));
    TORCH_CHECK_WITH(
        OutOfMemoryError,
        false,
        "CUDA out of memory. Tried to allocate ",
        c10::CachingAllocator::format_size(size),
        ". GPU ",
        static_cast<int>(device),
        " has a total capacity of ",
        c10::CachingAllocator::format_size(device_total),
        " of which ",
        c10::CachingAllocator::format_size(device_free),
        " is free. Of the memory genpool holds, ",
        c10::CachingAllocator::format_size(allocated),
        " is allocated and ",
        c10::CachingAllocator::format_size(reserved),
        " reserved. genpool: ",
        why);
  }

  void on_alloc(c10::DeviceIndex device, void* ptr, size_t size, cudaStream_t stream, uint64_t pool) {
    if (history_.load(std::memory_order_acquire) || has_trackers_.load(std::memory_order_acquire)) {
      std::shared_ptr<c10::GatheredContext> ctx;
      {
        std::lock_guard<std::mutex> lock(history_mu_);
        if (history_.load(std::memory_order_relaxed) && recorder_ != nullptr &&
            when_ != cca::RecordContext::NEVER) {
          ctx = recorder_();
          contexts_[ptr] = ctx;
        }
      }
      record_trace(
          TraceEntry::ALLOC, device, reinterpret_cast<size_t>(ptr), size, stream,
          when_ >= cca::RecordContext::ALLOC ? ctx : nullptr, pool);
    }
    if (c10::memoryProfilingEnabled()) {
      uint64_t allocated = 0;
      uint64_t reserved = 0;
      genpool_backend_totals(device, &allocated, &reserved);
      c10::reportMemoryUsageToProfiler(
          ptr, static_cast<int64_t>(size), allocated, reserved,
          c10::Device(c10::DeviceType::CUDA, device));
    }
  }

  void on_free(void* ptr, const GenpoolFreed& f) {
    const auto device = static_cast<c10::DeviceIndex>(f.device);
    auto stream = reinterpret_cast<cudaStream_t>(f.stream);
    if (history_.load(std::memory_order_acquire) || has_trackers_.load(std::memory_order_acquire)) {
      std::shared_ptr<c10::GatheredContext> ctx;
      {
        std::lock_guard<std::mutex> lock(history_mu_);
        contexts_.erase(ptr);
        if (history_.load(std::memory_order_relaxed) && recorder_ != nullptr &&
            when_ == cca::RecordContext::ALL) {
          ctx = recorder_();
        }
      }
      const auto addr = reinterpret_cast<size_t>(ptr);
      // Sizes as the allocation's event gave them (the request), so a trace reads back consistently.
      record_trace(TraceEntry::FREE_REQUESTED, device, addr, f.requested, stream, ctx, f.pool);
      record_trace(TraceEntry::FREE_COMPLETED, device, addr, f.requested, stream, ctx, f.pool);
    }
    if (c10::memoryProfilingEnabled()) {
      uint64_t allocated = 0;
      uint64_t reserved = 0;
      genpool_backend_totals(device, &allocated, &reserved);
      c10::reportMemoryUsageToProfiler(
          ptr, -static_cast<int64_t>(f.size), allocated, reserved,
          c10::Device(c10::DeviceType::CUDA, device));
    }
  }

  c10::MempoolId_t mempool_of(int device, uint64_t genpool_id) {
    if (genpool_id == 0) {
      return {0, 0};
    }
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (const auto& [id, p] : pools_[device]) {
      if (p.genpool_id == genpool_id) {
        return id;
      }
    }
    return {0, 0};
  }

  void record_trace(
      TraceEntry::Action action,
      c10::DeviceIndex device,
      size_t addr,
      size_t size,
      cudaStream_t stream,
      std::shared_ptr<c10::GatheredContext> ctx,
      uint64_t pool = 0) {
    const bool recording = history_.load(std::memory_order_acquire);
    if (!recording && !has_trackers_.load(std::memory_order_acquire)) {
      return;
    }
    c10::MempoolId_t mempool = mempool_of(device, pool);
    std::lock_guard<std::mutex> lock(history_mu_);
    TraceEntry te(
        action, device, addr, size, stream, mempool, c10::getApproximateTime(), std::move(ctx),
        compile_context_.empty() ? std::string() : compile_context_.back(), user_metadata_);
    for (const auto& t : trackers_) {
      t(te);
    }
    if (!recording || skip_.count(action) != 0 || device < 0 || device >= kMaxDevices) {
      return;
    }
    auto& ring = traces_[device];
    if (ring.size() >= max_entries_) {
      ring.pop_front();
    }
    ring.push_back(std::move(te));
  }

  static void fetch_snapshot(
      int device,
      uint64_t pool,
      std::vector<GenpoolSegment>& segs,
      std::vector<GenpoolBlock>& blocks) {
    size_t ns = 0;
    size_t nb = 0;
    for (int attempt = 0; attempt < 8; ++attempt) {
      int rc = genpool_backend_snapshot(
          device, pool, segs.data(), segs.size(), blocks.data(), blocks.size(), &ns, &nb);
      if (rc == GENPOOL_OK) {
        segs.resize(ns);
        blocks.resize(nb);
        return;
      }
      TORCH_CHECK(rc == GENPOOL_E_INVALID, "genpool: snapshot: ", last_error());
      // Blocks came and went between the calls: room for the counts given, with some to spare.
      segs.resize(ns + ns / 4 + 8);
      blocks.resize(nb + nb / 4 + 16);
    }
    TORCH_CHECK(false, "genpool: snapshot: the pool kept changing under it");
  }

  void append_segments(
      int device,
      uint64_t pool,
      const std::unordered_map<uint64_t, c10::MempoolId_t>& owner,
      std::vector<c10::CachingDeviceAllocator::SegmentInfo>& out) {
    std::vector<GenpoolSegment> segs;
    std::vector<GenpoolBlock> blocks;
    fetch_snapshot(device, pool, segs, blocks);
    std::lock_guard<std::mutex> lock(history_mu_);
    for (const auto& s : segs) {
      c10::CachingDeviceAllocator::SegmentInfo si;
      si.device = static_cast<c10::DeviceIndex>(device);
      si.address = s.address;
      si.total_size = s.total_size;
      si.requested_size = s.requested_size;
      si.allocated_size = s.allocated_size;
      si.active_size = s.allocated_size;
      si.stream = reinterpret_cast<void*>(s.stream);
      si.is_large = s.is_large != 0;
      si.is_expandable = true;  // pages are mapped under it on demand, as expandable segments do
      // ProcessGroupNCCL's register_mem_pool refuses segments whose counter was never set (-1); a run
      // of pages has no allocation event of its own to count, so every one reports 0.
      si.registration_counter = 0;
      auto o = owner.find(s.pool);
      if (o != owner.end()) {
        si.owner_private_pool_id = o->second;
      }
      for (uint64_t i = s.first_block; i < s.first_block + s.n_blocks && i < blocks.size(); ++i) {
        const auto& b = blocks[i];
        c10::CachingDeviceAllocator::BlockInfo bi;
        bi.size = b.size;
        bi.requested_size = b.requested;
        bi.allocated = b.allocated != 0;
        bi.active = b.allocated != 0;
        if (bi.allocated) {
          auto c = contexts_.find(reinterpret_cast<void*>(b.address));
          if (c != contexts_.end()) {
            bi.context_when_allocated = c->second;
          }
        }
        if (si.context_when_allocated == nullptr) {
          si.context_when_allocated = bi.context_when_allocated;
        }
        si.blocks.push_back(std::move(bi));
      }
      out.push_back(std::move(si));
    }
  }

  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  std::atomic<int> device_count_{0};

  // Private pools (pools_mu_).
  std::mutex pools_mu_;
  std::unordered_map<c10::MempoolId_t, PrivatePool, MempoolIdHash> pools_[kMaxDevices];
  std::vector<PoolContext> contexts_by_device_[kMaxDevices];
  std::atomic<size_t> n_contexts_[kMaxDevices]{};
  std::unordered_map<void*, CustomBlock> custom_blocks_;
  std::atomic<size_t> n_custom_{0};
  // Captures the engine was told of: capture id -> (device, capturing stream).
  std::unordered_map<unsigned long long, std::pair<c10::DeviceIndex, cudaStream_t>> captures_;

  // Memory other processes sent (getIpcDevPtr), by handle (ipc_mu_).
  std::mutex ipc_mu_;
  std::unordered_map<std::string, std::weak_ptr<void>> ipc_cache_;

  // History (history_mu_).
  std::mutex history_mu_;
  std::atomic<bool> history_{false};
  std::atomic<bool> has_trackers_{false};
  cca::CreateContextFn recorder_ = nullptr;
  cca::RecordContext when_ = cca::RecordContext::NEVER;
  size_t max_entries_ = 1;
  std::unordered_set<TraceEntry::Action> skip_;
  std::deque<TraceEntry> traces_[kMaxDevices];
  std::unordered_map<void*, std::shared_ptr<c10::GatheredContext>> contexts_;
  std::vector<c10::CachingDeviceAllocator::AnnotationEntry> annotations_;
  std::vector<std::string> compile_context_;
  std::string user_metadata_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
#if GENPOOL_TORCH_AT_LEAST(2, 15)
  std::vector<cca::OomRejectionObserver> oom_rejection_observers_;
#endif
  std::vector<cca::AllocatorTraceTracker> trackers_;
};

std::shared_ptr<GenpoolAllocator>& the_allocator() {
  static std::shared_ptr<GenpoolAllocator> a;
  return a;
}

void raw_delete_fn(void* ptr) {
  const auto& a = the_allocator();
  if (a) {
    a->free_ptr(ptr);
  }
}

void copy_message(const char* msg, char* buf, size_t len) {
  if (buf != nullptr && len > 0) {
    std::snprintf(buf, len, "%s", msg);
  }
}

}  // namespace genpool_backend

extern "C" {

// Make genpool PyTorch's CUDA allocator. Returns 0, or 1 with the reason in `err` (PyTorch refuses when
// its current allocator was already used). Never throws.
__attribute__((visibility("default"))) int genpool_backend_install(char* err, size_t len) {
  using genpool_backend::GenpoolAllocator;
  try {
    auto& a = genpool_backend::the_allocator();
    if (!a) {
      a = std::make_shared<GenpoolAllocator>();
    }
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    // c10's allocator registry: torch.accelerator's memory API (memory_allocated, memory_stats,
    // reset_peak_memory_stats, empty_cache, ...) and any code that asks c10 for the CUDA allocator read
    // c10::GetAllocator(kCUDA), which PyTorch registers statically with its own caching allocator and
    // changeCurrentAllocator leaves alone: those calls reached PyTorch's allocator, never initialized
    // here ("Invalid device argument", zero bytes allocated). The allocator lives as long as the
    // process (the_allocator() keeps it), as SetAllocator requires; the highest priority, so no static
    // registration overrides it.
    c10::SetAllocator(c10::DeviceType::CUDA, a.get(), UINT8_MAX);
    if (c10::GetAllocator(c10::DeviceType::CUDA) != a.get()) {
      // Installed all the same (every CUDA tensor comes from genpool); only torch.accelerator's
      // figures would be PyTorch's.
      std::fprintf(stderr, "genpool: c10::SetAllocator(kCUDA) kept another allocator: torch.accelerator's "
                           "memory figures will not be genpool's\n");
    }
    return 0;
  } catch (const std::exception& e) {
    genpool_backend::copy_message(e.what(), err, len);
    return 1;
  } catch (...) {
    genpool_backend::copy_message("unknown exception", err, len);
    return 1;
  }
}

// The torch version this file was compiled against, "major.minor".
__attribute__((visibility("default"))) const char* genpool_backend_torch_version() {
#define GENPOOL_STR2(x) #x
#define GENPOOL_STR(x) GENPOOL_STR2(x)
  return GENPOOL_STR(TORCH_VERSION_MAJOR) "." GENPOOL_STR(TORCH_VERSION_MINOR);
}

}  // extern "C"
