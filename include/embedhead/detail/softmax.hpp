// embedhead internal: the softmax cross-entropy's arithmetic, written once for every loss -- the
// plain loss (cross_entropy.hpp), the fused head loss (fused_head_loss.hpp, also over a vocabulary
// shard) and the vocabulary-parallel loss (parallel/vocab_parallel_cross_entropy.hpp). No API promise.
//
// One row: logits z over the classes j < C (C = valid_vocab, else V), target y, the options eps
// (label smoothing, PyTorch's), z_loss (PaLM's) and softcap c (Gemma 2's), and the row's gradient
// weight w (token weight x the reduction's scale x gradient_scale):
//   s_j   = c tanh(z_j / c) if c > 0, else z_j                          softcap_row
//   m     = max_j s_j                                                   row_max
//   S     = sum_j exp(s_j - m)   (each exp in Scalar, summed in double)  SoftmaxRowStats
//   lse   = m + log S                                                   row_loss
//   ce    = lse - (1 - eps) s_y - (eps / C) sum_j s_j                   row_loss
//         = (m - s_y) + log S  (eps = 0: the form computed, no cancellation)
//   zl    = z_loss lse^2                                                row_loss
//   dz_j  = w (a p_j - eps / C - (1 - eps) [j = y]) (1 - (s_j / c)^2 if c > 0)
//           a = 1 + 2 z_loss lse,  p_j = softmax(s)_j = exp(s_j - lse) = exp(s_j - m) / S
//                                                                       apply_softmax_gradient
//   E     = sum_j exp(s_j - m) (s_j - m)                                SoftmaxRowStats (entropy)
//   H     = -sum_j p_j log p_j = log S - E / S                          row_entropy
//   eb    = -beta H                                                     row_loss (entropy bonus beta)
//   dz_j += w beta p_j (s_j - lse + H)   (= -w beta dH/ds_j; times the softcap factor as above)
// The row's loss is ce + zl + eb; the callers weight it and reduce over the rows.
//
// Class weights u_j (PyTorch's `weight=`; u_j = 1 without them), U = sum_j u_j over the classes:
//   ce    = (1 - eps) u_y (lse - s_y) + (eps / C) sum_j u_j (lse - s_j)    row_loss
//         = log S ((1 - eps) u_y + eps U / C) + (1 - eps) u_y (m - s_y) + (eps / C) (U m - sum_j u_j s_j)
//   zl    = u_y z_loss lse^2,   eb = -u_y beta H   (the row's other terms count as its target does)
//   dz_j  = w (a p_j - (eps / C) u_j - (1 - eps) u_y [j = y] + u_y beta p_j (s_j - lse + H)) (softcap factor)
//           a = (1 - eps) u_y + eps U / C + 2 u_y z_loss lse
// and the callers count the row with weight u_y (the mean divides by the sum of the targets' u_y,
// as PyTorch does; label smoothing's term included). The statistic sum_j s_j becomes sum_j u_j s_j.
// (the entropy from statistics shifted by m, so nothing cancels however large the logits; a class
// of probability 0, s_j = -inf, adds 0, not 0 * -inf).
//
// Soft (probability) targets t [C] (PyTorch's probability targets, label smoothing and class
// weights included), the row's target weights v_c = u_c t'_c with t' = (1 - eps) t + eps / C, and
// their mass T = sum_c v_c (both set per row by the caller: SoftmaxTerms::soft_targets, soft_mass):
//   ce    = -sum_c v_c log p_c = T lse - sum_c v_c s_c
//         = T log S + (T m - sum_c v_c s_c)                             row_loss
//   zl    = z_loss lse^2,   eb = -beta H   (each row counts once: the mean divides by N)
//   dz_j  = w (a p_j - v_j + beta p_j (s_j - lse + H)) (softcap factor),  a = T + 2 z_loss lse
// The statistic s_y becomes sum_c v_c s_c (summed over blocks and ranks as s_y is), label
// smoothing's sum_j s_j is not needed (it is in v), and the gradient's per-column term b_j = w v_j
// replaces both b u_j and the target's c. A column with v_c = 0 adds 0 to sum_c v_c s_c even
// where s_c = -inf (PyTorch's 0 * log 0 gives NaN there).
//
// The statistics (m, S, s_y, sum_j s_j) of a row split into blocks of columns -- blocks of the
// vocabulary in the fused loss, shards on the ranks -- combine by the online rescale of Milakov &
// Gimelshein (2018):
//   m = max(m1, m2),  S = S1 exp(m1 - m) + S2 exp(m2 - m),  s_y = s_y1 + s_y2,  sum s = sum1 + sum2,
//   E = (E1 + (m1 - m) S1) exp(m1 - m) + (E2 + (m2 - m) S2) exp(m2 - m)
// (the block without the target adds s_y = 0; a block with no column has m = -inf, S = 0).
// SoftmaxRowStats::accumulate applies it block by block, all_reduce_row_max + all_reduce_row_sums
// across ranks. Two orders of work, each kept because the results depend on it:
//   max first  the row's max over all its columns is known before S is summed, so every
//              exponential is exp(s_j - m) and nothing is rescaled: the plain loss (one block,
//              the whole row) and the vocabulary-parallel loss (the max all-reduced first);
//   online     each block of columns is added at the running max, S rescaled when the max grows:
//              the fused loss, its blocks and its shards.
// The gradient likewise comes in two forms of the same formula: from exp(s_j - m) / S (max first:
// the exponentials S was summed from are reused when there is no softcap) and from exp(s_j - lse)
// (the fused loss, whose logits are recomputed block by block).
//
// Elementwise arithmetic (the soft-cap's tanh, every exp, the sum of the logits) runs in blocks of
// kSoftmaxLanes = 16 values evaluated in aligned local arrays, the last block padded (map_lanes,
// load_partial_lanes): each element goes through the same packet code whatever its address and
// its column, so the loss and the gradient are bit-identical wherever the logits and dlogits rows
// lie in memory. (Eigen's own loops over a row peel scalar iterations up to an aligned address,
// and its scalar exp and tanh round differently from the packet ones, by up to 2 ulp; its sum of
// a double row changes order with the alignment.) exp_lanes flushes results below the smallest
// normal number to 0, so exp(-inf) = 0 exactly: Eigen's packet exp clamps its argument and
// returns about 2.9e-39 (float, SSE) or 5.6e-309 (double) there instead.
//
// Non-finite logits (docs/errors.md, "Non-finite values") follow IEEE arithmetic through these
// formulas, which is PyTorch's answer: a NaN or +inf logit among a row's classes makes S, lse,
// the loss and every dz of the row NaN; -inf is a class of probability exp(-inf) = 0 (dz = 0,
// loss +inf if it is the target); a row whose classes are all -inf has S = 0, lse = -inf and a
// NaN loss and dz. The one place that needs care is a running max of -inf (no finite column yet:
// a block or shard of masked classes, or the whole row): exp(s_j - max) would be exp(-inf + inf)
// = NaN, so add_at_max shifts by 0 there instead, and the block adds exp(-inf) = 0 (NaN stays NaN).
//
// A new loss option belongs here: a field of SoftmaxTerms (read in softmax_terms), the statistic
// it needs in SoftmaxRowStats (add_at_max, and the summed parts if ranks must add it), its term in
// row_loss and its coefficient in SoftmaxGradient / apply_softmax_gradient.
#ifndef EMBEDHEAD_DETAIL_SOFTMAX_HPP
#define EMBEDHEAD_DETAIL_SOFTMAX_HPP

