// The layout of one shared-memory channel (one directed pair of ranks) and the primitives to use it
// from two processes: a ring of preallocated slots, counters for what was published and consumed,
// and futex words to sleep on. Nothing here knows torch: it moves bytes.
#pragma once

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace megadpp {

constexpr uint32_t kMagic = 0x5050444d;  // "MDPP"
constexpr uint32_t kVersion = 1;
constexpr int kMaxDims = 16;
constexpr size_t kPage = 4096;

// A failed check becomes a Python RuntimeError of one line (no C++ backtrace, unlike TORCH_CHECK).
template <typename... Parts>
void check(bool ok, const Parts&... parts) {
  if (ok) return;
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());
}

inline size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

inline int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // the clock of Python's time.perf_counter_ns
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// What a slot holds besides its bytes: every chunk carries the whole message's description, so the
// receiver can allocate the tensor from the first chunk and needs no other message.
struct alignas(64) SlotHeader {
  uint64_t seq;          // the message's index on the channel
  int64_t tag;
  int32_t dtype;         // c10::ScalarType
  int32_t ndim;
  int64_t shape[kMaxDims];
  uint64_t total_bytes;  // of the message
  uint64_t offset;       // of this chunk within the message
  uint64_t chunk_bytes;
  uint64_t slot_of_payload;  // CUDA IPC: the device slot that holds the bytes (host slots hold none)
};

struct alignas(64) ControlBlock {
  uint32_t magic;
  uint32_t version;
  uint32_t slots;
  uint32_t reserved;
  uint64_t slot_bytes;
  alignas(64) std::atomic<uint32_t> attached;  // set by the receiver once it has the segment mapped
  alignas(64) std::atomic<uint64_t> head;      // chunks published by the sender
  std::atomic<uint32_t> head_word;             // bumped on every publish: the receiver sleeps on it
  alignas(64) std::atomic<uint64_t> tail;      // chunks consumed by the receiver
  std::atomic<uint32_t> tail_word;             // bumped on every consume: a sender on a full ring sleeps on it
  alignas(64) std::atomic<uint32_t> closed;    // the sender has closed the channel
  alignas(64) unsigned char setup[2048];       // kind-specific data exchanged once (CUDA IPC handles)
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "cross-process atomics must be lock-free");

inline size_t slot_stride(uint64_t slot_bytes) { return round_up(sizeof(SlotHeader) + slot_bytes, 64); }
inline size_t segment_bytes(uint32_t slots, uint64_t slot_bytes) {
  return round_up(sizeof(ControlBlock), kPage) + slots * slot_stride(slot_bytes);
}

