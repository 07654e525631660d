// Grid runner for Metal kernels compiled on the host: threadgroups run one after another, and the
// threads of a threadgroup run as fibers that switch at barriers and simdgroup collectives.
//
// Memory checking: the kernel translation unit is compiled with -fsanitize=thread, which makes GCC
// call __tsan_readN/__tsan_writeN before every load and store. This file supplies those functions
// (no sanitizer runtime is linked) and uses them to bounds-check device buffers and threadgroup
// memory and to find unsynchronised conflicting accesses between barriers.
//
// Usage: runner PLAN   (the plan format is written by tests/msl/harness.py; see parse_plan below)
//        runner --describe   (every kernel instance's limits and static threadgroup arrays; see
//                             describe below)

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "../include/msl/runtime_api.h"

extern "C" {
struct msl_kernel_entry {
  const char* name;
  void (*fn)();
  const char* function;  // the instantiated kernel, as msl::function_name spells it
  unsigned max_threads;  // [[max_total_threads_per_threadgroup]], 0 if not declared
};
// Defined by the generated per-source shim: every [[host_name]] instance, nullptr-terminated.
extern const msl_kernel_entry msl_kernels[];
}

namespace {

constexpr unsigned kSimdWidth = 32;
constexpr size_t kMaxThreadsPerThreadgroup = 1024;
constexpr size_t kMaxThreadgroupMemory = 32768;
constexpr size_t kGuard = 1 << 20;       // unmapped bytes around every device buffer
constexpr size_t kRedzone = 64;          // poisoned bytes between threadgroup allocations
constexpr size_t kStackSize = 256 << 10;  // per fiber
constexpr size_t kPage = 4096;
constexpr size_t kPayload = 256;  // bytes a lane may deposit in one collective

// ------------------------------------------------------------------------------------------
// Context switching (x86-64 System V): saves callee-saved registers, MXCSR and the x87 control word.
// ------------------------------------------------------------------------------------------
extern "C" void msl_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl msl_switch
  .type msl_switch,@function
msl_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size msl_switch, .-msl_switch
)");

enum class State { Runnable, AtBarrier, AtCollective, Done };

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // lowest usable address
  State state = State::Done;
  unsigned tid = 0;  // index in threadgroup
  uint32_t pos_in_tg[3] = {0, 0, 0};
  uint64_t round = 0;  // collectives completed by this lane
  msl::rt::Site wait_site{nullptr, 0, 0};
  const char* wait_kind = "";
};

struct Collective {
  const char* kind = nullptr;
  msl::rt::Site site{nullptr, 0, 0};
  size_t size = 0;
  uint32_t arrived = 0;
  uint32_t participants = 0;
  bool is_barrier = false;
  unsigned flags = 0;
  unsigned char (*values)[kPayload] = nullptr;  // kSimdWidth slots
};

struct SimdGroup {
  uint32_t alive = 0;
  uint32_t epoch = 0;  // simdgroup_barrier(mem_threadgroup) completions
  Collective c[2];
};

struct Buffer {
  std::string name;
  char* region = nullptr;  // start of guarded mapping
  size_t region_size = 0;
  char* data = nullptr;
  size_t size = 0;
  bool read_only = false;
  std::vector<uint64_t> writers;  // per byte: 0 = none, else encoded writer (lazily allocated)
};

struct Binding {
  int buffer = -1;
  size_t offset = 0;
};

struct Dispatch {
  std::string kernel;
  uint32_t groups[3] = {1, 1, 1};
  uint32_t threads[3] = {1, 1, 1};
  std::map<int, Binding> buffers;
  std::map<int, size_t> threadgroup_lengths;
  std::map<int, std::vector<unsigned char>> constants;
};

// Per-byte threadgroup-memory shadow.
struct TgShadow {
  uint32_t epoch;
  int16_t writer;
  int16_t reader;
  uint32_t writer_sg_epoch;
  uint32_t reader_sg_epoch;
  int16_t reader_sg;  // simdgroup of all readers, -1 if mixed
  uint8_t multi_reader;
  uint8_t redzone;
};

struct TgVar {
  unsigned key;
  size_t offset;
  size_t size;
  const char* name;
};

// ------------------------------------------------------------------------------------------
// Global state of the running dispatch
// ------------------------------------------------------------------------------------------
std::vector<std::unique_ptr<Buffer>> g_buffers;
std::map<std::string, int> g_buffer_index;
const Dispatch* g_dispatch = nullptr;
const msl_kernel_entry* g_entry = nullptr;

uint32_t g_tg_pos[3];
uint64_t g_tg_linear = 0;
unsigned g_nthreads = 0;
std::vector<Fiber> g_fibers;
std::vector<SimdGroup> g_sgs;
Fiber* g_cur = nullptr;
void* g_sched_sp = nullptr;
unsigned g_done = 0;
unsigned g_barrier_arrived = 0;
msl::rt::Site g_barrier_site{nullptr, 0, 0};
unsigned g_barrier_flags = 0;
uint32_t g_tg_epoch = 1;
uint32_t g_dev_epoch = 1;

