// embedhead beside libtorch (ATen + autograd), same shapes, same process, same inputs:
//
//   lookup     GPT-2 V = 50257, d = 768, N = 8192: TokenEmbedding::forward into a preallocated
//              output vs at::index_select_out (preallocated), at::embedding (fresh output) and a
//              memcpy of the same N*d floats.
//   emb step   zero_grad + TokenEmbedding::backward (row-sparse) vs at::embedding_dense_backward
//              (what autograd runs for nn.Embedding, into a fresh [V, d] gradient) and
//              at::embedding_sparse_backward + coalesce() (sparse=True).
//   head fwd   OutputProjection::forward, N = 1024, d = 768, V = 50257, with bias, vs at::linear
//              (fresh logits) and at::addmm_out (preallocated logits).
//   head bwd   OutputProjection::backward (dh = dlogits W, dW += dlogits^T h, db += sums) vs the
//              ops autograd runs for linear: at::mm twice and a sum, fresh outputs.
//   CE         cross_entropy_forward_backward on [1024, 50257] logits into a separate dlogits vs
//              at::cross_entropy_loss + backward() (autograd).
//   LM step    zero_grad + forward + cross-entropy in place + backward vs at::linear +
//              at::cross_entropy_loss + backward() (autograd, grads set to none each step).
//   Gemma head N = 256 tokens, V = 256,000, d = 2048, no bias (Gemma ties its head): the fused
//              LM-head step (two passes over vocabulary blocks: the default budget holds 32 tokens'
//              logits) and the unfused step vs torch's linear + cross_entropy + backward.
//   RoPE       8192 tokens (8 x 1024) x 32 heads x head_dim 128, float, half-split pairing:
//              rope_forward into a preallocated output vs Hugging Face's apply_rotary_pos_emb
//              written in ATen (q * cos + rotate_half(q) * sin, rotate_half = cat(-x2, x1); cos
//              and sin [T, 128] computed once outside the timing, in float32 as HF does), fresh
//              output; and forward + backward (rope_forward, rope_backward into outputs) vs the
//              same forward + autograd's backward.
//   bf16 step  (built with embedhead::onednn) W rounded to bf16 + the bf16 fused head loss on
//              oneDNN, vs torch's bf16 step as CPU autocast runs it: at::linear on bf16 casts of
//              h, W and b (its oneDNN matmul), the logits cast to float for at::cross_entropy_loss,
//              backward() into the float leaves through the casts.
//
// Each implementation is timed on 1 and 2 threads (at::set_num_threads and omp_set_num_threads:
// Eigen, OpenBLAS's OpenMP build and ATen all follow the OpenMP setting), median of repeated runs
// after one warm-up. Before any timing every pair is checked to compute the same thing (the max
// absolute difference is printed; the program exits with status 1 if it is out of tolerance).
//
// Peak extra memory: each step runs once more in a forked child (one thread), after the parent
// ran it, so parameters, gradient buffers and caches already exist. The child resets the peak
// RSS (`echo 5 > /proc/self/clear_refs`), runs the step and reports VmHWM - VmRSS(before). Steps
// run with every scratch buffer they need allocated inside (embedhead's LM-head step allocates its
// logits there; its caller-provided outputs -- out, dlogits, dh -- and its kept gradients are not
// counted; torch's fresh outputs are). In the child glibc's mmap threshold is pinned at 1 MiB, so
// every large block comes from mmap and shows in the RSS, instead of from memory already resident.
//
// Speed ratio = baseline time / embedhead time: above 1 means embedhead is faster.
//
// `torch_compare --only=WORD` checks everything but measures (memory and time) and prints only the
// comparisons whose name contains WORD (e.g. --only=RoPE).
//
// OpenBLAS (libtorch's BLAS on Debian) reads OPENBLAS_CORETYPE when it is loaded, before main();
// when it is unset, the program sets it to SkylakeX and re-executes itself.
#include "bench_support.hpp"  // first: its pragma must precede every other include

#include <embedhead/embedhead.hpp>
#include <embedhead/version.hpp>
#ifdef EMBEDHEAD_HAVE_ONEDNN
#include <embedhead/backends/onednn_head.hpp>  // to_bf16
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>

#include <dlfcn.h>
#include <malloc.h>
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::OutputProjection;
using embedhead::Parameter;
using embedhead::RowMatrix;
using embedhead::TokenEmbedding;

constexpr char kProgram[] = "torch_compare";
constexpr char kReexecMarker[] = "EMBEDHEAD_TORCH_COMPARE_REEXECUTED";

constexpr Index kV = 50257, kD = 768, kLookupTokens = 8192, kHeadTokens = 1024;
constexpr Index kGemmaV = 256000, kGemmaD = 2048, kGemmaTokens = 256;
constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kLogitsMiB = static_cast<double>(kHeadTokens * kV) * sizeof(float) / kMiB;
const int kThreadCounts[] = {1, 2};

// ---- environment ----

// OpenBLAS picks its kernels when the library is loaded, so the variable must be in the
// environment before the process starts: set it and execv ourselves once.
void ensure_openblas_coretype(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
  setenv(kReexecMarker, "1", 1);
  std::fflush(stdout);
  execv("/proc/self/exe", argv);
  std::perror("torch_compare: execv(/proc/self/exe) failed; continuing without OPENBLAS_CORETYPE");
}

