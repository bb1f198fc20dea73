// Checkpoint loading and saving for a GPT-2-sized table (V = 50257, d = 768, 154 MB in F32),
// beside std::memcpy of the same bytes, in one binary so the ratios hold:
//
//   Memcpy       one std::memcpy of V*d floats between two resident buffers: the floor for
//                any load that ends in a float table.
//   Load/F32     SafetensorsFile::open (mmap + header validation) + load_checkpoint into an
//                existing TokenEmbedding, from a file in the page cache. F32 -> float is a row
//                memcpy out of the mapping, so a second copy anywhere would show as ~0.5x.
//   Load/BF16    the same from a BF16 file (half the bytes, widened on the way).
//   Load/F32+finite  load_checkpoint's non-finite scan is part of both loads above; this one
//                is the scan alone (first_non_finite), to show its share.
//   Save/F32, Save/BF16  save_checkpoint to /tmp (page cache; the rename included). Not synced:
//                disk speed is not what is measured.
//
// bytes_per_second = table bytes in float (V*d*4) for every row, so rates compare directly.
#include "bench_support.hpp"

#include <embedhead/io/checkpoint.hpp>

#include "gbench_main.hpp"

#include <benchmark/benchmark.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace {

using embedhead::DType;
using embedhead::Index;
using embedhead::RowMatrix;
using embedhead::SafetensorsFile;
using embedhead::TokenEmbedding;

constexpr char kProgram[] = "checkpoint_bench";
constexpr Index kV = 50257, kD = 768;

TokenEmbedding<float>& source() {
  static TokenEmbedding<float> table(kV, kD);
  return table;
}
const embedhead::CheckpointNames& names() {
  static const auto n = embedhead::hugging_face_names(embedhead::ModelFamily::gpt2);
  return n;
}
std::string path_for(DType dtype) {
  return "/tmp/embedhead_checkpoint_bench_" + std::to_string(::getpid()) + "_" + embedhead::dtype_name(dtype) +
         ".safetensors";
}
// The file of `dtype`, written once per process and removed at exit.
const std::string& file_for(DType dtype) {
  static std::string f32, bf16;
  std::string& path = dtype == DType::F32 ? f32 : bf16;
  if (path.empty()) {
    path = path_for(dtype);
    embedhead::save_checkpoint<float>(path, names(), source(), nullptr, nullptr, dtype);
    std::atexit([] {
      std::remove(path_for(DType::F32).c_str());
      std::remove(path_for(DType::BF16).c_str());
    });
  }
  return path;
}

void set_bytes(benchmark::State& state) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * kV * kD *
                          static_cast<std::int64_t>(sizeof(float)));
}

void BM_Memcpy(benchmark::State& state) {
  const RowMatrix<float>& from = source().weight().value().eval();
  RowMatrix<float> to(kV, kD);
  for (auto _ : state) {
    std::memcpy(to.data(), from.data(), static_cast<std::size_t>(kV * kD) * sizeof(float));
    benchmark::DoNotOptimize(to.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state);
}

void BM_Load(benchmark::State& state, DType dtype) {
  const std::string& path = file_for(dtype);
  TokenEmbedding<float> target(kV, kD);
  for (auto _ : state) {
    const auto file = SafetensorsFile::open(path);
    embedhead::load_checkpoint<float>(file, names(), target);
    benchmark::DoNotOptimize(target.weight().value().data());
    benchmark::ClobberMemory();
  }
  // Correct before it counts: F32 bit-exact, BF16 within its rounding.
  const auto& a = source().weight().value();
  const auto& b = target.weight().value();
  if (dtype == DType::F32 && !(a == b)) bench_support::fail(kProgram, "F32 load differs from the saved table");
  if (dtype == DType::BF16 && !((a - b).cwiseAbs().array() <= a.cwiseAbs().array() / 256).all())
    bench_support::fail(kProgram, "BF16 load off by more than its rounding");
  set_bytes(state);
}

void BM_FiniteScan(benchmark::State& state) {
  const auto file = SafetensorsFile::open(file_for(DType::F32));
  const auto& tensor = file.at(names().token_embedding);
  for (auto _ : state) benchmark::DoNotOptimize(file.first_non_finite(tensor));
  set_bytes(state);
}

void BM_Save(benchmark::State& state, DType dtype) {
  const std::string path = path_for(dtype) + ".save";
  source();  // drawn before the timing starts
  for (auto _ : state) embedhead::save_checkpoint<float>(path, names(), source(), nullptr, nullptr, dtype);
  std::remove(path.c_str());
  set_bytes(state);
}

void register_benchmarks() {
  benchmark::RegisterBenchmark("Memcpy/V:50257/d:768", BM_Memcpy)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Load/F32/V:50257/d:768", BM_Load, DType::F32)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Load/BF16/V:50257/d:768", BM_Load, DType::BF16)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("FiniteScan/F32/V:50257/d:768", BM_FiniteScan)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Save/F32/V:50257/d:768", BM_Save, DType::F32)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Save/BF16/V:50257/d:768", BM_Save, DType::BF16)->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