#include "../types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace embedhead {
namespace detail {

// The options the row arithmetic reads, and the number of classes C.
struct SoftmaxTerms {
  double label_smoothing = 0;             // eps
  double z_loss = 0;                      // coefficient of lse^2
  double softcap = 0;                     // c > 0: s = c tanh(z / c); 0: off
  double entropy_bonus = 0;               // beta: -beta H added to the loss
  Index classes = 0;                      // C: the columns that are classes
  bool entropy = false;                   // E is summed (entropy outputs, the bonus)
  const double* class_weights = nullptr;  // u [C] by global column; null: all 1
  double class_weight_sum = 0;            // U = sum_j u_j (with class_weights)
  // Soft targets: v [C] by global column (v_c = u_c t'_c, set per row) and T = sum_c v_c; null:
  // the row has a class index as its target.
  const double* soft_targets = nullptr;
  double soft_mass = 0;
  // sum_j s_j (sum_j u_j s_j) is needed: label smoothing with a class-index target.
  bool logit_sums() const { return label_smoothing > 0 && !soft_targets; }
  // u_y, the weight a row with target y counts with (1 without class weights).
  double target_weight(Index y) const { return class_weights ? class_weights[y] : 1.0; }
};

// From any options struct with the CrossEntropyOptions fields.
template <typename Options>
SoftmaxTerms softmax_terms(const Options& options, Index classes) {
  SoftmaxTerms terms;
  terms.label_smoothing = options.label_smoothing;
  terms.z_loss = options.z_loss;
  terms.softcap = options.softcap;
  terms.entropy_bonus = options.entropy_bonus;
  terms.classes = classes;
  terms.entropy = options.entropy || options.entropy_bonus != 0;
  if (!options.class_weights.empty()) {
    terms.class_weights = options.class_weights.data();
    for (const double u : options.class_weights) terms.class_weight_sum += u;
  }
  return terms;
}

// The elementwise kernels' block: 16 values, a multiple of every packet width (4 to 16 floats, 2
// to 8 doubles), held in an aligned local array so that Eigen evaluates it without peeling.
constexpr Index kSoftmaxLanes = 16;
// Blocks a lane sums in Scalar before its sum is added in double (sum_exp_shifted).
constexpr Index kSoftmaxRun = 16;
template <typename Scalar>
using SoftmaxLanes = Eigen::Array<Scalar, kSoftmaxLanes, 1>;

// The count values at p (count < kSoftmaxLanes: a row's last, partial block) as one block, the
// rest of it set to pad.
template <typename Scalar>
SoftmaxLanes<Scalar> load_partial_lanes(const Scalar* p, Index count, Scalar pad) {
  SoftmaxLanes<Scalar> x = SoftmaxLanes<Scalar>::Constant(pad);
  std::copy_n(p, count, x.data());
  return x;
}

// out[j] = f(x)[j] for j < width, with f an elementwise function of a block returning a block (by
// value, evaluated). Full blocks are loaded straight from in, the last partial one copied into a
// padded block (with 0) and given to the same f, so every element takes the same arithmetic
// whatever its address and column. out may be in.
template <typename Scalar, typename F>
void map_lanes(const Scalar* in, Scalar* out, Index width, const F& f) {
  using Lanes = SoftmaxLanes<Scalar>;
  Index j = 0;
  for (; j + kSoftmaxLanes <= width; j += kSoftmaxLanes) {
    const Lanes y = f(Lanes(Eigen::Map<const Lanes>(in + j)));
    Eigen::Map<Lanes> block(out + j);
    block = y;
  }
  if (j == width) return;
  const Lanes y = f(load_partial_lanes(in + j, width - j, Scalar(0)));
  std::copy_n(y.data(), width - j, out + j);
}

// map_lanes with the block's first column j and its count of values (kSoftmaxLanes but in the
// last, partial block) passed too: out[j .. j + count) = f(x, j, count).
template <typename Scalar, typename F>
void map_lanes_at(const Scalar* in, Scalar* out, Index width, const F& f) {
  using Lanes = SoftmaxLanes<Scalar>;
  Index j = 0;
  for (; j + kSoftmaxLanes <= width; j += kSoftmaxLanes) {
    const Lanes y = f(Lanes(Eigen::Map<const Lanes>(in + j)), j, kSoftmaxLanes);
    Eigen::Map<Lanes> block(out + j);
    block = y;
  }
  if (j == width) return;
  const Lanes y = f(load_partial_lanes(in + j, width - j, Scalar(0)), j, width - j);
  std::copy_n(y.data(), width - j, out + j);
}

// exp(x) of a block of arguments x <= 0 (or NaN), 0 where x is below ln(smallest normal number):
// exp(-inf) = 0 exactly, as std::exp gives and the sums and gradients of masked classes need.
// Written on Eigen's packets (pexp is what Array::exp() runs): the compare and mask stay in
// registers, where a select on the array (not vectorised) cost a third of the exp's time.
template <typename Scalar>
SoftmaxLanes<Scalar> exp_lanes(const SoftmaxLanes<Scalar>& x) {
  namespace ei = Eigen::internal;
  using Packet = typename ei::packet_traits<Scalar>::type;
  constexpr Index packet = ei::packet_traits<Scalar>::size;
  static_assert(kSoftmaxLanes % packet == 0, "a block is a whole number of packets");
  const Packet lowest = ei::pset1<Packet>(Scalar(std::numeric_limits<Scalar>::min_exponent - 1) *
                                          Scalar(0.693147180559945309417));
  SoftmaxLanes<Scalar> e;
  for (Index i = 0; i < kSoftmaxLanes; i += packet) {
    const Packet p = ei::ploadu<Packet>(x.data() + i);
    ei::pstoreu(e.data() + i, ei::pandnot(ei::pexp(p), ei::pcmp_lt(p, lowest)));
  }
  return e;
}

// out [width] = c tanh(z / c) of z [width] (out may be z).
template <typename Scalar>
void softcap_row(const Scalar* z, Scalar* out, Index width, Scalar c) {
  map_lanes(z, out, width, [c](const SoftmaxLanes<Scalar>& x) -> SoftmaxLanes<Scalar> { return (x / c).tanh() * c; });
}

// max_j s_j over s [width], width >= 1.
template <typename Scalar>
Scalar row_max(const Scalar* s, Index width) {
  return Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(s, width).maxCoeff();
}

// s [width] -> sum_j exp(s_j - m), also writing exp(s_j - m) to out[j] when out is not null (out
// may be s). Each exponential is computed in Scalar and summed in 16 running lanes (the last block
// padded with -inf, which adds 0): in Scalar over runs of kSoftmaxRun blocks (256 values), each
// run's lanes then added to double lanes, and a fixed tree over those at the end. The order depends
// only on width, not on the row's alignment nor on whether out is written, so the loss is
// bit-identical with or without the gradient and wherever the logits live in memory. A lane adds at
// most 16 terms in Scalar before its sum goes to double, so S stays within about 1e-7 relative at
// any V (a float sum of 16,000 terms a lane, V = 256,000, drifted by 3e-4 relative on equal terms:
// what large vocabularies lose without upcast accumulators), at the cost of one conversion per 256
// values instead of one per value.
//
// With entropy_sum not null, *entropy_sum = sum_j exp(s_j - m) (s_j - m) (the terms where the
// exponential is 0 add 0), each product in Scalar, summed the same way; the sum of exponentials is
// the same bits either way.
template <bool kEntropy, typename Scalar>
double sum_exp_shifted_impl(const Scalar* s, Index width, Scalar m, Scalar* out, double* entropy_sum) {
  using Lanes = SoftmaxLanes<Scalar>;
  using Wide = SoftmaxLanes<double>;
  Wide acc = Wide::Zero(), weighted = Wide::Zero();
  Lanes part = Lanes::Zero(), part_weighted = Lanes::Zero();  // the current run's sums, in Scalar
  const Scalar lowest = std::numeric_limits<Scalar>::lowest();
  const auto add = [&](const Lanes& x, const Lanes& e) {
    part += e;
    // x = -inf has e = 0: clamped to the lowest finite value, its term is 0 * finite = 0, not NaN.
    if constexpr (kEntropy) part_weighted += e * x.max(lowest);
  };
  const auto flush = [&] {
    acc += part.template cast<double>();
    part.setZero();
    if constexpr (kEntropy) {
      weighted += part_weighted.template cast<double>();
      part_weighted.setZero();
    }
  };
  Index j = 0, run = 0;
  for (; j + kSoftmaxLanes <= width; j += kSoftmaxLanes) {
    const Lanes x = Eigen::Map<const Lanes>(s + j) - m;
    const Lanes e = exp_lanes<Scalar>(x);
    add(x, e);
    if (++run == kSoftmaxRun) flush(), run = 0;
    if (out) {
      Eigen::Map<Lanes> block(out + j);
      block = e;
    }
  }
  if (j < width) {
    const Lanes x = load_partial_lanes(s + j, width - j, -std::numeric_limits<Scalar>::infinity()) - m;
    const Lanes e = exp_lanes<Scalar>(x);
    add(x, e);
    if (out) std::copy_n(e.data(), width - j, out + j);
  }
  flush();
  if constexpr (kEntropy) *entropy_sum = weighted.sum();
  return acc.sum();
}

template <typename Scalar>
double sum_exp_shifted(const Scalar* s, Index width, Scalar m, Scalar* out, double* entropy_sum = nullptr) {
  return entropy_sum ? sum_exp_shifted_impl<true>(s, width, m, out, entropy_sum)
                     : sum_exp_shifted_impl<false>(s, width, m, out, entropy_sum);
}

// sum_j s_j of s [width] in double, summed in 16 running lanes (the last block padded with 0) and
// a fixed tree over them: the same bits wherever s lies (Eigen's own sum peels to an aligned
// address, which changes the order of a double sum).
template <typename Scalar>
double sum_in_lanes(const Scalar* s, Index width) {
  Eigen::Array<double, kSoftmaxLanes, 1> acc = Eigen::Array<double, kSoftmaxLanes, 1>::Zero();
  Index j = 0;
  for (; j + kSoftmaxLanes <= width; j += kSoftmaxLanes)
    acc += Eigen::Map<const SoftmaxLanes<Scalar>>(s + j).template cast<double>();
  if (j < width) acc += load_partial_lanes(s + j, width - j, Scalar(0)).template cast<double>();
  return acc.sum();
}

// sum_j u_j s_j of s [width] and u [width] in double (each product in double), summed as
// sum_in_lanes. A class of weight 0 and logit -inf adds NaN, as PyTorch's weight * log p does.
template <typename Scalar>
double weighted_sum_in_lanes(const Scalar* s, const double* u, Index width) {
  using Wide = Eigen::Array<double, kSoftmaxLanes, 1>;
  Wide acc = Wide::Zero();
  Index j = 0;
  for (; j + kSoftmaxLanes <= width; j += kSoftmaxLanes)
    acc += Eigen::Map<const SoftmaxLanes<Scalar>>(s + j).template cast<double>() * Eigen::Map<const Wide>(u + j);
  if (j < width)
    acc += load_partial_lanes(s + j, width - j, Scalar(0)).template cast<double>() *
           load_partial_lanes(u + j, width - j, 0.0);
  return acc.sum();
}

// sum_c v_c s_c of s [width] and v [width] in double, summed as weighted_sum_in_lanes, except that
// a term with v_c = 0 adds 0 whatever s_c (-inf included).
template <typename Scalar>
double soft_target_sum_in_lanes(const Scalar* s, const double* v, Index width) {
  using Wide = Eigen::Array<double, kSoftmaxLanes, 1>;
  Wide acc = Wide::Zero();
  const auto add = [&](const Wide& x, const Wide& w) { acc += (w != 0.0).select(x * w, Wide::Zero()); };
  Index j = 0;
  for (; j + kSoftmaxLanes <= width; j += kSoftmaxLanes)
    add(Eigen::Map<const SoftmaxLanes<Scalar>>(s + j).template cast<double>(), Eigen::Map<const Wide>(v + j));
  if (j < width)
    add(load_partial_lanes(s + j, width - j, Scalar(0)).template cast<double>(),
        load_partial_lanes(v + j, width - j, 0.0));
  return acc.sum();
}

// One row's statistics over the columns seen so far (a block of them, a shard, or all), in double.
struct SoftmaxRowStats {
  double max = -std::numeric_limits<double>::infinity();  // m (-inf: no column yet)
  double sum_exp = 0;                                     // S = sum_j exp(s_j - max)
  double target = 0;       // s_y, 0 where y is not among the columns (soft targets: sum_c v_c s_c)
  double logit_sum = 0;    // sum_j s_j (u_j s_j), with SoftmaxTerms::logit_sums()
  double entropy_sum = 0;  // E = sum_j exp(s_j - max) (s_j - max), with terms.entropy