std::string first_line_of_command(const char* command, const char* prefix) {
  std::string result;
  if (FILE* pipe = popen(command, "r")) {
    char line[512];
    while (std::fgets(line, sizeof line, pipe)) {
      std::string s(line);
      if (s.rfind(prefix, 0) == 0) {
        s = s.substr(std::strlen(prefix));
        s.erase(0, s.find_first_not_of(" \t"));
        while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
        result = s;
        break;
      }
    }
    pclose(pipe);
  }
  return result.empty() ? "?" : result;
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

// OpenBLAS's own description of the kernels it chose (found at run time: libtorch loads it as
// libblas.so.3; absent when another BLAS is the system's alternative).
std::string openblas_description() {
  using GetString = char* (*)();
  const auto corename = reinterpret_cast<GetString>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const auto config = reinterpret_cast<GetString>(dlsym(RTLD_DEFAULT, "openblas_get_config"));
  if (!corename || !config) return "not OpenBLAS (no openblas_get_corename symbol)";
  return std::string(config()) + ", core " + corename();
}

void set_threads(int threads) {
  omp_set_num_threads(threads);
  at::set_num_threads(threads);
  // OpenBLAS's OpenMP build follows omp_get_max_threads(); the pthreads build keeps its own pool.
  using SetThreads = void (*)(int);
  if (const auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(threads);
}

int openblas_threads() {
  using GetThreads = int (*)();
  const auto get = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get ? get() : -1;
}

// ---- timing and memory ----

template <typename T>
void keep(const T& value) {
  asm volatile("" : : "g"(&value) : "memory");
}

// Median wall-clock seconds of `reps` runs, after one untimed warm-up run.
double median_seconds(const std::function<void()>& step, int reps) {
  step();
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    step();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

long status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::strtol(line.c_str() + std::strlen(field), nullptr, 10);
  return -1;
}

// Peak RSS growth while `step` runs once, in a forked child, in MiB; negative if it failed.
double peak_extra_mib(const std::function<void()>& step) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    alarm(600);  // never leave a stuck child behind
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 20);
    long extra = -1;
    if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
      std::fputs("5", f);
      std::fclose(f);
      const long before = status_kib("VmRSS:");
      step();
      extra = status_kib("VmHWM:") - before;
    }
    const ssize_t written = write(fds[1], &extra, sizeof extra);
    _exit(written == static_cast<ssize_t>(sizeof extra) ? 0 : 1);
  }
  close(fds[1]);
  long extra = -1;
  if (pid < 0 || read(fds[0], &extra, sizeof extra) != static_cast<ssize_t>(sizeof extra)) extra = -1;
  close(fds[0]);
  if (pid > 0) waitpid(pid, nullptr, 0);
  return extra < 0 ? -1.0 : static_cast<double>(extra) / 1024.0;
}

// ---- numerical agreement ----

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}
double max_abs(const at::Tensor& a) { return a.abs().max().item<double>(); }

// Prints the difference; exits if it exceeds rel_tolerance * max|reference| (+ a tiny floor).
void agree(const char* what, const at::Tensor& embedhead_result, const at::Tensor& torch_result, double rel_tolerance) {
  if (embedhead_result.sizes() != torch_result.sizes())
    bench_support::fail(kProgram, std::string(what) + ": shapes differ");
  const double diff = max_abs_diff(embedhead_result, torch_result), scale = max_abs(torch_result);
  std::printf("  check %-44s max |diff| = %.3g (max |value| %.3g)\n", what, diff, scale);
  if (!(diff <= rel_tolerance * scale + 1e-30))
    bench_support::fail(kProgram, std::string(what) + ": embedhead and torch differ by " + bench_support::number(diff));
}
void agree_scalar(const char* what, double embedhead_value, double torch_value, double abs_tolerance) {
  const double diff = std::abs(embedhead_value - torch_value);
  std::printf("  check %-44s |diff| = %.3g (%.7g vs %.7g)\n", what, diff, embedhead_value, torch_value);
  if (!(diff <= abs_tolerance)) bench_support::fail(kProgram, std::string(what) + ": losses differ");
}

// Views of embedhead's storage as tensors (no copy).
at::Tensor view(const RowMatrix<float>& m) {
  return at::from_blob(const_cast<float*>(m.data()), {m.rows(), m.cols()}, at::kFloat);
}
at::Tensor view(Eigen::Map<const RowMatrix<float>> m) {
  return at::from_blob(const_cast<float*>(m.data()), {m.rows(), m.cols()}, at::kFloat);
}

// ---- the registry of implementations and comparisons ----

struct Implementation {
  std::string name;
  std::function<void()> step;  // as timed (embedhead: reuses its preallocated buffers)
  std::function<void()> cold;  // for the memory figure: allocates its own scratch; empty = step
  int reps;
  bool measure_memory;
};

struct Comparison {
  std::string what;       // e.g. "lookup GPT-2 N=8192"
  std::string embedhead;  // implementation names
  std::string baseline;
  double target_1t;  // speed-ratio target on 1 / 2 threads, 0 = none
  double target_2t;
  bool logits_share;        // print memory as % of the [1024, 50257] logits
  double memory_limit_mib;  // extra-memory target of the embedhead side, 0 = none
};

struct Bench {
  std::vector<Implementation> implementations;
  std::vector<Comparison> comparisons;
  std::map<std::string, std::map<int, double>> seconds;  // name -> threads -> median
  std::map<std::string, double> memory_mib;

