// A stand-alone driver of the native id map, for timings and instruction
// counts without Python or XLA (not part of the library): a one-shard
// table's translation (PeIdMapTranslate1's work: PlanKeys, StepMap, each
// token's slot) replayed over a stream of key words from an empty map.
//
//   cmake --build build --target pe_map_bench
//   build/pe_map_bench KEYS_FILE STEPS [REPS]
//   valgrind --tool=cachegrind --branch-sim=yes build/pe_map_bench KEYS_FILE STEPS 1
//
// KEYS_FILE holds STEPS batches of uint32 (hi, lo) key words, the drift
// benchmark's stream (400 steps of 4,096 ids: `python -c "import pallas_emb
// as pe; from pallas_emb.bench import drift; raw, _, _ = drift.stream(400,
// 4096, 32768, 327); pe.vocab_keys(raw, pe.DynamicVocabulary()).tofile('drift.keys')"`).
// The map is the benchmark's dynamic table: 16,384 slots, LFU, probe limit
// 16, a sweep every 4 steps (counts halved, ids idle for 16 steps evicted),
// no admission threshold. It replays the stream REPS times and prints the
// minimum and median microseconds of the plan, the owner step and the whole
// translation over the second half of the steps (the map full), and a
// checksum of every output, which two builds of the map must share.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "id_map_core.h"
#include "profile.h"

namespace pe = pallas_emb;

namespace {

constexpr int64_t kCapacity = 16384;
constexpr uint32_t kPad = 0xFFFFFFFFu;

// FNV-1a over the bytes of every output.
struct Checksum {
  uint64_t h = 1469598103934665603ull;
  template <class T>
  void Add(const std::vector<T>& v) {
    const auto* b = reinterpret_cast<const unsigned char*>(v.data());
    for (size_t i = 0; i < v.size() * sizeof(T); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
};

struct Timings {
  std::vector<double> plan, step, total;
};

// One replay from an empty map; adds the second half's timings.
uint64_t Replay(const std::vector<uint32_t>& words, int64_t steps, int64_t tokens, Timings& t) {
  std::vector<uint32_t> key_hi(kCapacity, 0), key_lo(kCapacity, 0);
  std::vector<float> count(kCapacity, 0.0f);
  std::vector<int32_t> last(kCapacity, -1);
  int32_t sketch = 0, step = 0;
  const std::vector<char> usable(kCapacity, 1);
  std::vector<uint32_t> hi(tokens), lo(tokens), send_hi(tokens), send_lo(tokens);
  std::vector<char> valid(tokens);
  std::vector<int32_t> sent(tokens), send_count(tokens), slot(tokens), slot_uid(tokens);
  std::vector<int32_t> reset(tokens), stats(4), token_slot(tokens);
  const pe::MapArrays map{key_hi.data(), key_lo.data(), count.data(), last.data(),
                          &sketch,       kCapacity,     0,            1};
  const pe::StepPolicy policy{/*probe_limit=*/16, /*admit_after=*/1, /*policy: lfu*/ 0,
                              /*evict_on_insert=*/true, /*evict_every=*/4, /*decay=*/0.5f,
                              /*ttl=*/16, /*train=*/true};
  Checksum sum;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t i = 0; i < tokens; ++i) {
      hi[i] = words[2 * (s * tokens + i)];
      lo[i] = words[2 * (s * tokens + i) + 1];
      valid[i] = !(hi[i] == kPad && lo[i] == kPad);
    }
    const double a = 1e-3 * double(pe::NowNanos());
    pe::PlanKeys(hi.data(), lo.data(), reinterpret_cast<const bool*>(valid.data()), tokens, 1,
                 tokens, sent.data(), send_hi.data(), send_lo.data(), send_count.data());
    const double b = 1e-3 * double(pe::NowNanos());
    step = pe::StepMap(map, step, send_hi.data(), send_lo.data(), send_count.data(), tokens,
                       reinterpret_cast<const bool*>(usable.data()), policy, slot.data(),
                       slot_uid.data(), reset.data(), stats.data());
    const double c = 1e-3 * double(pe::NowNanos());
    pe::AnswerTokens(sent.data(), slot_uid.data(), slot.data(), tokens, token_slot.data());
    const double d = 1e-3 * double(pe::NowNanos());
    if (s >= steps / 2) {
      t.plan.push_back(b - a);
      t.step.push_back(c - b);
      t.total.push_back(d - a);
    }
    sum.Add(token_slot);
    sum.Add(reset);
    sum.Add(stats);
  }
  sum.Add(key_hi);
  sum.Add(key_lo);
  sum.Add(count);
  sum.Add(last);
  return sum.h;
}

void Print(const char* what, std::vector<double> v) {
  std::sort(v.begin(), v.end());
  std::printf("%s %.1f us min, %.1f us median; ", what, v.front(), v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s KEYS_FILE STEPS [REPS]\n", argv[0]);
    return 2;
  }
  const int64_t steps = std::atoll(argv[2]);
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  std::ifstream in(argv[1], std::ios::binary | std::ios::ate);
  const int64_t bytes = in ? int64_t(in.tellg()) : 0;
  if (steps < 2 || reps < 1 || bytes == 0 || bytes % (steps * 8) != 0) {
    std::fprintf(stderr, "%s: want STEPS >= 2 batches of (hi, lo) uint32 words, REPS >= 1\n",
                 argv[1]);
    return 2;
  }
  const int64_t tokens = bytes / (steps * 8);
  std::vector<uint32_t> words(bytes / 4);
  in.seekg(0);
  in.read(reinterpret_cast<char*>(words.data()), bytes);
  Timings t;
  uint64_t checksum = 0;
  for (int r = 0; r < reps; ++r) checksum = Replay(words, steps, tokens, t);
  std::printf("%lld steps of %lld tokens, %d replays: ", static_cast<long long>(steps),
              static_cast<long long>(tokens), reps);
  Print("plan", t.plan);
  Print("owner step", t.step);
  Print("translation", t.total);
  std::printf("checksum %016llx\n", static_cast<unsigned long long>(checksum));
  return 0;
}
