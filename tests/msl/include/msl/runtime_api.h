// Interface between the MSL stand-in headers (compiled into the kernel translation unit) and the
// grid runner (tests/msl/runtime/runner.cpp): thread positions, collectives, threadgroup memory.
#pragma once

#include <cstddef>
#include <cstdint>

namespace msl::rt {

// Where a collective or barrier was called from (kernel source position), used to check that every
// participating thread reached the same call.
struct Site {
  const char* file;
  unsigned line;
  unsigned column;
};

enum class Pos : int {
  thread_position_in_grid,
  thread_position_in_threadgroup,
  threadgroup_position_in_grid,
  threads_per_threadgroup,
  threadgroups_per_grid,
  threads_per_grid,
  thread_index_in_threadgroup,
  thread_index_in_simdgroup,
  simdgroup_index_in_threadgroup,
  simdgroups_per_threadgroup,
  threads_per_simdgroup,
  thread_execution_width,
  dispatch_threads_per_threadgroup,
  quadgroup_index_in_threadgroup,
  thread_index_in_quadgroup,
  quadgroups_per_threadgroup,
  grid_origin,
};

// Value of a position attribute for the calling thread (x, y, z; scalars use x).
void position(Pos which, uint32_t out[3]);

// Result of a simdgroup exchange: every lane's deposited bytes and the mask of lanes that took part.
struct Exchange {
  const unsigned char* values;  // 32 slots of `stride` bytes
  size_t stride;
  uint32_t active_mask;
  unsigned lane;
};

// Deposit `size` bytes for the calling lane and wait until every live lane of the simdgroup has
// reached the same call. `kind` names the operation (for error messages and matching).
Exchange simd_exchange(const char* kind, const void* value, size_t size, Site site);

// threadgroup_barrier / simdgroup_barrier. flags: bit0 device, bit1 threadgroup, bit2 texture.
void threadgroup_barrier(unsigned flags, Site site);
void simdgroup_barrier(unsigned flags, Site site);

// Storage of an in-body `threadgroup T name[...]` declaration: the same address for every thread of
// the running threadgroup, carved from the threadgroup arena. `key` identifies the declaration.
void* threadgroup_variable(unsigned key, size_t size, size_t align, const char* name);

// A `threadgroup T name[...]` declaration as the source mapping spells it.
struct TgDecl {
  const char* name;
  const char* file;
  unsigned line;
};

// Called at program start for every threadgroup declaration of every instantiated function, executed
// or not: `function` is the declaring function as msl::where_name spells it (static accounting of
// each kernel instance's threadgroup memory).
void declare_threadgroup_variable(const char* function, TgDecl decl, size_t size, size_t align);

// Pointer bound to a kernel parameter: [[buffer(n)]] (kind 0) or [[threadgroup(n)]] (kind 1).
void* bound_pointer(int kind, int index, const char* param);

// Value of function constant `index` (size bytes copied into out); returns false if not set.
bool function_constant(int index, void* out, size_t size);

[[noreturn]] void fail(const char* kind, const char* message);

}  // namespace msl::rt
