// embedhead: the exceptions the library throws.
//
// Every check runs before any state changes, so a throw leaves weights, gradients, masks and RNG
// counters exactly as they were (the strong guarantee). Messages name the function, the bad value,
// where it was found and the valid range, e.g.
//   TokenEmbedding::forward: id 50257 at (b=1, t=3) outside [0, 50257)
#ifndef EMBEDHEAD_ERRORS_HPP
#define EMBEDHEAD_ERRORS_HPP

#include <stdexcept>
#include <string>

namespace embedhead {

// An id, target or position outside its valid range.
class index_error : public std::out_of_range {
 public:
  explicit index_error(const std::string& message) : std::out_of_range(message) {}
};

// Matrices whose shapes do not fit together (ids vs activations, tying mismatched tables, ...).
class shape_error : public std::invalid_argument {
 public:
  explicit shape_error(const std::string& message) : std::invalid_argument(message) {}
};

// A scalar setting outside its domain (dropout p outside [0, 1], init std <= 0, V or d = 0, ...).
class value_error : public std::invalid_argument {
 public:
  explicit value_error(const std::string& message) : std::invalid_argument(message) {}
};

// A file that is not valid in its format (a safetensors or .npy file: bad magic, malformed
// header, truncated data), or a tensor whose dtype cannot go where it is asked to. Shapes that
// disagree with a layer are shape_error.
class format_error : public std::runtime_error {
 public:
  explicit format_error(const std::string& message) : std::runtime_error(message) {}
};

// A file that cannot be opened, mapped, read or written (the message has the path and errno text).
class io_error : public std::runtime_error {
 public:
  explicit io_error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace embedhead

#endif  // EMBEDHEAD_ERRORS_HPP