  void add(std::string name, std::function<void()> step, int reps, std::function<void()> cold = {},
           bool measure_memory = true) {
    implementations.push_back({std::move(name), std::move(step), std::move(cold), reps, measure_memory});
  }
  void compare(std::string what, std::string embedhead, std::string baseline, double target_1t, double target_2t,
               bool logits_share = false, double memory_limit_mib = 0) {
    comparisons.push_back({std::move(what), std::move(embedhead), std::move(baseline), target_1t, target_2t,
                           logits_share, memory_limit_mib});
  }
};

// ---------------------------------------------------------------------------------------------
// The fused LM-head + loss row (FusedHeadLoss). `step` runs one full training step (zero_grad,
// loss + gradients) with a warmed workspace; `cold` the same with a fresh one (for the memory
// column). It is timed against the torch LM-head step and embedhead's own unfused step with issue
// 14's targets: >= 1.2x torch, >= 1.0x the unfused step (no slower), extra peak memory <= 64 MiB.
// ---------------------------------------------------------------------------------------------
void add_fused_lm_head_step(Bench& bench, std::function<void()> step, std::function<void()> cold = {}) {
  bench.add("embedhead fused LM-head step", std::move(step), 3, std::move(cold));
  bench.compare("LM-head step (fused)", "embedhead fused LM-head step", "torch linear+CE+backward", 1.2, 1.2, true, 64);
  bench.compare("LM-head step fused vs unfused", "embedhead fused LM-head step", "embedhead LM-head step", 1.0, 1.0,
                true);
}

std::string format_time(double seconds) {
  char text[32];
  if (seconds < 1e-3)
    std::snprintf(text, sizeof text, "%.1f us", seconds * 1e6);
  else if (seconds < 1)
    std::snprintf(text, sizeof text, "%.2f ms", seconds * 1e3);
  else
    std::snprintf(text, sizeof text, "%.3f s", seconds);
  return text;
}

std::string format_memory(double mib, bool logits_share) {
  if (mib < 0) return "n/a";
  char text[48];
  if (logits_share)
    std::snprintf(text, sizeof text, "%.0f (%.0f%%)", mib, 100.0 * mib / kLogitsMiB);
  else
    std::snprintf(text, sizeof text, "%.1f", mib);
  return text;
}

void print_table(const Bench& bench) {
  std::printf("\nSpeed ratio = baseline time / embedhead time (> 1: embedhead faster). Extra MiB: peak RSS growth\n");
  std::printf("of one step (1 thread), with %% of the %.0f MiB [1024, 50257] logits for the head/loss rows.\n\n",
              kLogitsMiB);
  std::printf(
      "| comparison | baseline | thr | embedhead | baseline | ratio | target | met | extra MiB embedhead | extra MiB "
      "baseline |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|:-:|---:|---:|\n");
  for (const Comparison& c : bench.comparisons) {
    for (const int threads : kThreadCounts) {
      const auto e = bench.seconds.find(c.embedhead), b = bench.seconds.find(c.baseline);
      if (e == bench.seconds.end() || b == bench.seconds.end()) continue;
      const double te = e->second.at(threads), tb = b->second.at(threads), ratio = tb / te;
      const double target = threads == 1 ? c.target_1t : c.target_2t;
      char target_text[32] = "", met[8] = "";
      if (target > 0) {
        std::snprintf(target_text, sizeof target_text, ">= %.2gx", target);
        std::snprintf(met, sizeof met, "%s", ratio >= target ? "yes" : "NO");
      }
      std::string memory_e, memory_b;
      if (threads == 1) {
        const auto me = bench.memory_mib.find(c.embedhead), mb = bench.memory_mib.find(c.baseline);
        memory_e = me == bench.memory_mib.end() ? "" : format_memory(me->second, c.logits_share);
        memory_b = mb == bench.memory_mib.end() ? "" : format_memory(mb->second, c.logits_share);
        if (c.memory_limit_mib > 0)
          memory_e += " (target <= " + bench_support::number(c.memory_limit_mib) + " MiB: " +
                      (me != bench.memory_mib.end() && me->second >= 0 && me->second <= c.memory_limit_mib ? "yes"
                                                                                                           : "NO") +
                      ")";
      }
      std::printf("| %s | %s | %d | %s | %s | %.2fx | %s | %s | %s | %s |\n", c.what.c_str(), c.baseline.c_str(),
                  threads, format_time(te).c_str(), format_time(tb).c_str(), ratio, target_text, met, memory_e.c_str(),
                  memory_b.c_str());
    }
  }
}

IdMatrix<std::int64_t> random_ids64(Index N, Index V, unsigned seed) {
  return bench_support::random_ids(N, V, seed).cast<std::int64_t>();
}

}  // namespace

