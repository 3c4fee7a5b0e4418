// The optimizers' row math, one struct per optimizer the native backend runs.
//
// Each mirrors the `update_rows` of its Python class operation for operation
// (pallas_emb/optimizers/), in float32 with every operation rounded once:
// the library is built with -ffp-contract=off and without fast-math, so the
// results do not depend on the instruction set. They are not bitwise XLA's:
// XLA:CPU reduces a row mean in its own order and contracts a * b + c into
// fused multiply-adds on FMA hosts; see pallas_emb/kernels/native.py for the
// tolerance the tests hold them to.
//
// A rule is built from the call's scalars (float32 array; [0] is the learning
// rate, possibly scheduled, the rest static hyperparameters) and updates one
// row in place: Apply(row, slot, g, sum_sq, d), where g is the row's summed
// gradient and sum_sq = SumSquares(g, d).

#ifndef PALLAS_EMB_CSRC_ROW_RULES_H_
#define PALLAS_EMB_CSRC_ROW_RULES_H_

#include <cmath>
#include <cstdint>

namespace pallas_emb {

// Lanes of the sum of squares. A fixed lane assignment (column j adds into
// lane j % kLanes, lanes combined by a fixed tree) vectorizes without
// reassociating anything, so every instruction set gives the same bits.
constexpr int kLanes = 8;

inline float SumSquares(const float* __restrict g, int64_t d) {
  float lane[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + kLanes <= d; j += kLanes)
    for (int k = 0; k < kLanes; ++k) lane[k] += g[j + k] * g[j + k];
  for (int k = 0; j < d; ++j, ++k) lane[k] += g[j] * g[j];
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int k = 0; k < w; ++k) lane[k] += lane[k + w];
  return lane[0];
}

// The sum of squares in double, in column order: for the global norm of a
// row whose float32 sum overflowed (no float32 square of a finite float32
// overflows a double).
inline double SumSquaresWide(const float* __restrict g, int64_t d) {
  double s = 0.0;
  for (int64_t j = 0; j < d; ++j) s += double(g[j]) * double(g[j]);
  return s;
}

// SGD: row += g * (-lr).
struct Sgd {
  static constexpr int kSlotWidth = 0;  // no slot
  static constexpr int kNumScalars = 1;
  float neg_lr;
  explicit Sgd(const float* s) : neg_lr(-s[0]) {}
  void Apply(float* __restrict row, float* /*slot*/, const float* __restrict g,
             float /*sum_sq*/, int64_t d) const {
    for (int64_t j = 0; j < d; ++j) row[j] = row[j] + g[j] * neg_lr;
  }
};

// Adagrad (optax's formula): acc += g * g;
// row += (g * (acc > 0 ? 1 / sqrt(acc + eps) : 0)) * (-lr).
struct Adagrad {
  static constexpr int kSlotWidth = -1;  // one accumulator per column
  static constexpr int kNumScalars = 2;
  float neg_lr, eps;
  explicit Adagrad(const float* s) : neg_lr(-s[0]), eps(s[1]) {}
  void Apply(float* __restrict row, float* __restrict acc,
             const float* __restrict g, float /*sum_sq*/, int64_t d) const {
    for (int64_t j = 0; j < d; ++j) {
      const float a = acc[j] + g[j] * g[j];
      acc[j] = a;
      const float scale = a > 0.0f ? 1.0f / std::sqrt(a + eps) : 0.0f;
      row[j] = row[j] + (g[j] * scale) * neg_lr;
    }
  }
};

// Row-wise Adagrad, decayed once per touch (not lazily):
// acc = acc * decay + mean(g * g); row -= lr * (g / (sqrt(acc) + eps) + wd * row).
// The division is a multiplication by 1 / (sqrt(acc) + eps), as XLA's
// simplifier rewrites it.
struct RowwiseAdagrad {
  static constexpr int kSlotWidth = 1;  // one accumulator per row
  static constexpr int kNumScalars = 4;
  float lr, eps, decay, weight_decay;
  explicit RowwiseAdagrad(const float* s)
      : lr(s[0]), eps(s[1]), decay(s[2]), weight_decay(s[3]) {}
  void Apply(float* __restrict row, float* __restrict acc,
             const float* __restrict g, float sum_sq, int64_t d) const {
    float a = acc[0];
    if (decay != 1.0f) a = a * decay;
    a = a + sum_sq / float(d);
    acc[0] = a;
    const float inv = 1.0f / (std::sqrt(a) + eps);
    if (weight_decay != 0.0f) {
      for (int64_t j = 0; j < d; ++j)
        row[j] = row[j] - lr * (g[j] * inv + weight_decay * row[j]);
    } else {
      for (int64_t j = 0; j < d; ++j) row[j] = row[j] - lr * (g[j] * inv);
    }
  }
};

}  // namespace pallas_emb

#endif  // PALLAS_EMB_CSRC_ROW_RULES_H_
