// TEMPORARY: stands in for the RoPE kernels until they land in rope.hpp. Delete.
#pragma once
#include <embedhead/rope.hpp>
#include <embedhead/types.hpp>
#include <cmath>
namespace embedhead {
template <typename Scalar>
class RopeTable {
 public:
  RopeTable(Index head_dim, Index rotary_dim, RopePairing pairing, Index num_positions, const RopeFrequencies& f)
      : hd_(head_dim), rd_(rotary_dim), pairing_(pairing), P_(num_positions), cos_(num_positions, rotary_dim / 2),
        sin_(num_positions, rotary_dim / 2) {
    for (Index p = 0; p < P_; ++p)
      for (Index i = 0; i < rd_ / 2; ++i) {
        const double a = static_cast<double>(p) * f.inv_freq[static_cast<std::size_t>(i)];
        cos_(p, i) = static_cast<Scalar>(std::cos(a) * f.attention_factor);
        sin_(p, i) = static_cast<Scalar>(std::sin(a) * f.attention_factor);
      }
  }
  Index head_dim() const { return hd_; }
  Index rotary_dim() const { return rd_; }
  RopePairing pairing() const { return pairing_; }
  Index num_positions() const { return P_; }
  Index hd_, rd_;
  RopePairing pairing_;
  Index P_;
  RowMatrix<Scalar> cos_, sin_;
};
template <typename Scalar>
void rope_apply_stub(const RopeTable<Scalar>& t, MatrixRef<Scalar> x, Index H, Index T, Index start, Scalar sign) {
  const Index half = t.rd_ / 2;
  for (Index n = 0; n < x.rows(); ++n) {
    const Index p = start + n % T;
    for (Index h = 0; h < H; ++h)
      for (Index i = 0; i < half; ++i) {
        Scalar& u = x(n, h * t.hd_ + i);
        Scalar& v = x(n, h * t.hd_ + i + half);
        const Scalar c = t.cos_(p, i), s = sign * t.sin_(p, i);
        const Scalar yu = u * c - v * s, yv = v * c + u * s;
        u = yu;
        v = yv;
      }
  }
}
template <typename Scalar>
void rope_forward(const RopeTable<Scalar>& t, MatrixRef<Scalar> x, Index H, Index T, Index start) {
  rope_apply_stub<Scalar>(t, x, H, T, start, Scalar(1));
}
template <typename Scalar>
void rope_backward(const RopeTable<Scalar>& t, MatrixRef<Scalar> x, Index H, Index T, Index start) {
  rope_apply_stub<Scalar>(t, x, H, T, start, Scalar(-1));
}
}  // namespace embedhead