int main(int argc, char** argv) {
  ensure_openblas_coretype(argv);
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--only=", 0) == 0)
      only = arg.substr(7);
    else
      bench_support::fail(kProgram, "unknown argument " + arg + " (the only option is --only=WORD)");
  }
  set_threads(1);

  std::printf("torch_compare: embedhead %d.%d.%d vs libtorch %s (ATen + autograd), Eigen %d.%d.%d (%s)\n",
              EMBEDHEAD_VERSION_MAJOR, EMBEDHEAD_VERSION_MINOR, EMBEDHEAD_VERSION_PATCH, TORCH_VERSION,
              EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION, Eigen::SimdInstructionSetsInUse());
  if (std::getenv(kReexecMarker))
    std::printf(
        "OPENBLAS_CORETYPE was not set: set it to SkylakeX and re-executed /proc/self/exe, because "
        "OpenBLAS reads it only when loaded and Debian's OpenBLAS misdetects this CPU (falls back to "
        "SSE3 kernels)\n");
  else
    std::printf("OPENBLAS_CORETYPE=%s (from the environment)\n", std::getenv("OPENBLAS_CORETYPE"));
  std::printf("BLAS: %s\n", openblas_description().c_str());
  std::printf("CPU: %s, %ld online CPUs; threads measured: 1 and 2 (OpenMP max %d at start)\n",
              first_line_of_command("lscpu", "Model name:").c_str(), sysconf(_SC_NPROCESSORS_ONLN),
              omp_get_num_procs());
  std::printf("load average at start: %s\n", load_average().c_str());
  std::fflush(stdout);

  Bench bench;

  // ---- inputs (all float; ids int64, torch's index type, for both) ----
  auto table = std::make_shared<Parameter<float>>(kV, kD, "token_embedding.weight");
  bench_support::fill_uniform(table->value(), 1);
  TokenEmbedding<float> embedding(table);
  const IdMatrix<std::int64_t> ids = random_ids64(kLookupTokens, kV, 42);
  RowMatrix<float> dout(kLookupTokens, kD);
  bench_support::fill_uniform(dout, 3);

  OutputProjection<float> head(kV, kD);
  bench_support::fill_uniform(head.bias()->value(), 11, 0.1);
  RowMatrix<float> h(kHeadTokens, kD), dlogits_in(kHeadTokens, kV), ce_logits(kHeadTokens, kV);
  bench_support::fill_uniform(h, 12);
  bench_support::fill_uniform(dlogits_in, 13, 1.0 / kHeadTokens);
  bench_support::fill_uniform(ce_logits, 5, 8.0);  // logits in [-8, 8)
  const IdMatrix<std::int64_t> targets = random_ids64(kHeadTokens, kV, 9);

  const auto E_value = static_cast<const Parameter<float>&>(*table).value();
  const auto W_value = static_cast<const OutputProjection<float>&>(head).weight().value();
  const auto b_value = static_cast<const OutputProjection<float>&>(head).bias()->value();

  const at::Tensor E_t = view(E_value);
  const at::Tensor ids_t = at::from_blob(const_cast<std::int64_t*>(ids.data()), {kLookupTokens}, at::kLong);
  const at::Tensor dout_t = view(dout);
  const at::Tensor W_t = view(W_value);
  const at::Tensor b_t = view(b_value).view({kV});
  const at::Tensor h_t = view(h);
  const at::Tensor dlogits_t = view(dlogits_in);
  const at::Tensor ce_logits_t = view(ce_logits);
  const at::Tensor targets_t = at::from_blob(const_cast<std::int64_t*>(targets.data()), {kHeadTokens}, at::kLong);

  // ---- lookup ----
  RowMatrix<float> out(kLookupTokens, kD), gathered(kLookupTokens, kD), copy(kLookupTokens, kD);
  at::Tensor out_t = at::empty({kLookupTokens, kD}, at::kFloat);
  embedding.forward(ids, gathered);
  bench.add(
      "embedhead lookup",
      [&] {
        embedding.forward(ids, out);
        keep(out);
      },
      21);
  bench.add(
      "torch index_select_out",
      [&] {
        at::index_select_out(out_t, E_t, 0, ids_t);
        keep(out_t);
      },
      21);
  bench.add(
      "torch embedding", [&] { keep(at::embedding(E_t, ids_t)); }, 21);
  const std::size_t lookup_bytes = static_cast<std::size_t>(kLookupTokens * kD) * sizeof(float);
  bench.add(
      "memcpy",
      [&] {
        std::memcpy(copy.data(), gathered.data(), lookup_bytes);
        keep(copy);
      },
      21, {}, false);
  bench.compare("lookup N=8192", "embedhead lookup", "memcpy", 0.9, 0.9);
  bench.compare("lookup N=8192", "embedhead lookup", "torch index_select_out", 1.0, 1.0);
  bench.compare("lookup N=8192", "embedhead lookup", "torch embedding", 0, 0);

  // ---- embedding training step ----
  bench.add(
      "embedhead zero_grad+sparse backward",
      [&] {
        embedding.zero_grad();
        embedding.backward(ids, dout);
      },
      11);
  bench.add(
      "torch embedding_dense_backward", [&] { keep(at::embedding_dense_backward(dout_t, ids_t, kV, -1, false)); }, 11);
  bench.add(
      "torch sparse backward+coalesce",
      [&] { keep(at::embedding_sparse_backward(dout_t, ids_t, kV, -1, false).coalesce()); }, 11);
  bench.compare("embedding step N=8192", "embedhead zero_grad+sparse backward", "torch embedding_dense_backward", 20,
                20);
  bench.compare("embedding step N=8192", "embedhead zero_grad+sparse backward", "torch sparse backward+coalesce", 1.0,
                1.0);

  // ---- head GEMMs ----
  RowMatrix<float> logits(kHeadTokens, kV), dh(kHeadTokens, kD);
  at::Tensor logits_t = at::empty({kHeadTokens, kV}, at::kFloat);
  bench.add(
      "embedhead head forward",
      [&] {
        head.forward(h, logits);
        keep(logits);
      },
      5);
  bench.add(
      "torch linear", [&] { keep(at::linear(h_t, W_t, b_t)); }, 5);
  bench.add(
      "torch addmm_out",
      [&] {
        at::addmm_out(logits_t, b_t, h_t, W_t.t());
        keep(logits_t);
      },
      5);
  bench.compare("head forward N=1024", "embedhead head forward", "torch linear", 1.0, 0.95, true);
  bench.compare("head forward N=1024", "embedhead head forward", "torch addmm_out", 1.0, 0.95, true);
  bench.add(
      "embedhead head backward",
      [&] {
        head.backward(h, dlogits_in, dh);
        keep(dh);
      },
      3);
  bench.add(
      "torch mm+mm+sum",
      [&] {
        keep(at::mm(dlogits_t, W_t));
        keep(at::mm(dlogits_t.t(), h_t));
        keep(dlogits_t.sum(0));
      },
      3);
  bench.compare("head backward N=1024", "embedhead head backward", "torch mm+mm+sum", 1.0, 0.95, true);

  // ---- cross-entropy ----
  RowMatrix<float> ce_dlogits(kHeadTokens, kV);
  at::Tensor ce_leaf = view(ce_logits).requires_grad_(true);
  bench.add(
      "embedhead CE fwd+bwd",
      [&] { keep(embedhead::cross_entropy_forward_backward<float>(ce_logits, targets, ce_dlogits)); }, 11);
  bench.add(
      "torch cross_entropy+backward",
      [&] {
        ce_leaf.mutable_grad().reset();
        at::cross_entropy_loss(ce_leaf, targets_t).backward();
        keep(ce_leaf.grad());
      },
      11);
  bench.compare("CE fwd+bwd [1024, 50257]", "embedhead CE fwd+bwd", "torch cross_entropy+backward", 8, 8, true);

  // ---- LM-head training step ----
  RowMatrix<float> lm_logits(kHeadTokens, kV), lm_dh(kHeadTokens, kD);
  double lm_loss = 0;
  const auto embedhead_lm_step = [&](RowMatrix<float>& scratch_logits) {
    head.zero_grad();
    head.forward(h, scratch_logits);
    lm_loss = embedhead::cross_entropy_forward_backward<float>(scratch_logits, targets, scratch_logits).loss;
    head.backward(h, scratch_logits, lm_dh);
  };
  at::Tensor W_leaf = view(W_value).requires_grad_(true);
  at::Tensor b_leaf = at::from_blob(const_cast<float*>(b_value.data()), {kV}, at::kFloat).requires_grad_(true);
  at::Tensor h_leaf = view(h).requires_grad_(true);
  at::Tensor torch_loss;
  const auto torch_lm_step = [&] {
    W_leaf.mutable_grad().reset();
    b_leaf.mutable_grad().reset();
    h_leaf.mutable_grad().reset();
    torch_loss = at::cross_entropy_loss(at::linear(h_leaf, W_leaf, b_leaf), targets_t);
    torch_loss.backward();
  };
  bench.add(
      "embedhead LM-head step", [&] { embedhead_lm_step(lm_logits); }, 3,
      [&] {
        RowMatrix<float> scratch(kHeadTokens, kV);  // the logits, counted as the step's scratch
        embedhead_lm_step(scratch);
      });
  bench.add("torch linear+CE+backward", torch_lm_step, 3);
  bench.compare("LM-head step (unfused)", "embedhead LM-head step", "torch linear+CE+backward", 0, 0, true);

  // The fused step: the same loss and gradients without the [N, V] logits.
  embedhead::FusedHeadLoss<float> fused_loss;
  RowMatrix<float> fused_dh(kHeadTokens, kD);
  double fused_loss_value = 0;
  const auto fused_lm_step = [&](embedhead::FusedHeadLoss<float>& loss) {
    head.zero_grad();
    fused_loss_value = loss.forward_backward(head, h, targets, fused_dh).loss;
  };
  add_fused_lm_head_step(
      bench, [&] { fused_lm_step(fused_loss); },
      [&] {
        embedhead::FusedHeadLoss<float> fresh;  // its workspace is the step's scratch
        fused_lm_step(fresh);
      });

  // ---- the Gemma-sized head (V = 256,000, d = 2048, no bias), N = 256 ----
  embedhead::OutputProjectionOptions gemma_options;
  gemma_options.bias = false;
  OutputProjection<float> gemma_head(kGemmaV, kGemmaD, gemma_options);
  RowMatrix<float> gemma_h(kGemmaTokens, kGemmaD), gemma_logits(kGemmaTokens, kGemmaV), gemma_dh(kGemmaTokens, kGemmaD);
  bench_support::fill_uniform(gemma_h, 21);
  const IdMatrix<std::int64_t> gemma_targets = random_ids64(kGemmaTokens, kGemmaV, 22);
  const at::Tensor gemma_targets_t = at::from_blob(const_cast<std::int64_t*>(gemma_targets.data()), {kGemmaTokens},
                                                   at::kLong);
  const auto gemma_W_value = static_cast<const OutputProjection<float>&>(gemma_head).weight().value();
  embedhead::FusedHeadLoss<float> gemma_fused;
  double gemma_loss = 0, gemma_fused_loss = 0;
  const auto gemma_step = [&](RowMatrix<float>& scratch_logits) {
    gemma_head.zero_grad();
    gemma_head.forward(gemma_h, scratch_logits);
    gemma_loss = embedhead::cross_entropy_forward_backward<float>(scratch_logits, gemma_targets, scratch_logits).loss;
    gemma_head.backward(gemma_h, scratch_logits, gemma_dh);
  };
  const auto gemma_fused_step = [&](embedhead::FusedHeadLoss<float>& loss) {
    gemma_head.zero_grad();
    gemma_fused_loss = loss.forward_backward(gemma_head, gemma_h, gemma_targets, gemma_dh).loss;
  };
  at::Tensor gemma_W_leaf = view(gemma_W_value).requires_grad_(true);
  at::Tensor gemma_h_leaf = view(gemma_h).requires_grad_(true);
  at::Tensor gemma_torch_loss;
  const auto torch_gemma_step = [&] {
    gemma_W_leaf.mutable_grad().reset();
    gemma_h_leaf.mutable_grad().reset();
    gemma_torch_loss = at::cross_entropy_loss(at::linear(gemma_h_leaf, gemma_W_leaf), gemma_targets_t);
    gemma_torch_loss.backward();
  };
  bench.add(
      "embedhead Gemma fused step", [&] { gemma_fused_step(gemma_fused); }, 3,
      [&] {
        embedhead::FusedHeadLoss<float> fresh;
        gemma_fused_step(fresh);
      });
  bench.add(
      "embedhead Gemma unfused step", [&] { gemma_step(gemma_logits); }, 3,
      [&] {
        RowMatrix<float> scratch(kGemmaTokens, kGemmaV);
        gemma_step(scratch);
      });
  bench.add("torch Gemma linear+CE+backward", torch_gemma_step, 3);
  bench.compare("Gemma head step (fused) N=256", "embedhead Gemma fused step", "torch Gemma linear+CE+backward", 1.2,
                1.2);
  bench.compare("Gemma head step (unfused) N=256", "embedhead Gemma unfused step", "torch Gemma linear+CE+backward", 0,
                0);