char* g_arena = nullptr;  // threadgroup memory (guarded)
size_t g_arena_cap = 0;
size_t g_arena_used = 0;
std::vector<TgShadow> g_tg_shadow;
std::vector<uint8_t> g_tg_written;
std::vector<TgVar> g_tg_vars;
std::map<int, size_t> g_tg_param_offset;

size_t g_arena_high = 0;  // bytes of the arena touched by any threadgroup so far
std::vector<unsigned char> g_payload;  // [simdgroup][2][lane][kPayload]
char* g_stacks = nullptr;
size_t g_stack_count = 0;

// ------------------------------------------------------------------------------------------
// Failure reporting
// ------------------------------------------------------------------------------------------
void describe_thread(char* out, size_t n) {
  if (!g_dispatch) {
    snprintf(out, n, "(outside a dispatch)");
    return;
  }
  if (!g_cur) {
    snprintf(out, n, "kernel %s, threadgroup (%u,%u,%u)", g_dispatch->kernel.c_str(), g_tg_pos[0],
             g_tg_pos[1], g_tg_pos[2]);
    return;
  }
  snprintf(out, n, "kernel %s, threadgroup (%u,%u,%u), thread (%u,%u,%u) [simdgroup %u lane %u]",
           g_dispatch->kernel.c_str(), g_tg_pos[0], g_tg_pos[1], g_tg_pos[2], g_cur->pos_in_tg[0],
           g_cur->pos_in_tg[1], g_cur->pos_in_tg[2], g_cur->tid / kSimdWidth,
           g_cur->tid % kSimdWidth);
}

[[noreturn]] void die(const char* kind, const char* fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  char who[512];
  describe_thread(who, sizeof who);
  fprintf(stderr, "MSL-HARNESS ERROR [%s]: %s\n  in %s\n", kind, msg, who);
  fflush(stderr);
  _exit(3);
}

void site_str(const msl::rt::Site& s, char* out, size_t n) {
  snprintf(out, n, "%s:%u:%u", s.file ? s.file : "?", s.line, s.column);
}

bool same_site(const msl::rt::Site& a, const msl::rt::Site& b) {
  return a.line == b.line && a.column == b.column &&
         (a.file == b.file || (a.file && b.file && strcmp(a.file, b.file) == 0));
}

void on_segv(int sig, siginfo_t* info, void* ctx) {
  auto* uc = static_cast<ucontext_t*>(ctx);
  const unsigned long pc = uc->uc_mcontext.gregs[REG_RIP];
  char who[512];
  describe_thread(who, sizeof who);
  fprintf(stderr,
          "MSL-HARNESS ERROR [%s]: invalid memory access at %p (wild pointer, far out-of-bounds "
          "access or fiber stack overflow) pc=0x%lx\n  in %s\n",
          sig == SIGSEGV ? "segfault" : "signal", info->si_addr, pc, who);
  fflush(stderr);
  _exit(3);
}

// ------------------------------------------------------------------------------------------
// Memory
// ------------------------------------------------------------------------------------------
char* map_guarded(size_t size, char** region, size_t* region_size) {
  const size_t body = (size + kPage - 1) / kPage * kPage;
  *region_size = body + 2 * kGuard;
  void* p = mmap(nullptr, *region_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) die("setup", "mmap failed");
  *region = static_cast<char*>(p);
  if (body && mprotect(*region + kGuard, body, PROT_READ | PROT_WRITE) != 0) die("setup", "mprotect failed");
  // Data ends exactly at the upper guard so that overruns fault even without the hooks.
  return *region + kGuard + (body - size);
}

inline int16_t sg_of(int tid) { return static_cast<int16_t>(tid / static_cast<int>(kSimdWidth)); }

void tg_access(size_t off, size_t size, bool write, void* pc) {
  if (off + size > g_arena_used) {
    die("threadgroup-out-of-bounds", "%s of %zu bytes at threadgroup offset %zu beyond the %zu bytes "
        "allocated (pc=%p)", write ? "write" : "read", size, off, g_arena_used, pc);
  }
  const int t = static_cast<int>(g_cur->tid);
  const int16_t S = sg_of(t);
  const uint32_t sgE = g_sgs[S].epoch;
  for (size_t b = off; b < off + size; ++b) {
    TgShadow& s = g_tg_shadow[b];
    if (s.redzone) {
      die("threadgroup-out-of-bounds", "%s at threadgroup offset %zu falls between allocations "
          "(pc=%p)", write ? "write" : "read", b, pc);
    }
    if (s.epoch != g_tg_epoch) {
      s.epoch = g_tg_epoch;
      s.writer = -1;
      s.reader = -1;
      s.multi_reader = 0;
      s.reader_sg = -1;
    }
    const bool writer_other = s.writer >= 0 && s.writer != t &&
                              !(sg_of(s.writer) == S && s.writer_sg_epoch < sgE);
    if (!write) {
      if (!g_tg_written[b]) {
        die("threadgroup-uninitialized", "read of threadgroup offset %zu, never written in this "
            "threadgroup (pc=%p)", b, pc);
      }
      if (writer_other) {
        die("threadgroup-race", "read of threadgroup offset %zu written by thread %d in the same "
            "barrier interval (missing threadgroup_barrier?) (pc=%p)", b, s.writer, pc);
      }
      if (s.reader < 0) {
        s.reader = static_cast<int16_t>(t);
        s.reader_sg = S;
        s.reader_sg_epoch = sgE;
      } else if (s.reader != t || s.multi_reader) {
        s.multi_reader = s.multi_reader || s.reader != t;
        if (s.reader_sg != S) s.reader_sg = -1;
        if (sgE > s.reader_sg_epoch) s.reader_sg_epoch = sgE;
      }
    } else {
      if (writer_other) {
        die("threadgroup-race", "write to threadgroup offset %zu also written by thread %d in the "
            "same barrier interval (pc=%p)", b, s.writer, pc);
      }
      const bool other_readers = s.reader >= 0 && (s.multi_reader || s.reader != t);
      if (other_readers && !(s.reader_sg == S && s.reader_sg_epoch < sgE)) {
        die("threadgroup-race", "write to threadgroup offset %zu read by thread %d in the same "
            "barrier interval (missing threadgroup_barrier?) (pc=%p)", b, s.reader, pc);
      }
      s.writer = static_cast<int16_t>(t);
      s.writer_sg_epoch = sgE;
      g_tg_written[b] = 1;
    }
  }
}

