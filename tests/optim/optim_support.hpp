// Helpers shared by the optimizer tests: a seeded Parameter, and a gradient set row by row
// (sparse) or whole (dense).
#ifndef EMBEDHEAD_TESTS_OPTIM_SUPPORT_HPP
#define EMBEDHEAD_TESTS_OPTIM_SUPPORT_HPP

#include <embedhead/parameter.hpp>

#include <cstdint>
#include <memory>
#include <vector>

#include "../reference/test_support.hpp"

namespace optim_support {

using embedhead::Index;
using embedhead::Parameter;
using embedhead::RowMatrix;

// A parameter [rows, cols] named `name` with U(-1, 1) values from `seed`.
template <typename Scalar>
std::shared_ptr<Parameter<Scalar>> make_parameter(Index rows, Index cols, std::uint64_t seed, const char* name = "p") {
  auto p = std::make_shared<Parameter<Scalar>>(rows, cols, name);
  p->value() = test_support::random_matrix<Scalar>(rows, cols, seed);
  return p;
}

// Sets p's gradient to the rows `rows` of G (sparse), or to all of G (dense) when rows is empty.
template <typename Scalar>
void set_gradient(Parameter<Scalar>& p, const RowMatrix<double>& G, const std::vector<Index>& rows) {
  p.zero_grad();
  if (rows.empty()) {
    p.grad().dense_accumulator() = G.cast<Scalar>();
    return;
  }
  std::vector<Index> slots(rows.size());
  p.grad().touch_rows(rows.data(), static_cast<Index>(rows.size()), slots.data());
  for (std::size_t i = 0; i < rows.size(); ++i) p.grad().slot_row(slots[i]) = G.row(rows[i]).cast<Scalar>();
}

}  // namespace optim_support

#endif  // EMBEDHEAD_TESTS_OPTIM_SUPPORT_HPP
