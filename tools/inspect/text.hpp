// embedhead-inspect: parsing of id lists and vocabulary files, and escaping of token strings for
// the terminal and for HTML/SVG.
#ifndef EMBEDHEAD_TOOLS_INSPECT_TEXT_HPP
#define EMBEDHEAD_TOOLS_INSPECT_TEXT_HPP

#include <embedhead/types.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace inspect {

using embedhead::Index;

// A command-line mistake: printed with the usage hint, exit status 2.
struct usage_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// "3,17, 42" (commas and/or whitespace) -> {3, 17, 42}. `what` names the option in messages.
inline std::vector<Index> parse_ids(const std::string& text, const std::string& what) {
  std::vector<Index> ids;
  std::size_t i = 0;
  while (i < text.size()) {
    const char c = text[i];
    if (c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++i;
      continue;
    }
    std::size_t j = i;
    if (text[j] == '-' || text[j] == '+') ++j;
    while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j;
    const std::string token = text.substr(i, j - i);
    const bool digits = j > i && (token.size() > 1 || (token[0] != '-' && token[0] != '+'));
    const bool ends = j == text.size() || text[j] == ',' || text[j] == ' ' || text[j] == '\t' || text[j] == '\n' ||
                      text[j] == '\r';
    if (!digits || !ends) {
      std::size_t k = i;
      while (k < text.size() && text[k] != ',' && text[k] != ' ' && text[k] != '\n') ++k;
      throw usage_error(what + ": '" + text.substr(i, k - i) +
                        "' is not a token id (expected integers such as 3,17,42)");
    }
    try {
      ids.push_back(static_cast<Index>(std::stoll(token)));
    } catch (const std::out_of_range&) {
      throw usage_error(what + ": '" + token + "' is too large for a token id");
    }
    i = j;
  }
  return ids;
}

inline std::string read_text_file(const std::string& path, const std::string& what) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error(what + ": cannot open '" + path + "': " + std::strerror(errno));
  std::string text;
  try {
    text.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  } catch (const std::exception& e) {
    throw std::runtime_error(what + ": cannot read '" + path + "': " + e.what());
  }
  if (file.bad()) throw std::runtime_error(what + ": cannot read '" + path + "'");
  return text;
}

// One token string per line (a trailing "\r" is dropped, so CRLF files work); line i is id i.
inline std::vector<std::string> read_vocab(const std::string& path) {
  const std::string text = read_text_file(path, "--vocab");
  std::vector<std::string> vocab;
  std::size_t begin = 0;
  while (begin < text.size()) {
    std::size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(begin, end - begin);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    vocab.push_back(std::move(line));
    begin = end + 1;
  }
  return vocab;
}

// Length of the valid UTF-8 sequence starting at s[i] (2..4), or 0 if it is not one.
inline std::size_t utf8_sequence(const std::string& s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = byte(i);
  std::size_t n = 0;
  unsigned min = 0;
  unsigned code = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
    code = c & 0x1Fu;
    min = 0x80;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    code = c & 0x0Fu;
    min = 0x800;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    code = c & 0x07u;
    min = 0x10000;
  } else
    return 0;
  if (i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xC0u) != 0x80u) return 0;
    code = (code << 6) | (byte(i + k) & 0x3Fu);
  }
  if (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return 0;
  return n;
}

// A token string made safe for one line of a terminal: control bytes, DEL and invalid UTF-8 become
// \n, \t, \r or \xNN; a backslash becomes "\\"; valid UTF-8 is kept as it is.
inline std::string escape_token(const std::string& s) {
  std::string out;
  char hex[8];
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '\\') {
      out += "\\\\";
      ++i;
    } else if (c == '\n') {
      out += "\\n";
      ++i;
    } else if (c == '\t') {
      out += "\\t";
      ++i;
    } else if (c == '\r') {
      out += "\\r";
      ++i;
    } else if (c < 0x20 || c == 0x7F) {
      std::snprintf(hex, sizeof hex, "\\x%02X", c);
      out += hex;
      ++i;
    } else if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
    } else if (const std::size_t n = utf8_sequence(s, i)) {
      out.append(s, i, n);
      i += n;
    } else {
      std::snprintf(hex, sizeof hex, "\\x%02X", c);
      out += hex;
      ++i;
    }
  }
  return out;
}

// Text for HTML and SVG content and attributes (after escape_token, so it is valid UTF-8).
inline std::string escape_xml(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// 50257 -> "50,257"
inline std::string thousands(long long n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

// printf into a std::string.
template <typename... Args>
std::string format(const char* fmt, Args... args) {
  char buffer[256];
  const int n = std::snprintf(buffer, sizeof buffer, fmt, args...);
  if (n < 0) return {};
  if (static_cast<std::size_t>(n) < sizeof buffer) return std::string(buffer, static_cast<std::size_t>(n));
  std::string big(static_cast<std::size_t>(n) + 1, '\0');
  std::snprintf(big.data(), big.size(), fmt, args...);
  big.resize(static_cast<std::size_t>(n));
  return big;
}

}  // namespace inspect

#endif  // EMBEDHEAD_TOOLS_INSPECT_TEXT_HPP