  // max <- new_max (>= max), S (and E) rescaled to it; S = 0 stays 0 (also for max = -inf).
  void rescale_to(double new_max) {
    if (sum_exp == 0.0) {
      sum_exp = 0.0;
      entropy_sum = 0.0;
    } else {
      const double factor = std::exp(max - new_max);
      entropy_sum = (entropy_sum + (max - new_max) * sum_exp) * factor;
      sum_exp = sum_exp * factor;
    }
    max = new_max;
  }

  // Adds the block s [width] (soft-capped logits) at the current max, which must be at least the
  // block's: exp(s_j - Scalar(max)) is summed (and written to exp_out when not null; exp_out may
  // be s: s_y and sum_j s_j are read first). target_column: y's column in the block (ignored outside
  // [0, width)); column: the global class of s[0] (where the block's class weights start).
  // A max of -inf means every column so far is -inf (or NaN): the block is shifted by 0 instead,
  // so that each -inf adds exp(-inf) = 0, its share at whatever max the row ends with, where
  // exp(-inf - max) would be NaN.
  template <typename Scalar>
  void add_at_max(const Scalar* s, Index width, Index target_column, const SoftmaxTerms& terms, Scalar* exp_out,
                  Index column = 0) {
    if (terms.soft_targets)
      target += soft_target_sum_in_lanes(s, terms.soft_targets + column, width);
    else if (target_column >= 0 && target_column < width)
      target = static_cast<double>(s[target_column]);
    if (terms.logit_sums())
      logit_sum += terms.class_weights ? weighted_sum_in_lanes(s, terms.class_weights + column, width)
                                       : sum_in_lanes(s, width);
    const Scalar shift = max == -std::numeric_limits<double>::infinity() ? Scalar(0) : static_cast<Scalar>(max);
    double block_entropy = 0;
    sum_exp += sum_exp_shifted(s, width, shift, exp_out, terms.entropy ? &block_entropy : nullptr);
    entropy_sum += block_entropy;
  }

