// Per-thread scratch of the FFI handlers, reused across calls: no allocation
// or page fault per step once the largest batch has been seen.

#ifndef PALLAS_EMB_CSRC_THREAD_SCRATCH_H_
#define PALLAS_EMB_CSRC_THREAD_SCRATCH_H_

namespace pallas_emb {

// The calling thread's T. Reached through a call the optimizer cannot see
// into: code that knows it holds a thread_local may recompute its address at
// each use, which in a shared library (libpe_cpu.so) is a call to
// __tls_get_addr. Through a thread_local used directly, the id map's steps
// ran 1.5x slower in the library than in a static build of the same code.
template <class T>
__attribute__((noinline)) T& ThreadScratch() {
  static thread_local T scratch;
  return scratch;
}

}  // namespace pallas_emb

#endif  // PALLAS_EMB_CSRC_THREAD_SCRATCH_H_