void dev_access(Buffer& buf, uintptr_t a, size_t size, bool write, void* pc) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(buf.data);
  if (a < lo || a + size > lo + buf.size) {
    const long long off = static_cast<long long>(a) - static_cast<long long>(lo);
    die("device-out-of-bounds", "%s of %zu bytes at byte offset %lld of buffer '%s' (%zu bytes) "
        "(pc=%p)", write ? "write" : "read", size, off, buf.name.c_str(), buf.size, pc);
  }
  if (write && buf.read_only) {
    die("constant-write", "write to constant buffer '%s' (pc=%p)", buf.name.c_str(), pc);
  }
  if (!write && buf.writers.empty()) return;
  if (buf.writers.empty()) buf.writers.assign(buf.size, 0);
  const uint64_t me = (g_tg_linear << 32) | (static_cast<uint64_t>(g_cur->tid) << 16) |
                      (g_dev_epoch & 0xffffu);
  for (size_t b = a - lo; b < a - lo + size; ++b) {
    const uint64_t w = buf.writers[b];
    if (w != 0) {
      const uint64_t w_tg = (w >> 32) - 1, w_tid = (w >> 16) & 0xffffu, w_ep = w & 0xffffu;
      const bool ordered = w_tg == g_tg_linear && (w_tid == g_cur->tid || w_ep != (g_dev_epoch & 0xffffu));
      if (!ordered) {
        die("device-race", "%s of byte %zu of buffer '%s' written by another thread (threadgroup "
            "#%" PRIu64 ", thread %" PRIu64 ") in the same dispatch without synchronisation (pc=%p)",
            write ? "write" : "read", b, buf.name.c_str(), w_tg, w_tid, pc);
      }
    }
    if (write) buf.writers[b] = me + (1ull << 32);
  }
}

