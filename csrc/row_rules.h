// The optimizers' row math, one struct per optimizer the native backend runs.
//
// Each mirrors the `update_rows` of its Python class operation for operation
// (pallas_emb/optimizers/), in float32 with every operation rounded once:
// the library is built with -ffp-contract=off and without fast-math, so the
// results do not depend on the instruction set (the kernels are compiled
// for several; see sparse_update.h). They are not bitwise XLA's: XLA:CPU
// reduces a row mean in its own order and contracts a * b + c into fused
// multiply-adds on FMA hosts; see pallas_emb/kernels/native.py for the
// tolerance the tests hold them to.
//
// A rule is built from the call's scalars (float32 array: the fields of the
// optimizer's `scalars(step)`, then its static hyperparameters, as
// native.py's `_scalars` lays them out) and updates one row in place:
//
//   Apply(row, slot, g, sum_sq, per_row, d)
//
// row: the row's d floats; slot[s]: the row's part of slot s (kSlotWidth[s]
// elements, -1 meaning d; int32 where kSlotIsInt[s], else float32); g: the
// row's summed gradient; sum_sq = SumSquares(g, d); per_row: kPerRow float32
// values of this row that XLA computed from its slots with the optimizer's
// own functions (transcendental functions, whose XLA:CPU approximations C++
// would not reproduce: LazyAdam's bias corrections, the lazy decay).

#ifndef PALLAS_EMB_CSRC_ROW_RULES_H_
#define PALLAS_EMB_CSRC_ROW_RULES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#define PE_INLINE inline __attribute__((always_inline))