#ifdef EMBEDHEAD_HAVE_ONEDNN
  // The bf16 step, both sides casting the float master W each step as mixed precision does.
  RowMatrix<embedhead::bfloat16> W_bf16(kV, kD);  // rounded into in place each step: no allocation
  embedhead::FusedHeadLossWorkspace<float> bf16_workspace;
  RowMatrix<float> bf16_dh(kHeadTokens, kD);
  double bf16_loss = 0;
  const auto bf16_lm_step = [&](embedhead::FusedHeadLossWorkspace<float>& workspace) {
    head.zero_grad();
    embedhead::to_bf16(W_value, W_bf16);
    auto dW_acc = head.weight().grad().dense_accumulator();
    auto db_acc = head.bias()->grad().dense_accumulator();
    bf16_loss = embedhead::fused_head_loss_forward_backward(h, W_bf16, b_value, targets, bf16_dh, dW_acc, db_acc,
                                                            workspace)
                    .loss;
  };
  at::Tensor torch_bf16_loss;
  const auto torch_bf16_step = [&] {
    W_leaf.mutable_grad().reset();
    b_leaf.mutable_grad().reset();
    h_leaf.mutable_grad().reset();
    const at::Tensor logits_bf16 = at::linear(h_leaf.to(at::kBFloat16), W_leaf.to(at::kBFloat16),
                                              b_leaf.to(at::kBFloat16));
    torch_bf16_loss = at::cross_entropy_loss(logits_bf16.to(at::kFloat), targets_t);
    torch_bf16_loss.backward();
  };
  bench.add(
      "embedhead bf16 fused LM-head step", [&] { bf16_lm_step(bf16_workspace); }, 3,
      [&] {
        embedhead::FusedHeadLossWorkspace<float> fresh;
        bf16_lm_step(fresh);
      });
  bench.add("torch bf16 linear+CE+backward", torch_bf16_step, 3);
  bench.compare("LM-head step (bf16)", "embedhead bf16 fused LM-head step", "torch bf16 linear+CE+backward", 1.2, 1.2,
                true);
  bench.compare("bf16 fused vs fp32 fused step", "embedhead bf16 fused LM-head step", "embedhead fused LM-head step",
                3.0, 3.0, true);