inline void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Sleep while *word == seen, at most timeout_ms (so that stop flags are rechecked).
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, int timeout_ms) {
  timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// How long a waiter spins before it sleeps: a reply that comes within this is caught without a
// wake-up. No sched_yield in the spin: on a loaded machine each yield can cost a whole time slice,
// and a thread that burns its slices loses the wake-up preemption that a sleeping one gets.
constexpr int64_t kSpinNs = 20000;

template <typename Ready>
bool spin_for(Ready ready) {
  for (int64_t until = monotonic_ns() + kSpinNs; monotonic_ns() < until;) {
    if (ready()) return true;
    for (int i = 0; i < 16; ++i) cpu_relax();
  }
  return ready();
}

// Wait until ready() holds: spin briefly (a message is often microseconds away), then sleep on the
// futex word so that an idle channel costs no CPU. Returns false if stop() became true.
template <typename Ready, typename Stop>
bool wait_for(std::atomic<uint32_t>* word, Ready ready, Stop stop) {
  if (spin_for(ready)) return true;
  while (!stop()) {
    uint32_t seen = word->load(std::memory_order_acquire);
    if (ready()) return true;
    futex_wait(word, seen, 50);
  }
  return ready();
}

// A POSIX shared-memory segment mapped into this process. The creator names it, creates it private
// (0600, O_EXCL: never somebody else's) and unlinks it once the peer has it open; only the creator
// ever unlinks, and only what it created.
class Segment {
 public:
  Segment() = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() { release(); }

  void create(const std::string& name, size_t bytes) {
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error("megadpp transport: cannot create /dev/shm" + name + ": " + strerror(errno));
    name_ = name;
    created_ = true;
    fchmod(fd, 0600);  // whatever the umask
    // Reserve the pages now: tmpfs allocates lazily, and a full /dev/shm would otherwise surface
    // later as SIGBUS in the middle of a copy.
    int err = posix_fallocate(fd, 0, bytes);
    if (err != 0) {
      close(fd);
      unlink();
      throw std::runtime_error("megadpp transport: /dev/shm cannot hold a channel of " + std::to_string(bytes) +
                               " bytes (" + strerror(err) + "); give it more room (docker --shm-size) or use fewer/smaller slots");
    }
    map(fd, bytes);
  }

  void open(const std::string& name) {
    int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) throw std::runtime_error("megadpp transport: cannot open /dev/shm" + name + ": " + strerror(errno));
    struct stat st;
    fstat(fd, &st);
    name_ = name;
    map(fd, size_t(st.st_size));
  }

  void unlink() {
    if (created_ && !unlinked_) {
      shm_unlink(name_.c_str());
      unlinked_ = true;
    }
  }

  void release() {
    unlink();
    if (base_ != nullptr) munmap(base_, bytes_);
    base_ = nullptr;
  }

  char* base() const { return static_cast<char*>(base_); }
  size_t bytes() const { return bytes_; }

 private:
  void map(int fd, size_t bytes) {
    // MAP_POPULATE: fault the ring in now, not page by page in the first copies of a run.
    void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (base == MAP_FAILED) {
      unlink();
      throw std::runtime_error("megadpp transport: cannot map /dev/shm" + name_ + ": " + strerror(errno));
    }
    base_ = base;
    bytes_ = bytes;
  }

  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  bool created_ = false;
  bool unlinked_ = false;
};

// One channel's view of its segment: the control block and the slots.
struct Ring {
  ControlBlock* control = nullptr;
  char* slots_base = nullptr;
  size_t stride = 0;

  void bind(char* base) {
    control = reinterpret_cast<ControlBlock*>(base);
    slots_base = base + round_up(sizeof(ControlBlock), kPage);
    stride = slot_stride(control->slot_bytes);
  }
  SlotHeader* header(uint64_t index) const {
    return reinterpret_cast<SlotHeader*>(slots_base + (index % control->slots) * stride);
  }
  char* data(uint64_t index) const { return reinterpret_cast<char*>(header(index)) + sizeof(SlotHeader); }

  // Sender: wait for a free slot; returns its index (the count of chunks published so far).
  template <typename Stop>
  bool acquire(uint64_t* index, Stop stop) {
    uint64_t head = control->head.load(std::memory_order_relaxed);
    *index = head;
    return wait_for(&control->tail_word,
                    [&] { return head - control->tail.load(std::memory_order_acquire) < control->slots; }, stop);
  }
  void publish() {
    control->head.fetch_add(1, std::memory_order_release);
    control->head_word.fetch_add(1, std::memory_order_release);
    futex_wake(&control->head_word);
  }
  // Receiver: wait for a published chunk; returns its index.
  template <typename Stop>
  bool next(uint64_t* index, Stop stop) {
    uint64_t tail = control->tail.load(std::memory_order_relaxed);
    *index = tail;
    return wait_for(&control->head_word, [&] { return control->head.load(std::memory_order_acquire) > tail; }, stop);
  }
  void consume() {
    control->tail.fetch_add(1, std::memory_order_release);
    control->tail_word.fetch_add(1, std::memory_order_release);
    futex_wake(&control->tail_word);
  }
};

}  // namespace megadpp
