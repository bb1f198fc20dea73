// Driver for the ODR test: links odr_a.cpp and odr_b.cpp into one program.
#include <cstdio>

int embedhead_odr_a();
int embedhead_odr_b();

int main() {
  const int a = embedhead_odr_a();
  const int b = embedhead_odr_b();
  if (a != b) {
    std::fprintf(stderr, "odr_test: translation units disagree (%d vs %d)\n", a, b);
    return 1;
  }
  std::printf("odr_test: ok\n");
  return 0;
}