#endif

  // ---- numerical agreement, 1 thread, before any timing ----
  std::printf("\nnumerical agreement (embedhead vs torch, same inputs):\n");
  embedding.forward(ids, out);
  agree("lookup vs index_select_out", view(out), at::index_select_out(out_t, E_t, 0, ids_t), 0);
  agree("lookup vs embedding", view(out), at::embedding(E_t, ids_t), 0);
  std::memcpy(copy.data(), gathered.data(), lookup_bytes);
  agree("memcpy copy vs lookup", view(copy), view(out), 0);
  embedding.zero_grad();
  embedding.backward(ids, dout);
  {
    const RowMatrix<float> dE = embedding.weight().grad().to_dense();
    agree("embedding dE vs embedding_dense_backward", view(dE),
          at::embedding_dense_backward(dout_t, ids_t, kV, -1, false), 1e-6);
    const at::Tensor sparse = at::embedding_sparse_backward(dout_t, ids_t, kV, -1, false).coalesce();
    std::printf("  check %-44s %lld rows vs %lld touched by embedhead\n", "sparse+coalesce nnz rows",
                static_cast<long long>(sparse._nnz()), static_cast<long long>(embedding.weight().grad().num_touched()));
    if (sparse._nnz() != embedding.weight().grad().num_touched())
      bench_support::fail(kProgram, "sparse gradient row counts differ");
    agree("embedding dE vs sparse+coalesce", view(dE), sparse.to_dense(), 1e-6);
  }
  head.forward(h, logits);
  agree("head forward vs linear", view(logits), at::linear(h_t, W_t, b_t), 1e-5);
  agree("head forward vs addmm_out", view(logits), at::addmm_out(logits_t, b_t, h_t, W_t.t()), 1e-5);
  head.zero_grad();
  head.backward(h, dlogits_in, dh);
  {
    const RowMatrix<float> dW = head.weight().grad().to_dense(), db = head.bias()->grad().to_dense();
    agree("head backward dh vs mm", view(dh), at::mm(dlogits_t, W_t), 1e-5);
    agree("head backward dW vs mm", view(dW), at::mm(dlogits_t.t(), h_t), 1e-5);
    agree("head backward db vs sum", view(db).view({kV}), dlogits_t.sum(0), 1e-5);
  }
  {
    const double loss = embedhead::cross_entropy_forward_backward<float>(ce_logits, targets, ce_dlogits).loss;
    ce_leaf.mutable_grad().reset();
    const at::Tensor torch_ce = at::cross_entropy_loss(ce_leaf, targets_t);
    torch_ce.backward();
    agree_scalar("CE loss", loss, torch_ce.item<double>(), 1e-4);
    agree("CE dlogits", view(ce_dlogits), ce_leaf.grad(), 1e-5);
  }
  embedhead_lm_step(lm_logits);
  torch_lm_step();
  {
    const RowMatrix<float> dW = head.weight().grad().to_dense(), db = head.bias()->grad().to_dense();
    agree_scalar("LM step loss", lm_loss, torch_loss.item<double>(), 1e-4);
    agree("LM step dh", view(lm_dh), h_leaf.grad(), 1e-4);
    agree("LM step dW", view(dW), W_leaf.grad(), 1e-4);
    agree("LM step db", view(db).view({kV}), b_leaf.grad(), 1e-4);
  }

  fused_lm_step(fused_loss);
  {
    const RowMatrix<float> dW = head.weight().grad().to_dense(), db = head.bias()->grad().to_dense();
    agree_scalar("fused LM step loss", fused_loss_value, torch_loss.item<double>(), 1e-4);
    agree("fused LM step dh", view(fused_dh), h_leaf.grad(), 1e-4);
    agree("fused LM step dW", view(dW), W_leaf.grad(), 1e-4);
    agree("fused LM step db", view(db).view({kV}), b_leaf.grad(), 1e-4);
  }

  // The Gemma head: the loss, dh and the first 4096 rows of dW (all of it would need 8 GiB in double).
  torch_gemma_step();
  for (const bool fused : {false, true}) {
    if (fused)
      gemma_fused_step(gemma_fused);
    else
      gemma_step(gemma_logits);
    if (!gemma_head.weight().grad().is_dense()) bench_support::fail(kProgram, "Gemma dW is not dense");
    const auto dW = gemma_head.weight().grad().touched_values();  // dense: all V rows, no copy
    agree_scalar(fused ? "Gemma fused step loss" : "Gemma step loss", fused ? gemma_fused_loss : gemma_loss,
                 gemma_torch_loss.item<double>(), 1e-4);
    agree(fused ? "Gemma fused step dh" : "Gemma step dh", view(gemma_dh), gemma_h_leaf.grad(), 1e-4);
    agree(fused ? "Gemma fused step dW[:4096]" : "Gemma step dW[:4096]",
          at::from_blob(const_cast<float*>(dW.data()), {4096, kGemmaD}, at::kFloat),
          gemma_W_leaf.grad().narrow(0, 0, 4096), 1e-4);
  }

