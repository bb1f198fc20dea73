// Minimal embedhead consumer (add_subdirectory). Prints "embedhead <major>.<minor>.<patch>".
#include <embedhead/embedhead.hpp>

#include <cstdio>

int main() {
  std::printf("embedhead %d.%d.%d\n", EMBEDHEAD_VERSION_MAJOR, EMBEDHEAD_VERSION_MINOR, EMBEDHEAD_VERSION_PATCH);
  return 0;
}