inline void on_access(void* p, size_t size, bool write, void* pc) {
  if (!g_cur) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t arena_region = reinterpret_cast<uintptr_t>(g_arena) - kGuard;
  if (a - arena_region < g_arena_cap + 2 * kGuard) {
    const uintptr_t arena = reinterpret_cast<uintptr_t>(g_arena);
    if (a < arena) die("threadgroup-out-of-bounds", "access %zu bytes before threadgroup memory (pc=%p)",
                       static_cast<size_t>(arena - a), pc);
    tg_access(a - arena, size, write, pc);
    return;
  }
  for (auto& b : g_buffers) {
    if (a - reinterpret_cast<uintptr_t>(b->region) < b->region_size) {
      dev_access(*b, a, size, write, pc);
      return;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Static threadgroup memory: the arrays each kernel instance declares, whether or not they run
// ------------------------------------------------------------------------------------------
struct StaticTgVar {
  std::string function;  // declaring function, "kernel<args>(params)::<lambda()>"
  msl::rt::TgDecl decl;
  size_t size;
  size_t align;
};

// Filled at program start (before main) by msl::TgStatic, hence a function-local static.
std::vector<StaticTgVar>& static_tg_vars() {
  static std::vector<StaticTgVar> vars;
  return vars;
}

// "X" of a __PRETTY_FUNCTION__ ending in "[with P = X]".
std::string pretty_argument(const char* pretty) {
  const char* eq = strstr(pretty, " = ");
  std::string s = eq ? eq + 3 : pretty;
  if (!s.empty() && s.back() == ']') s.pop_back();
  return s;
}

struct StaticUse {
  size_t bytes = 0;  // laid out in declaration order at natural alignment, rounded up to 16
  std::vector<const StaticTgVar*> vars;
};

bool declared_in(const StaticTgVar& v, const msl_kernel_entry& e) {
  const std::string fn = pretty_argument(e.function) + "(";
  return v.function.compare(0, fn.size(), fn) == 0;
}

StaticUse static_threadgroup_use(const msl_kernel_entry& e) {
  StaticUse u;
  for (const StaticTgVar& v : static_tg_vars())
    if (declared_in(v, e)) u.vars.push_back(&v);
  std::sort(u.vars.begin(), u.vars.end(), [](const StaticTgVar* a, const StaticTgVar* b) {
    return a->decl.line < b->decl.line;
  });
  for (const StaticTgVar* v : u.vars) u.bytes = (u.bytes + v->align - 1) / v->align * v->align + v->size;
  u.bytes = (u.bytes + 15) / 16 * 16;
  return u;
}

// One tab-separated line per fact, read by tests/msl/harness.py (Program.limits):
//   kernel  HOST_NAME  MAX_THREADS(0: none)  STATIC_THREADGROUP_BYTES
//   tgvar   HOST_NAME  SIZE  ALIGN  NAME  LINE  FILE
//   orphan  SIZE  ALIGN  NAME  LINE  FILE  FUNCTION   (declared outside every kernel instance)
int describe() {
  std::vector<bool> owned(static_tg_vars().size(), false);
  for (const msl_kernel_entry* e = msl_kernels; e->name; ++e) {
    const StaticUse u = static_threadgroup_use(*e);
    printf("kernel\t%s\t%u\t%zu\n", e->name, e->max_threads, u.bytes);
    for (const StaticTgVar* v : u.vars) {
      owned[v - static_tg_vars().data()] = true;
      printf("tgvar\t%s\t%zu\t%zu\t%s\t%u\t%s\n", e->name, v->size, v->align, v->decl.name,
             v->decl.line, v->decl.file);
    }
  }
  for (size_t i = 0; i < owned.size(); ++i) {
    const StaticTgVar& v = static_tg_vars()[i];
    if (!owned[i])
      printf("orphan\t%zu\t%zu\t%s\t%u\t%s\t%s\n", v.size, v.align, v.decl.name, v.decl.line,
             v.decl.file, v.function.c_str());
  }
  return 0;
}

// ------------------------------------------------------------------------------------------
// Scheduling
// ------------------------------------------------------------------------------------------
void yield_to_scheduler() { msl_switch(&g_cur->sp, g_sched_sp); }

void thread_exit();

void fiber_main() {
  g_entry->fn();
  thread_exit();
  for (;;) yield_to_scheduler();
}

void complete_collective(SimdGroup& sg, Fiber& me) {
  Collective& c = sg.c[me.round & 1];
  c.participants = c.arrived;
  const unsigned base = static_cast<unsigned>(&sg - g_sgs.data()) * kSimdWidth;
  for (unsigned l = 0; l < kSimdWidth; ++l) {
    if (c.arrived >> l & 1u) {
      Fiber& f = g_fibers[base + l];
      f.state = State::Runnable;
      f.round++;
    }
  }
  if (c.is_barrier && (c.flags & 2u)) sg.epoch++;
  sg.c[(me.round) & 1].arrived = 0;  // me.round already advanced: this is the next round's slot
  sg.c[(me.round) & 1].kind = nullptr;
}

void thread_exit() {
  Fiber& f = *g_cur;
  f.state = State::Done;
  g_done++;
  if (g_barrier_arrived > 0) {
    char s[512];
    site_str(g_barrier_site, s, sizeof s);
    die("barrier-divergence", "thread returned while %u threads wait at threadgroup_barrier %s",
        g_barrier_arrived, s);
  }
  SimdGroup& sg = g_sgs[f.tid / kSimdWidth];
  sg.alive &= ~(1u << (f.tid % kSimdWidth));
  // Lanes waiting at a collective may now be complete (the exited lane is inactive).
  for (unsigned l = 0; l < kSimdWidth; ++l) {
    if (!(sg.alive >> l & 1u)) continue;
    Fiber& o = g_fibers[(f.tid / kSimdWidth) * kSimdWidth + l];
    if (o.state == State::AtCollective) {
      Collective& c = sg.c[o.round & 1];
      if (c.arrived != 0 && c.arrived == sg.alive) complete_collective(sg, o);
    }
    break;
  }
}

void run_threadgroup() {
  const uint32_t* tpt = g_dispatch->threads;
  g_done = 0;
  g_barrier_arrived = 0;
  g_tg_epoch++;
  g_dev_epoch++;
  const unsigned nsg = (g_nthreads + kSimdWidth - 1) / kSimdWidth;
  g_sgs.assign(nsg, SimdGroup{});
  if (g_payload.size() < nsg * 2 * kSimdWidth * kPayload) g_payload.resize(nsg * 2 * kSimdWidth * kPayload);
  for (unsigned s = 0; s < nsg; ++s) {
    for (int k = 0; k < 2; ++k)
      g_sgs[s].c[k].values = reinterpret_cast<unsigned char(*)[kPayload]>(
          &g_payload[((s * 2 + k) * kSimdWidth) * kPayload]);
    const unsigned n = std::min(kSimdWidth, g_nthreads - s * kSimdWidth);
    g_sgs[s].alive = n == 32 ? 0xffffffffu : ((1u << n) - 1);
  }
  // Threadgroup memory: dynamic [[threadgroup(n)]] lengths first, in index order.
  g_arena_used = 0;
  g_tg_vars.clear();
  g_tg_param_offset.clear();
  for (auto& [idx, len] : g_dispatch->threadgroup_lengths) {
    g_arena_used = (g_arena_used + 15) / 16 * 16;
    g_tg_param_offset[idx] = g_arena_used;
    g_arena_used += len + kRedzone;
  }
  g_arena_high = std::max(g_arena_high, g_arena_used);
  std::memset(g_arena, 0xff, g_arena_high);  // NaN pattern
  std::fill(g_tg_written.begin(), g_tg_written.begin() + g_arena_high, 0);
  std::fill(g_tg_shadow.begin(), g_tg_shadow.begin() + g_arena_high, TgShadow{0, -1, -1, 0, 0, -1, 0, 1});
  for (auto& [idx, off] : g_tg_param_offset) {
    const size_t len = g_dispatch->threadgroup_lengths.at(idx);
    for (size_t b = off; b < off + len; ++b) g_tg_shadow[b].redzone = 0;
  }

  for (unsigned i = 0; i < g_nthreads; ++i) {
    Fiber& f = g_fibers[i];
    f.tid = i;
    f.pos_in_tg[0] = i % tpt[0];
    f.pos_in_tg[1] = (i / tpt[0]) % tpt[1];
    f.pos_in_tg[2] = i / (tpt[0] * tpt[1]);
    f.round = 0;
    f.state = State::Runnable;
    // Fresh stack: msl_switch pops [mxcsr|fpucw], r15..rbp, then returns into fiber_main.
    char* top = f.stack + kStackSize;
    auto* w = reinterpret_cast<uint64_t*>(top);
    w[-1] = 0;
    w[-2] = reinterpret_cast<uint64_t>(&fiber_main);
    for (int k = 3; k <= 8; ++k) w[-k] = 0;
    auto* fp = reinterpret_cast<uint32_t*>(&w[-9]);
    fp[0] = 0x1f80;
    fp[1] = 0x037f;
    f.sp = &w[-9];
  }
  for (;;) {
    bool progress = false;
    for (unsigned i = 0; i < g_nthreads; ++i) {
      if (g_fibers[i].state != State::Runnable) continue;
      g_cur = &g_fibers[i];
      msl_switch(&g_sched_sp, g_cur->sp);
      g_cur = nullptr;
      progress = true;
    }
    if (g_done == g_nthreads) break;
    if (!progress) {
      std::string dump;
      for (unsigned i = 0; i < g_nthreads; ++i) {
        const Fiber& f = g_fibers[i];
        if (f.state == State::Done) continue;
        char s[512];
        site_str(f.wait_site, s, sizeof s);
        dump += "\n    thread " + std::to_string(i) + " waits at " + f.wait_kind + " " + s;
        if (dump.size() > 1500) break;
      }
      die("deadlock", "threads wait at different barriers/collectives (divergent control flow):%s",
          dump.c_str());
    }
  }
}

void run_dispatch(const Dispatch& d) {
  g_dispatch = &d;
  g_entry = nullptr;
  for (const msl_kernel_entry* e = msl_kernels; e->name; ++e)
    if (d.kernel == e->name) g_entry = e;
  if (!g_entry) die("setup", "no kernel instance named '%s' in this source", d.kernel.c_str());
  g_nthreads = d.threads[0] * d.threads[1] * d.threads[2];
  if (g_nthreads == 0) die("setup", "empty threadgroup");
  // A pipeline's maxTotalThreadsPerThreadgroup is at most 1024 and at most the kernel's declared
  // [[max_total_threads_per_threadgroup]]; Metal rejects larger dispatches.
  if (g_nthreads > kMaxThreadsPerThreadgroup)
    die("threads-per-threadgroup", "%u threads per threadgroup (%u x %u x %u) exceed the pipeline "
        "maximum of %zu", g_nthreads, d.threads[0], d.threads[1], d.threads[2],
        kMaxThreadsPerThreadgroup);
  if (g_entry->max_threads && g_nthreads > g_entry->max_threads)
    die("threads-per-threadgroup", "%u threads per threadgroup exceed the kernel's "
        "[[max_total_threads_per_threadgroup(%u)]]", g_nthreads, g_entry->max_threads);
  size_t dyn = 0;
  for (auto& [i, len] : d.threadgroup_lengths) {
    if (len % 16) die("setup", "threadgroup memory length %zu of index %d is not a multiple of 16", len, i);
    dyn += len;
  }
  // Static arrays count whether or not this dispatch reaches their declarations.
  const StaticUse st = static_threadgroup_use(*g_entry);
  if (st.bytes + dyn > kMaxThreadgroupMemory) {
    std::string arrays;
    for (const StaticTgVar* v : st.vars)
      arrays += std::string(arrays.empty() ? "" : ", ") + v->decl.name + " " + std::to_string(v->size);
    die("threadgroup-limit", "threadgroup memory of %zu bytes (static arrays %zu [%s], "
        "[[threadgroup(n)]] lengths %zu) exceeds 32 KiB", st.bytes + dyn, st.bytes, arrays.c_str(), dyn);
  }
  for (auto& b : g_buffers) b->writers.clear();
  if (g_fibers.size() < g_nthreads) {
    g_fibers.resize(g_nthreads);
    const size_t slot = kStackSize + kPage;
    if (g_stack_count < g_nthreads) {
      void* p = mmap(nullptr, slot * kMaxThreadsPerThreadgroup, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) die("setup", "mmap stacks");
      g_stacks = static_cast<char*>(p);
      for (size_t i = 0; i < kMaxThreadsPerThreadgroup; ++i)
        mprotect(g_stacks + i * slot + kPage, kStackSize, PROT_READ | PROT_WRITE);
      g_stack_count = kMaxThreadsPerThreadgroup;
    }
    for (size_t i = 0; i < g_fibers.size(); ++i) g_fibers[i].stack = g_stacks + i * slot + kPage;
  }
  for (uint32_t z = 0; z < d.groups[2]; ++z)
    for (uint32_t y = 0; y < d.groups[1]; ++y)
      for (uint32_t x = 0; x < d.groups[0]; ++x) {
        g_tg_pos[0] = x;
        g_tg_pos[1] = y;
        g_tg_pos[2] = z;
        g_tg_linear = (static_cast<uint64_t>(z) * d.groups[1] + y) * d.groups[0] + x;
        run_threadgroup();
      }
  g_dispatch = nullptr;
}

// ------------------------------------------------------------------------------------------
// Plan
// ------------------------------------------------------------------------------------------
//   buffer NAME NBYTES FILE|- [ro]     load FILE (raw bytes) or zero-fill
//   dispatch KERNEL GX GY GZ TX TY TZ  start describing a dispatch
//   bind INDEX BUFFER OFFSET           [[buffer(INDEX)]] = BUFFER + OFFSET bytes
//   tgmem INDEX NBYTES                 [[threadgroup(INDEX)]] length
//   fconst INDEX HEXBYTES              function constant value
//   run                                execute the dispatch described since `dispatch`
//   output BUFFER FILE                 write the buffer (after all dispatches)
int main_impl(const char* plan_path) {
  std::ifstream in(plan_path);
  if (!in) die("setup", "cannot open plan %s", plan_path);
  std::vector<std::pair<std::string, std::string>> outputs;
  Dispatch cur;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string op;
    if (!(ls >> op) || op[0] == '#') continue;
    if (op == "buffer") {
      auto b = std::make_unique<Buffer>();
      std::string file, flag;
      ls >> b->name >> b->size >> file >> flag;
      b->read_only = flag == "ro";
      b->data = map_guarded(b->size, &b->region, &b->region_size);
      if (file != "-") {
        FILE* f = fopen(file.c_str(), "rb");
        if (!f || fread(b->data, 1, b->size, f) != b->size) die("setup", "cannot read %s", file.c_str());
        fclose(f);
      }
      g_buffer_index[b->name] = static_cast<int>(g_buffers.size());
      g_buffers.push_back(std::move(b));
    } else if (op == "dispatch") {
      cur = Dispatch{};
      ls >> cur.kernel >> cur.groups[0] >> cur.groups[1] >> cur.groups[2] >> cur.threads[0] >>
          cur.threads[1] >> cur.threads[2];
    } else if (op == "bind") {
      int idx;
      std::string name;
      size_t off;
      ls >> idx >> name >> off;
      auto it = g_buffer_index.find(name);
      if (it == g_buffer_index.end()) die("setup", "unknown buffer %s", name.c_str());
      cur.buffers[idx] = Binding{it->second, off};
    } else if (op == "tgmem") {
      int idx;
      size_t len;
      ls >> idx >> len;
      cur.threadgroup_lengths[idx] = len;
    } else if (op == "fconst") {
      int idx;
      std::string hex;
      ls >> idx >> hex;
      std::vector<unsigned char> bytes;
      for (size_t i = 0; i + 1 < hex.size(); i += 2) bytes.push_back(std::stoi(hex.substr(i, 2), nullptr, 16));
      cur.constants[idx] = bytes;
    } else if (op == "run") {
      run_dispatch(cur);
    } else if (op == "output") {
      std::string name, file;
      ls >> name >> file;
      outputs.emplace_back(name, file);
    } else {
      die("setup", "bad plan line: %s", line.c_str());
    }
  }
  for (auto& [name, file] : outputs) {
    auto it = g_buffer_index.find(name);
    if (it == g_buffer_index.end()) die("setup", "unknown output %s", name.c_str());
    const Buffer& b = *g_buffers[it->second];
    FILE* f = fopen(file.c_str(), "wb");
    if (!f || fwrite(b.data, 1, b.size, f) != b.size) die("setup", "cannot write %s", file.c_str());
    fclose(f);
  }
  return 0;
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Runtime API used by the MSL stand-in headers
// ------------------------------------------------------------------------------------------
namespace msl::rt {

void position(Pos which, uint32_t out[3]) {
  const Fiber& f = *g_cur;
  const uint32_t* tpt = g_dispatch->threads;
  const uint32_t* grid = g_dispatch->groups;
  out[0] = out[1] = out[2] = 0;
  switch (which) {
    case Pos::thread_position_in_grid:
      for (int i = 0; i < 3; ++i) out[i] = g_tg_pos[i] * tpt[i] + f.pos_in_tg[i];
      break;
    case Pos::thread_position_in_threadgroup:
      for (int i = 0; i < 3; ++i) out[i] = f.pos_in_tg[i];
      break;
    case Pos::threadgroup_position_in_grid:
      for (int i = 0; i < 3; ++i) out[i] = g_tg_pos[i];
      break;
    case Pos::threads_per_threadgroup:
    case Pos::dispatch_threads_per_threadgroup:
      for (int i = 0; i < 3; ++i) out[i] = tpt[i];
      break;
    case Pos::threadgroups_per_grid:
      for (int i = 0; i < 3; ++i) out[i] = grid[i];
      break;
    case Pos::threads_per_grid:
      for (int i = 0; i < 3; ++i) out[i] = grid[i] * tpt[i];
      break;
    case Pos::thread_index_in_threadgroup: out[0] = f.tid; break;
    case Pos::thread_index_in_simdgroup: out[0] = f.tid % kSimdWidth; break;
    case Pos::simdgroup_index_in_threadgroup: out[0] = f.tid / kSimdWidth; break;
    case Pos::simdgroups_per_threadgroup: out[0] = (g_nthreads + kSimdWidth - 1) / kSimdWidth; break;
    case Pos::threads_per_simdgroup:
    case Pos::thread_execution_width: out[0] = kSimdWidth; break;
    case Pos::quadgroup_index_in_threadgroup: out[0] = f.tid / 4; break;
    case Pos::thread_index_in_quadgroup: out[0] = f.tid % 4; break;
    case Pos::quadgroups_per_threadgroup: out[0] = (g_nthreads + 3) / 4; break;
    case Pos::grid_origin: break;
  }
}

static Exchange exchange(const char* kind, const void* value, size_t size, Site site,
                         bool is_barrier, unsigned flags) {
  Fiber& f = *g_cur;
  if (size > kPayload) die("harness", "%s payload %zu bytes too large", kind, size);
  if (g_nthreads % kSimdWidth != 0) {
    char s[512];
    site_str(site, s, sizeof s);
    die("simd-width", "%s at %s in a threadgroup of %u threads: a kernel that uses simdgroup "
        "functions must be dispatched with whole simdgroups (a multiple of %u threads)", kind, s,
        g_nthreads, kSimdWidth);
  }
  SimdGroup& sg = g_sgs[f.tid / kSimdWidth];
  Collective& c = sg.c[f.round & 1];
  const unsigned lane = f.tid % kSimdWidth;
  if (c.arrived == 0) {
    c.kind = kind;
    c.site = site;
    c.size = size;
    c.is_barrier = is_barrier;
    c.flags = flags;
  } else if (!same_site(c.site, site) || strcmp(c.kind, kind) != 0 || c.size != size) {
    char a[512], b[512];
    site_str(c.site, a, sizeof a);
    site_str(site, b, sizeof b);
    die("simdgroup-divergence", "lane reached %s at %s while other lanes of its simdgroup wait at "
        "%s at %s", kind, b, c.kind, a);
  }
  if (size) std::memcpy(c.values[lane], value, size);
  c.arrived |= 1u << lane;
  f.state = State::AtCollective;
  f.wait_site = site;
  f.wait_kind = kind;
  const uint64_t my_round = f.round;
  if (c.arrived == sg.alive) {
    complete_collective(sg, f);
  } else {
    yield_to_scheduler();
  }
  Collective& done = sg.c[my_round & 1];
  return Exchange{&done.values[0][0], kPayload, done.participants, lane};
}

Exchange simd_exchange(const char* kind, const void* value, size_t size, Site site) {
  return exchange(kind, value, size, site, false, 0);
}

void simdgroup_barrier(unsigned flags, Site site) {
  exchange("simdgroup_barrier", nullptr, 0, site, true, flags);
}

void threadgroup_barrier(unsigned flags, Site site) {
  Fiber& f = *g_cur;
  if (g_done > 0) {
    char s[512];
    site_str(site, s, sizeof s);
    die("barrier-divergence", "threadgroup_barrier %s reached after %u threads of the threadgroup "
        "returned", s, g_done);
  }
  if (g_barrier_arrived == 0) {
    g_barrier_site = site;
    g_barrier_flags = flags;
  } else if (!same_site(g_barrier_site, site)) {
    char a[512], b[512];
    site_str(g_barrier_site, a, sizeof a);
    site_str(site, b, sizeof b);
    die("barrier-divergence", "thread reached threadgroup_barrier %s while others wait at %s", b, a);
  }
  f.state = State::AtBarrier;
  f.wait_site = site;
  f.wait_kind = "threadgroup_barrier";
  if (++g_barrier_arrived == g_nthreads) {
    g_barrier_arrived = 0;
    if (flags & 2u) g_tg_epoch++;
    if (flags & 1u) g_dev_epoch++;
    for (unsigned i = 0; i < g_nthreads; ++i) g_fibers[i].state = State::Runnable;
    return;
  }
  yield_to_scheduler();
}

void* threadgroup_variable(unsigned key, size_t size, size_t align, const char* name) {
  for (const TgVar& v : g_tg_vars)
    if (v.key == key) return g_arena + v.offset;
  align = std::max<size_t>(align, 16);
  const size_t off = (g_arena_used + align - 1) / align * align;
  size_t total = size;
  for (const TgVar& v : g_tg_vars) total += v.size;
  for (auto& [i, len] : g_dispatch->threadgroup_lengths) total += len;
  if (total > kMaxThreadgroupMemory)
    die("threadgroup-limit", "threadgroup memory reaches %zu bytes with '%s' (limit 32 KiB)", total, name);
  if (off + size + kRedzone > g_arena_cap) die("harness", "threadgroup arena too small");
  g_tg_vars.push_back(TgVar{key, off, size, name});
  if (off + size + kRedzone > g_arena_high) {
    // First use of these bytes: bring them to the fresh-threadgroup state.
    std::memset(g_arena + g_arena_high, 0xff, off + size + kRedzone - g_arena_high);
    for (size_t b = g_arena_high; b < off + size + kRedzone; ++b) {
      g_tg_written[b] = 0;
      g_tg_shadow[b] = TgShadow{0, -1, -1, 0, 0, -1, 0, 1};
    }
    g_arena_high = off + size + kRedzone;
  }
  for (size_t b = off; b < off + size; ++b) g_tg_shadow[b].redzone = 0;
  g_arena_used = off + size + kRedzone;
  return g_arena + off;
}

void* bound_pointer(int kind, int index, const char* param) {
  if (kind == 1) {
    auto it = g_tg_param_offset.find(index);
    if (it == g_tg_param_offset.end())
      die("binding", "[[threadgroup(%d)]] parameter '%s' has no length set", index, param);
    return g_arena + it->second;
  }
  auto it = g_dispatch->buffers.find(index);
  if (it == g_dispatch->buffers.end()) die("binding", "[[buffer(%d)]] parameter '%s' is not bound", index, param);
  Buffer& b = *g_buffers[it->second.buffer];
  if (it->second.offset > b.size) die("binding", "offset beyond buffer '%s'", b.name.c_str());
  return b.data + it->second.offset;
}

bool function_constant(int index, void* out, size_t size) {
  auto it = g_dispatch->constants.find(index);
  if (it == g_dispatch->constants.end()) return false;
  if (it->second.size() != size) die("binding", "function constant %d has %zu bytes, kernel wants %zu",
                                     index, it->second.size(), size);
  std::memcpy(out, it->second.data(), size);
  return true;
}

void fail(const char* kind, const char* message) { die(kind, "%s", message); }

void declare_threadgroup_variable(const char* function, TgDecl decl, size_t size, size_t align) {
  static_tg_vars().push_back(StaticTgVar{pretty_argument(function), decl, size, align});
}

}  // namespace msl::rt

// ------------------------------------------------------------------------------------------
// Memory-access hooks called by the instrumented kernel code
// ------------------------------------------------------------------------------------------
extern "C" {
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
#define MSL_HOOK(n)                                                                            \
  void __tsan_read##n(void* p) { on_access(p, n, false, __builtin_return_address(0)); }           \
  void __tsan_write##n(void* p) { on_access(p, n, true, __builtin_return_address(0)); }           \
  void __tsan_unaligned_read##n(void* p) { on_access(p, n, false, __builtin_return_address(0)); } \
  void __tsan_unaligned_write##n(void* p) { on_access(p, n, true, __builtin_return_address(0)); } \
  void __tsan_volatile_read##n(void* p) { on_access(p, n, false, __builtin_return_address(0)); }  \
  void __tsan_volatile_write##n(void* p) { on_access(p, n, true, __builtin_return_address(0)); }
MSL_HOOK(1)
MSL_HOOK(2)
MSL_HOOK(4)
MSL_HOOK(8)
MSL_HOOK(16)
#undef MSL_HOOK
void __tsan_read_range(void* p, unsigned long n) { on_access(p, n, false, __builtin_return_address(0)); }
void __tsan_write_range(void* p, unsigned long n) { on_access(p, n, true, __builtin_return_address(0)); }
}

int main(int argc, char** argv) {
  if (argc == 2 && strcmp(argv[1], "--describe") == 0) return describe();
  if (argc != 2) {
    fprintf(stderr, "usage: %s PLAN\n", argv[0]);
    return 2;
  }
  static char altstack[64 << 10];
  stack_t ss{};
  ss.ss_sp = altstack;
  ss.ss_size = sizeof altstack;
  sigaltstack(&ss, nullptr);
  struct sigaction sa{};
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
  sigaction(SIGFPE, &sa, nullptr);
  char* region;
  size_t region_size;
  g_arena_cap = 64 << 10;
  g_arena = map_guarded(g_arena_cap, &region, &region_size);
  g_tg_shadow.resize(g_arena_cap);
  g_tg_written.resize(g_arena_cap);
  return main_impl(argv[1]);
}