#ifdef EMBEDHEAD_HAVE_ONEDNN
  // bf16 against bf16: torch also rounds its logits to bf16, so only a loose agreement is asked.
  bf16_lm_step(bf16_workspace);
  torch_bf16_step();
  {
    const RowMatrix<float> dW = head.weight().grad().to_dense(), db = head.bias()->grad().to_dense();
    agree_scalar("bf16 LM step loss", bf16_loss, torch_bf16_loss.item<double>(), 2e-2);
    agree("bf16 LM step dh", view(bf16_dh), h_leaf.grad(), 5e-2);
    agree("bf16 LM step dW", view(dW), W_leaf.grad(), 5e-2);
    agree("bf16 LM step db", view(db).view({kV}), b_leaf.grad(), 5e-2);
  }
#endif

  // ---- RoPE ----
  constexpr Index kRopeB = 8, kRopeT = 1024, kRopeH = 32, kRopeHd = 128;
  RowMatrix<float> rope_x(kRopeB * kRopeT, kRopeH * kRopeHd), rope_dy(kRopeB * kRopeT, kRopeH * kRopeHd);
  RowMatrix<float> rope_y(kRopeB * kRopeT, kRopeH * kRopeHd), rope_dx(kRopeB * kRopeT, kRopeH * kRopeHd);
  bench_support::fill_uniform(rope_x, 21);
  bench_support::fill_uniform(rope_dy, 22);
  const embedhead::RopeTable<float> rope_table(kRopeHd, kRopeHd, embedhead::RopePairing::half_split, kRopeT,
                                               embedhead::rope_default_frequencies(kRopeHd, 10000.0));
  // HF's default rotary embedding: inv_freq in float32, freqs = t (x) inv_freq, emb = cat(freqs, freqs).
  const at::Tensor rope_inv_freq = 1.0 / at::pow(10000.0, at::arange(0, kRopeHd, 2, at::kLong).to(at::kFloat) /
                                                              static_cast<double>(kRopeHd));
  const at::Tensor rope_freqs = at::outer(at::arange(kRopeT, at::kFloat), rope_inv_freq);
  const at::Tensor rope_emb = at::cat({rope_freqs, rope_freqs}, -1);
  const at::Tensor rope_cos = rope_emb.cos().view({1, kRopeT, 1, kRopeHd});
  const at::Tensor rope_sin = rope_emb.sin().view({1, kRopeT, 1, kRopeHd});
  const auto rotate_half = [](const at::Tensor& x) {
    const at::Tensor x1 = x.narrow(-1, 0, kRopeHd / 2), x2 = x.narrow(-1, kRopeHd / 2, kRopeHd / 2);
    return at::cat({-x2, x1}, -1);
  };
  const at::Tensor rope_q = view(rope_x).view({kRopeB, kRopeT, kRopeH, kRopeHd});
  at::Tensor rope_q_leaf = rope_q.clone().requires_grad_(true);
  const at::Tensor rope_dy_t = view(rope_dy).view({kRopeB, kRopeT, kRopeH, kRopeHd});
  at::Tensor rope_torch_y;
  const auto embedhead_rope_forward = [&] { embedhead::rope_forward(rope_table, rope_x, kRopeH, kRopeT, 0, rope_y); };
  const auto embedhead_rope_step = [&] {
    embedhead::rope_forward(rope_table, rope_x, kRopeH, kRopeT, 0, rope_y);
    embedhead::rope_backward(rope_table, rope_dy, kRopeH, kRopeT, 0, rope_dx);
  };
  const auto torch_rope_forward = [&] { rope_torch_y = rope_q * rope_cos + rotate_half(rope_q) * rope_sin; };
  const auto torch_rope_step = [&] {
    rope_q_leaf.mutable_grad().reset();
    rope_torch_y = rope_q_leaf * rope_cos + rotate_half(rope_q_leaf) * rope_sin;
    rope_torch_y.backward(rope_dy_t);
  };
  embedhead_rope_step();
  torch_rope_step();
  // torch's angles are float32 products (position 1023 times a float inv_freq): a few 1e-5 apart.
  agree("RoPE forward", view(rope_y), rope_torch_y.detach().view({kRopeB * kRopeT, kRopeH * kRopeHd}), 1e-3);
  agree("RoPE backward", view(rope_dx), rope_q_leaf.grad().view({kRopeB * kRopeT, kRopeH * kRopeHd}), 1e-3);
  bench.add("embedhead RoPE forward", embedhead_rope_forward, 5);
  bench.add("torch HF rotate_half forward", torch_rope_forward, 5);
  bench.add("embedhead RoPE fwd+bwd", embedhead_rope_step, 5);
  bench.add("torch HF rotate_half fwd+autograd bwd", torch_rope_step, 5);
  bench.compare("RoPE forward 8192x32x128", "embedhead RoPE forward", "torch HF rotate_half forward", 0, 0);
  bench.compare("RoPE fwd+bwd 8192x32x128", "embedhead RoPE fwd+bwd", "torch HF rotate_half fwd+autograd bwd", 0, 0);

  // ---- peak extra memory, one thread, forked children ----
  // With --only=WORD, only the implementations of the comparisons named with WORD are measured.
  if (!only.empty()) {
    std::vector<Comparison> kept;
    for (const Comparison& c : bench.comparisons)
      if (c.what.find(only) != std::string::npos) kept.push_back(c);
    std::vector<Implementation> used;
    for (const Implementation& impl : bench.implementations)
      for (const Comparison& c : kept)
        if (impl.name == c.embedhead || impl.name == c.baseline) {
          used.push_back(impl);
          break;
        }
    if (kept.empty()) bench_support::fail(kProgram, "--only=" + only + " matches no comparison");
    bench.comparisons = kept;
    bench.implementations = used;
  }
  std::printf("\npeak extra memory (forked child per step, 1 thread):\n");
  for (const Implementation& impl : bench.implementations) {
    if (!impl.measure_memory) continue;
    const double mib = peak_extra_mib(impl.cold ? impl.cold : impl.step);
    bench.memory_mib[impl.name] = mib;
    std::printf("  %-40s %9.1f MiB\n", impl.name.c_str(), mib);
    std::fflush(stdout);
  }

  // ---- timing ----
  for (const int threads : kThreadCounts) {
    set_threads(threads);
    std::printf(
        "\ntiming on %d thread(s) (at::get_num_threads() = %d, omp_get_max_threads() = %d, Eigen %d, "
        "OpenBLAS %d):\n",
        threads, at::get_num_threads(), omp_get_max_threads(), Eigen::nbThreads(), openblas_threads());
    for (const Implementation& impl : bench.implementations) {
      const double t = median_seconds(impl.step, impl.reps);
      bench.seconds[impl.name][threads] = t;
      std::printf("  %-40s %12s  (median of %d)\n", impl.name.c_str(), format_time(t).c_str(), impl.reps);
      std::fflush(stdout);
    }
  }
  set_threads(1);

  print_table(bench);
  std::printf("\nload average at end: %s\n", load_average().c_str());
  return 0;
}