namespace pallas_emb {

constexpr int kMaxSlots = 3;

// Lanes of the sum of squares. A fixed lane assignment (column j adds into
// lane j % kLanes, lanes combined by a fixed tree) vectorizes without
// reassociating anything, so every instruction set gives the same bits.
constexpr int kLanes = 8;

PE_INLINE float SumSquares(const float* __restrict g, int64_t d) {
  float lane[kLanes] = {};
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

inline float* AsF32(char* p) { return reinterpret_cast<float*>(p); }
inline int32_t* AsI32(char* p) { return reinterpret_cast<int32_t*>(p); }

// SGD: row += g * (-lr).
struct Sgd {
  static constexpr int kNumSlots = 0;
  static constexpr int kSlotWidth[1] = {0};
  static constexpr bool kSlotIsInt[1] = {false};
  static constexpr int kNumScalars = 1;
  static constexpr int kPerRow = 0;
  float neg_lr;
  explicit Sgd(const float* s) : neg_lr(-s[0]) {}
  PE_INLINE void Apply(float* __restrict row, char* const* /*slot*/,
                       const float* __restrict g, float /*sum_sq*/,
                       const float* /*per_row*/, int64_t d) const {
    for (int64_t j = 0; j < d; ++j) row[j] = row[j] + g[j] * neg_lr;
  }
};

// Adagrad (optax's formula): acc += g * g;
// row += (g * (acc > 0 ? 1 / sqrt(acc + eps) : 0)) * (-lr).
struct Adagrad {
  static constexpr int kNumSlots = 1;
  static constexpr int kSlotWidth[1] = {-1};  // one accumulator per column
  static constexpr bool kSlotIsInt[1] = {false};
  static constexpr int kNumScalars = 2;
  static constexpr int kPerRow = 0;
  float neg_lr, eps;
  explicit Adagrad(const float* s) : neg_lr(-s[0]), eps(s[1]) {}
  PE_INLINE void Apply(float* __restrict row, char* const* slot,
                       const float* __restrict g, float /*sum_sq*/,
                       const float* /*per_row*/, int64_t d) const {
    float* __restrict acc = AsF32(slot[0]);
    for (int64_t j = 0; j < d; ++j) {
      const float a = acc[j] + g[j] * g[j];
      acc[j] = a;
      const float inv = 1.0f / std::sqrt(a + eps);  // both sides, as jnp.where
      const float scale = a > 0.0f ? inv : 0.0f;
      row[j] = row[j] + (g[j] * scale) * neg_lr;
    }
  }
};

// Row-wise Adagrad:
// acc = acc * decay + mean(g * g); row -= lr * (g / (sqrt(acc) + eps) + wd * row).
// Scalars: lr, step, eps, decay, weight_decay. Decayed once per touch, or,
// with kLazy, by decay ** (step - last_step), which XLA computes (per_row[0])
// and the rule multiplies in, and last_step = step. The division is a
// multiplication by 1 / (sqrt(acc) + eps), as XLA's simplifier rewrites it.
template <bool kLazy>
struct RowwiseAdagradRule {
  static constexpr int kNumSlots = kLazy ? 2 : 1;
  static constexpr int kSlotWidth[2] = {1, 1};  // acc, last_step
  static constexpr bool kSlotIsInt[2] = {false, true};
  static constexpr int kNumScalars = 5;
  static constexpr int kPerRow = kLazy ? 1 : 0;
  float lr, eps, decay, weight_decay;
  int32_t step;
  explicit RowwiseAdagradRule(const float* s)
      : lr(s[0]), eps(s[2]), decay(s[3]), weight_decay(s[4]),
        step(int32_t(s[1])) {}
  PE_INLINE void Apply(float* __restrict row, char* const* slot,
                       const float* __restrict g, float sum_sq,
                       const float* per_row, int64_t d) const {
    float a = AsF32(slot[0])[0];
    if (decay != 1.0f) a = a * (kLazy ? per_row[0] : decay);
    if (kLazy) AsI32(slot[1])[0] = step;
    a = a + sum_sq / float(d);
    AsF32(slot[0])[0] = a;
    const float inv = 1.0f / (std::sqrt(a) + eps);
    if (weight_decay != 0.0f) {
      for (int64_t j = 0; j < d; ++j)
        row[j] = row[j] - lr * (g[j] * inv + weight_decay * row[j]);
    } else {
      for (int64_t j = 0; j < d; ++j) row[j] = row[j] - lr * (g[j] * inv);
    }
  }
};
using RowwiseAdagrad = RowwiseAdagradRule<false>;
using RowwiseAdagradLazy = RowwiseAdagradRule<true>;

// LazyAdam, per row with count t (after += 1):
// m = b1 * m + (1 - b1) * g; v = b2 * v + (1 - b2) * (g * g);
// row -= lr * ((m / bc1) / (sqrt(v / bc2) + eps)),
// with the bias corrections bc1 = 1 - b1 ** t, bc2 = 1 - b2 ** t from XLA
// (per_row[0], per_row[1]). Scalars: lr, b1, b2, eps.
struct LazyAdam {
  static constexpr int kNumSlots = 3;
  static constexpr int kSlotWidth[3] = {-1, -1, 1};  // m, v, count
  static constexpr bool kSlotIsInt[3] = {false, false, true};
  static constexpr int kNumScalars = 4;
  static constexpr int kPerRow = 2;
  float lr, b1, b2, eps, c1, c2;
  explicit LazyAdam(const float* s)
      : lr(s[0]), b1(s[1]), b2(s[2]), eps(s[3]), c1(1.0f - s[1]),
        c2(1.0f - s[2]) {}
  PE_INLINE void Apply(float* __restrict row, char* const* slot,
                       const float* __restrict g, float /*sum_sq*/,
                       const float* per_row, int64_t d) const {
    float* __restrict m = AsF32(slot[0]);
    float* __restrict v = AsF32(slot[1]);
    AsI32(slot[2])[0] += 1;
    const float bc1 = per_row[0], bc2 = per_row[1];
    for (int64_t j = 0; j < d; ++j) {
      const float mj = b1 * m[j] + c1 * g[j];
      const float vj = b2 * v[j] + c2 * (g[j] * g[j]);
      m[j] = mj;
      v[j] = vj;
      row[j] = row[j] - lr * ((mj / bc1) / (std::sqrt(vj / bc2) + eps));
    }
  }
};

// FTRL-Proximal (pallas_emb/optimizers/ftrl.py), for learning_rate_power
// -0.5 (n ** 0.5 = sqrt(n), exact) or 0 (n ** 0 = 1); other powers need
// XLA's exp and log and run the XLA path. Scalars: lr, power, l1, l2, beta,
// multiply_linear_by_learning_rate (0 or 1).
struct Ftrl {
  static constexpr int kNumSlots = 2;
  static constexpr int kSlotWidth[2] = {-1, -1};  // accumulator, linear
  static constexpr bool kSlotIsInt[2] = {false, false};
  static constexpr int kNumScalars = 6;
  static constexpr int kPerRow = 0;
  float lr, l1, l2, beta;
  bool sqrt_power, multiply;
  explicit Ftrl(const float* s)
      : lr(s[0]), l1(s[2]), l2(s[3]), beta(s[4]), sqrt_power(s[1] != 0.0f),
        multiply(s[5] != 0.0f) {}
  PE_INLINE void Apply(float* __restrict row, char* const* slot,
                       const float* __restrict g, float /*sum_sq*/,
                       const float* /*per_row*/, int64_t d) const {
    // One loop per case, each without branches, so that each vectorizes.
    if (multiply) {
      if (sqrt_power) return Loop<true, true>(row, slot, g, d);
      return Loop<false, true>(row, slot, g, d);
    }
    if (lr <= 0.0f) return;  // a schedule's lr == 0: the step is skipped
    if (sqrt_power) return Loop<true, false>(row, slot, g, d);
    Loop<false, false>(row, slot, g, d);
  }

 private:
  template <bool kSqrt>
  static PE_INLINE float Power(float n) { return kSqrt ? std::sqrt(n) : 1.0f; }

  template <bool kSqrt, bool kMultiply>
  PE_INLINE void Loop(float* __restrict row, char* const* slot,
                      const float* __restrict g, int64_t d) const {
    float* __restrict acc = AsF32(slot[0]);
    float* __restrict lin = AsF32(slot[1]);
    const float lr = this->lr, beta = this->beta;  // locals: no aliasing questions
    const float lim = kMultiply ? lr * l1 : l1;
    const float quad_add = kMultiply ? (2.0f * lr) * l2 : 2.0f * l2;
    for (int64_t j = 0; j < d; ++j) {
      const float w = row[j], n = acc[j], n2 = n + g[j] * g[j];
      const float p2 = Power<kSqrt>(n2), dp = p2 - Power<kSqrt>(n);
      const float z2 = kMultiply ? (lin[j] + lr * g[j]) - dp * w
                                 : (lin[j] + g[j]) - (dp / lr) * w;
      const float quad = kMultiply ? (p2 + beta) + quad_add : (p2 + beta) / lr + quad_add;
      const float lo = z2 < -lim ? -lim : z2;  // clip(z2, -lim, lim)
      const float w2 = ((lo > lim ? lim : lo) - z2) / quad;
      acc[j] = n2;
      lin[j] = z2;
      // quad == 0 (n' == 0 with l2 == beta == 0: no gradient yet): keep w.
      row[j] = quad > 0.0f ? w2 : w;
    }
  }
};

}  // namespace pallas_emb

#endif  // PALLAS_EMB_CSRC_ROW_RULES_H_