  // The online step: the block's max, S rescaled when it exceeds the running max, then the block
  // added at the (new) running max.
  template <typename Scalar>
  void accumulate(const Scalar* s, Index width, Index target_column, const SoftmaxTerms& terms, Index column = 0) {
    const Scalar block_max = row_max(s, width);
    if (block_max > max) rescale_to(static_cast<double>(block_max));
    add_at_max(s, width, target_column, terms, static_cast<Scalar*>(nullptr), column);
  }

  // The statistics that ranks (or blocks) add once they share one max: S, s_y (one holder plus
  // zeros, so exact), for label smoothing sum_j s_j, and with terms.entropy E --
  // summed_parts(terms) values.
  static int summed_parts(const SoftmaxTerms& terms) { return 2 + terms.logit_sums() + terms.entropy; }
  void store_sums(double* parts, const SoftmaxTerms& terms) const {
    parts[0] = sum_exp;
    parts[1] = target;
    int i = 2;
    if (terms.logit_sums()) parts[i++] = logit_sum;
    if (terms.entropy) parts[i] = entropy_sum;
  }
  void load_sums(const double* parts, const SoftmaxTerms& terms) {
    sum_exp = parts[0];
    target = parts[1];
    int i = 2;
    if (terms.logit_sums()) logit_sum = parts[i++];
    if (terms.entropy) entropy_sum = parts[i];
  }
};

// Across the ranks of comm (a Communicator, parallel/communicator.hpp; a template parameter so that this
// header does not need it), each holding statistics of the same rows over its own columns:
// every row's max <- the max over the ranks, and each rank's S rescaled to it (a rank with no
// column contributes S = 0). One all-reduce of `rows` doubles; buffer is scratch.
template <typename Comm>
void all_reduce_row_max(Comm& comm, SoftmaxRowStats* stats, Index rows, std::vector<double>& buffer) {
  if (rows == 0) return;
  const std::size_t n = static_cast<std::size_t>(rows);
  buffer.resize(n);
  for (std::size_t i = 0; i < n; ++i) buffer[i] = stats[i].max;
  comm.all_reduce_max(buffer.data(), rows);
  for (std::size_t i = 0; i < n; ++i) stats[i].rescale_to(buffer[i]);
}

// Then, with one max per row on every rank: S, s_y (and sum_j s_j) <- their sums over the ranks,
// the same on every rank. One all-reduce of summed_parts(terms) * rows doubles.
template <typename Comm>
void all_reduce_row_sums(Comm& comm, SoftmaxRowStats* stats, Index rows, const SoftmaxTerms& terms,
                         std::vector<double>& buffer) {
  if (rows == 0) return;
  const std::size_t n = static_cast<std::size_t>(rows);
  const std::size_t parts = static_cast<std::size_t>(SoftmaxRowStats::summed_parts(terms));
  buffer.resize(parts * n);
  for (std::size_t i = 0; i < n; ++i) stats[i].store_sums(&buffer[parts * i], terms);
  comm.all_reduce_sum(buffer.data(), static_cast<Index>(parts * n));
  for (std::size_t i = 0; i < n; ++i) stats[i].load_sums(&buffer[parts * i], terms);
}

// H = log S - E / S: the entropy of softmax(s) from a row's statistics over all its columns (needs
// terms.entropy while they were summed).
inline double row_entropy(const SoftmaxRowStats& stats) {
  return std::log(stats.sum_exp) - stats.entropy_sum / stats.sum_exp;
}

// A row's loss, from its statistics over all its columns.
struct RowLoss {
  double ce = 0;             // cross-entropy of the row (label smoothing included)
  double z_loss = 0;         // z_loss * lse^2
  double entropy = 0;        // H, the entropy of softmax(s) (with terms.entropy; else 0)
  double entropy_bonus = 0;  // -beta H (0 when beta is 0)
  double lse = 0;            // log-sum-exp of the (soft-capped) logits
  double class_weight = 1;   // u_y, the target's class weight (ce, z_loss and entropy_bonus include it)
  double total() const { return ce + z_loss + entropy_bonus; }
};

// ce = (m - s_y) + log S without smoothing: m - s_y is exact (two Scalar values, subtracted in
// double) and nothing of lse's size is subtracted, so logits of 1e5 lose nothing to cancellation
// (lse - s_y would lose lse's last bits). With smoothing the same terms, rearranged:
//   ce = log S + (1 - eps) (m - s_y) + eps (m - (1 / C) sum_j s_j).
// The z-loss term is exactly 0 when z_loss is 0 (not 0 * lse^2, NaN for an infinite lse).
// With class weights (u_y = target_weight), the header's weighted form, each term times u_y.
inline RowLoss row_loss(const SoftmaxRowStats& stats, const SoftmaxTerms& terms, double target_weight = 1.0) {
  RowLoss row;
  const double log_sum = std::log(stats.sum_exp);
  row.lse = stats.max + log_sum;
  const double eps = terms.label_smoothing;
  if (terms.soft_targets) {
    // T log S + (T m - sum_c v_c s_c): nothing of lse's size is subtracted.
    const double T = terms.soft_mass;
    row.ce = T * log_sum + (T * stats.max - stats.target);
    row.z_loss = terms.z_loss > 0 ? terms.z_loss * row.lse * row.lse : 0.0;
    if (terms.entropy) row.entropy = row_entropy(stats);
    row.entropy_bonus = terms.entropy_bonus != 0 ? -terms.entropy_bonus * row.entropy : 0.0;
    return row;
  }
  if (terms.class_weights) {
    const double u = target_weight, C = static_cast<double>(terms.classes), U = terms.class_weight_sum;
    row.class_weight = u;
    if (terms.logit_sums())
      row.ce = log_sum * ((1.0 - eps) * u + eps * U / C) + (1.0 - eps) * u * (stats.max - stats.target) +
               eps / C * (U * stats.max - stats.logit_sum);
    else
      row.ce = u * ((stats.max - stats.target) + log_sum);
    row.z_loss = terms.z_loss > 0 ? u * terms.z_loss * row.lse * row.lse : 0.0;
    if (terms.entropy) row.entropy = row_entropy(stats);
    row.entropy_bonus = terms.entropy_bonus != 0 ? -u * terms.entropy_bonus * row.entropy : 0.0;
    return row;
  }
  if (terms.logit_sums())
    row.ce = log_sum + (1.0 - eps) * (stats.max - stats.target) +
             eps * (stats.max - stats.logit_sum / static_cast<double>(terms.classes));
  else
    row.ce = (stats.max - stats.target) + log_sum;
  row.z_loss = terms.z_loss > 0 ? terms.z_loss * row.lse * row.lse : 0.0;
  if (terms.entropy) row.entropy = row_entropy(stats);
  row.entropy_bonus = terms.entropy_bonus != 0 ? -terms.entropy_bonus * row.entropy : 0.0;
  return row;
}

// The gradient of a row in the form dz_j = (a exp(s_j - shift) - b - c [j = y]) (1 - (s_j / cap)^2),
// the last factor with softcap only: b = w eps / C, c = w (1 - eps), and
//   at the max  shift = m,    a = w (1 + 2 z_loss lse) / S    (softmax_gradient_at_max)
//   at the lse  shift = lse,  a = w (1 + 2 z_loss lse)        (softmax_gradient_at_lse)
// With an entropy bonus the first term becomes exp(s_j - shift) (a + e (s_j - L)), L = lse - H:
//   at the max  e = w beta / S;   at the lse  e = w beta.
// With class weights (u_y = row.class_weight): a = w ((1 - eps) u_y + eps U / C + 2 u_y z_loss lse)
// (/ S at the max), b_j = w (eps / C) u_j (b times each column's u_j), c = w (1 - eps) u_y,
// e = w beta u_y (/ S at the max).
// With soft targets: a = w (T + 2 z_loss lse) (/ S at the max), b_j = w v_j, c = 0, e = w beta (/ S).
template <typename Scalar>
struct SoftmaxGradient {
  Scalar shift = 0, a = 0, b = 0, c = 0;
  Scalar e = 0, log_shift = 0;  // the entropy bonus's coefficient and L
  bool smoothing = false;       // b != 0 (in double)
  bool entropy = false;         // beta != 0
};

template <typename Scalar>
SoftmaxGradient<Scalar> make_softmax_gradient(double shift, double a, double weight, const SoftmaxTerms& terms,
                                              double e = 0, double log_shift = 0, double target_weight = 1.0) {
  const double b = terms.soft_targets ? weight : weight * terms.label_smoothing / static_cast<double>(terms.classes);
  SoftmaxGradient<Scalar> k;
  k.shift = static_cast<Scalar>(shift);
  k.a = static_cast<Scalar>(a);
  k.b = static_cast<Scalar>(b);
  k.c = static_cast<Scalar>(terms.soft_targets    ? 0.0
                            : terms.class_weights ? weight * (1.0 - terms.label_smoothing) * target_weight
                                                  : weight * (1.0 - terms.label_smoothing));
  k.smoothing = b != 0;
  k.entropy = terms.entropy_bonus != 0;
  k.e = static_cast<Scalar>(e);
  k.log_shift = static_cast<Scalar>(log_shift);
  return k;
}

// w (1 + 2 z_loss lse): a at the lse, a S at the max. With class weights
// w ((1 - eps) u_y + eps U / C + 2 u_y z_loss lse).
inline double softmax_gradient_factor(double lse, double weight, const SoftmaxTerms& terms,
                                      double target_weight = 1.0) {
  if (terms.soft_targets)
    return weight * (terms.z_loss > 0 ? terms.soft_mass + 2.0 * terms.z_loss * lse : terms.soft_mass);
  if (terms.class_weights) {
    const double eps = terms.label_smoothing, u = target_weight;
    const double a = (1.0 - eps) * u + eps * terms.class_weight_sum / static_cast<double>(terms.classes);
    return weight * (terms.z_loss > 0 ? a + 2.0 * u * terms.z_loss * lse : a);
  }
  return weight * (terms.z_loss > 0 ? 1.0 + 2.0 * terms.z_loss * lse : 1.0);
}

// The entropy bonus's coefficient e before the division by S: w beta (u_y).
inline double softmax_entropy_factor(double weight, const SoftmaxTerms& terms, double target_weight) {
  return terms.class_weights && !terms.soft_targets ? weight * terms.entropy_bonus * target_weight
                                                    : weight * terms.entropy_bonus;
}

template <typename Scalar>
SoftmaxGradient<Scalar> softmax_gradient_at_max(const SoftmaxRowStats& stats, const RowLoss& row, double weight,
                                                const SoftmaxTerms& terms) {
  const double u = row.class_weight;
  return make_softmax_gradient<Scalar>(stats.max, softmax_gradient_factor(row.lse, weight, terms, u) / stats.sum_exp,
                                       weight, terms, softmax_entropy_factor(weight, terms, u) / stats.sum_exp,
                                       row.lse - row.entropy, u);
}

template <typename Scalar>
SoftmaxGradient<Scalar> softmax_gradient_at_lse(const RowLoss& row, double weight, const SoftmaxTerms& terms) {
  const double u = row.class_weight;
  return make_softmax_gradient<Scalar>(row.lse, softmax_gradient_factor(row.lse, weight, terms, u), weight, terms,
                                       softmax_entropy_factor(weight, terms, u), row.lse - row.entropy, u);
}

// Without an entropy bonus the row's lse is all the gradient needs.
template <typename Scalar>
SoftmaxGradient<Scalar> softmax_gradient_at_max(const SoftmaxRowStats& stats, double lse, double weight,
                                                const SoftmaxTerms& terms) {
  RowLoss row;
  row.lse = lse;
  return softmax_gradient_at_max<Scalar>(stats, row, weight, terms);
}
template <typename Scalar>
SoftmaxGradient<Scalar> softmax_gradient_at_lse(double lse, double weight, const SoftmaxTerms& terms) {
  RowLoss row;
  row.lse = lse;
  return softmax_gradient_at_lse<Scalar>(row, weight, terms);
}

// w [width] <- dz of a block of the row's columns, target_column = y's column in the block
// (ignored outside [0, width)). w holds the block's soft-capped logits s, or, when holds_exp is
// set (at the max, no softcap: the exponentials written by add_at_max), exp(s_j - m).
// holds_exp must be false with an entropy bonus (its term needs s), with class weights under
// label smoothing and with soft targets (b_j needs the column). column: the global class of w[0].
// With soft targets target_column is ignored (c = 0; the targets are in b_j = b v_j).
template <typename Scalar>
void apply_softmax_gradient(Scalar* w, Index width, Index target_column, const SoftmaxGradient<Scalar>& k,
                            const SoftmaxTerms& terms, bool holds_exp, Index column = 0) {
  using Lanes = SoftmaxLanes<Scalar>;
  const bool target_here = !terms.soft_targets && target_column >= 0 && target_column < width;
  const double* per_column = terms.soft_targets ? terms.soft_targets : k.smoothing ? terms.class_weights : nullptr;
  if (per_column) {
    // dz = (exp(s - shift) (a [+ e (s - L)]) - b u_j) (1 - (s / cap)^2 with softcap); soft
    // targets: b v_j in place of b u_j.
    const Scalar cap = static_cast<Scalar>(terms.softcap);
    const bool capped = terms.softcap > 0;
    const Scalar t_y = target_here && capped ? w[target_column] / cap : Scalar(0);
    const double* u = per_column + column;
    map_lanes_at(w, w, width, [&](const Lanes& s, Index j, Index count) -> Lanes {
      const Lanes b = k.b * load_partial_lanes(u + j, count, 0.0).template cast<Scalar>();
      const Lanes e = exp_lanes<Scalar>(s - k.shift);
      const Lanes g = (k.entropy ? Lanes(e * (k.a + k.e * (s - k.log_shift))) : Lanes(e * k.a)) - b;
      return capped ? Lanes(g * (Scalar(1) - (s / cap).square())) : g;
    });
    if (target_here) w[target_column] -= capped ? k.c * (Scalar(1) - t_y * t_y) : k.c;
    return;
  }
  if (k.entropy) {
    // dz = (exp(s - shift) (a + e (s - L)) - b) (1 - (s / cap)^2 with softcap).
    const Scalar cap = static_cast<Scalar>(terms.softcap);
    const bool capped = terms.softcap > 0;
    const Scalar t_y = target_here && capped ? w[target_column] / cap : Scalar(0);
    map_lanes(w, w, width, [&](const Lanes& s) -> Lanes {
      const Lanes g = exp_lanes<Scalar>(s - k.shift) * (k.a + k.e * (s - k.log_shift)) - k.b;
      return capped ? Lanes(g * (Scalar(1) - (s / cap).square())) : g;
    });
    if (target_here) w[target_column] -= capped ? k.c * (Scalar(1) - t_y * t_y) : k.c;
    return;
  }
  if (terms.softcap > 0) {
    // dz = g (1 - (s / cap)^2), the derivative of cap tanh(z / cap).
    const Scalar cap = static_cast<Scalar>(terms.softcap);
    const Scalar t_y = target_here ? w[target_column] / cap : Scalar(0);
    map_lanes(w, w, width, [&](const Lanes& s) -> Lanes {
      return (exp_lanes<Scalar>(s - k.shift) * k.a - k.b) * (Scalar(1) - (s / cap).square());
    });
    if (target_here) w[target_column] -= k.c * (Scalar(1) - t_y * t_y);
  } else if (holds_exp) {
    // Products and differences round the same in any lane: no blocks needed.
    Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> row(w, width);
    row *= k.a;
    if (k.smoothing) row -= k.b;
    if (target_here) w[target_column] -= k.c;
  } else {
    map_lanes(w, w, width, [&](const Lanes& s) -> Lanes { return exp_lanes<Scalar>(s - k.shift) * k.a - k.b; });
    if (target_here) w[target_column] -= k.c;
  }
}

// The whole row at once, max first (the plain loss): z [C] raw logits (C = terms.classes), target
// y in [0, C) (ignored with soft targets: terms.soft_targets holds the row's v). work is a C-long buffer the kernel may
// overwrite (it may be z itself); it is required when `gradient` is set or softcap > 0, and may be null otherwise. With
// `gradient`, work <- dz for row weight `weight`. z_y, the max and the sums are read before work is written.
template <typename Scalar>
RowLoss softmax_loss_row(const Scalar* z, Scalar* work, Index y, const SoftmaxTerms& terms, bool gradient,
                         double weight) {
  const Index C = terms.classes;
  const Scalar* s = z;
  if (terms.softcap > 0) {
    softcap_row(z, work, C, static_cast<Scalar>(terms.softcap));
    s = work;
  }
  SoftmaxRowStats stats;
  stats.max = static_cast<double>(row_max(s, C));
  // Without soft-capping, exp(s - m) goes straight into work (the gradient's first step); with an
  // entropy bonus the gradient needs s itself, so work gets a copy of z instead.
  const bool exp_into_work = gradient && !(terms.softcap > 0) && terms.entropy_bonus == 0 &&
                             !(terms.class_weights && terms.logit_sums()) && !terms.soft_targets;
  stats.add_at_max(s, C, y, terms, exp_into_work ? work : nullptr);
  const RowLoss row = row_loss(stats, terms, terms.soft_targets ? 1.0 : terms.target_weight(y));
  if (gradient) {
    if (!exp_into_work && s != work) std::copy_n(s, C, work);
    const SoftmaxGradient<Scalar> k = softmax_gradient_at_max<Scalar>(stats, row, weight, terms);
    apply_softmax_gradient(work, C, y, k, terms, /*holds_exp=*/exp_into_work);
  }
  return row;
}

}  // namespace detail
}  // namespace embedhead

#endif  // EMBEDHEAD_DETAIL_SOFTMAX_HPP
