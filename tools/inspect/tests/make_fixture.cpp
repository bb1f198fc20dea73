// Writes the small checkpoints embedhead-inspect's tests read (into the directory argv[1]):
//
//   gpt2.safetensors   wte.weight [1000, 48] F32 + wpe.weight [64, 48], tied (no lm_head.weight).
//                      "Trained" rows: a shared offset (anisotropy) + one of six cluster centres +
//                      noise. The 24 "under-trained" rows, ids 7 + 41 i (i = 0..23), are the shared
//                      offset plus 0.7 along one common direction (orthogonal to the clusters)
//                      plus tiny noise: close to the centroid, as rows training never moved are,
//                      and aligned with each other, which the Magikarp score looks for.
//   gpt2.vocab         one token per line, with a tab, a backslash, a control byte, invalid UTF-8
//                      and an emoji among them (for the escaping test).
//   llama.safetensors  model.embed_tokens.weight [300, 16] + lm_head.weight [300, 16], BF16, untied.
//   other.safetensors  encoder.weight [10, 4] only: no known layout.
//   heads.safetensors  two heads a, b [3, 2] and hidden_states [2, 2] with a known comparison:
//                      a = [[1, 0], [0, 1], [0, 0]], b = [[0, 1], [1, 0], [0, 0]] (b swaps the
//                      first two classes); state 1 h = (ln 3, 0): P_a = (3, 1, 1) / 5,
//                      P_b = (1, 3, 1) / 5, KL(P_a || P_b) = (3/5) ln 3 + (1/5) ln(1/3) = (2/5) ln 3
//                      = 0.4394449, top-1 0 against 1, |P_a - P_b| at id 0 = 2/5; state 2 h = 0:
//                      both uniform, KL 0, top-1 0 for both (ties to the smaller id), |dp| 0.
//                      Over the two: mean KL 0.2197225, max 0.4394449, same top-1 50 %, |dp| mean
//                      0.2, max 0.4.
#include <embedhead/io/checkpoint.hpp>
#include <embedhead/io/safetensors.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

using namespace embedhead;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_fixture <output directory>\n");
    return 2;
  }
  const std::string dir = argv[1];
  try {
    Rng rng(11);
    {
      const Index V = 1000, d = 48, clusters = 6;
      RowMatrix<float> offset(1, d), centres(clusters, d);
      for (Index j = 0; j < d; ++j) offset(0, j) = static_cast<float>(0.4 + 0.1 * rng.normal());
      for (Index c = 0; c < clusters; ++c)
        for (Index j = 0; j < d; ++j) centres(c, j) = static_cast<float>(0.18 * rng.normal());
      centres.rowwise() -= centres.colwise().mean();  // the clusters average to the offset...
      const Eigen::RowVectorXf o = offset.row(0) / offset.norm();
      for (Index c = 0; c < clusters; ++c) {
        centres.row(c) -= centres.row(c).dot(o) * o;     // ...are orthogonal to it...
        centres.row(c) *= 1.1f / centres.row(c).norm();  // ...and 1.1 away from it
      }
      // The direction the under-trained rows share (as softmax gradients push rows of tokens that
      // never occur one common way): random, orthogonal to the cluster centres, unit length.
      Eigen::VectorXd u(d);
      for (Index j = 0; j < d; ++j) u(j) = rng.normal();
      for (int pass = 0; pass < 2; ++pass)
        for (Index c = 0; c < clusters; ++c) {
          const Eigen::VectorXd w = centres.row(c).cast<double>().transpose();
          u -= (u.dot(w) / w.squaredNorm()) * w;
        }
      u.normalize();
      RowMatrix<float> E(V, d);
      for (Index v = 0; v < V; ++v) {
        const bool undertrained = v % 41 == 7 && v < 7 + 41 * 24;
        for (Index j = 0; j < d; ++j)
          E(v, j) = undertrained ? offset(0, j) + static_cast<float>(0.7 * u(j) + 0.01 * rng.normal())
                                 : offset(0, j) + centres(v % clusters, j) + static_cast<float>(0.03 * rng.normal());
      }
      RowMatrix<float> P(64, d);
      for (Index i = 0; i < P.size(); ++i) P.data()[i] = static_cast<float>(0.02 * rng.normal());
      SafetensorsWriter w;
      w.add<float>("wte.weight", E, DType::F32);
      w.add<float>("wpe.weight", P, DType::F32);
      w.write(dir + "/gpt2.safetensors");

      std::ofstream vocab(dir + "/gpt2.vocab", std::ios::binary);
      for (Index v = 0; v < V; ++v) {
        switch (v) {
          case 0: vocab << "tab\there"; break;
          case 1: vocab << "back\\slash"; break;
          case 2: vocab << "bell\x07"; break;
          case 3:
            vocab << "bad\xff"
                     "byte";
            break;
          case 4: vocab << "fish \xf0\x9f\x90\x9f"; break;
          default: vocab << "tok" << v;
        }
        vocab << '\n';
      }
    }
    {
      const Index V = 300, d = 16;
      RowMatrix<float> E(V, d), W(V, d);
      for (Index i = 0; i < E.size(); ++i) E.data()[i] = static_cast<float>(0.5 * rng.normal());
      for (Index i = 0; i < W.size(); ++i) W.data()[i] = static_cast<float>(0.5 * rng.normal() + 0.2);
      SafetensorsWriter w;
      w.add<float>("model.embed_tokens.weight", E, DType::BF16);
      w.add<float>("lm_head.weight", W, DType::BF16);
      w.write(dir + "/llama.safetensors");
    }
    {
      RowMatrix<float> X = RowMatrix<float>::Ones(10, 4);
      SafetensorsWriter w;
      w.add<float>("encoder.weight", X, DType::F32);
      w.write(dir + "/other.safetensors");
    }
    {
      RowMatrix<float> a(3, 2), b(3, 2), h(2, 2);
      a << 1, 0, 0, 1, 0, 0;
      b << 0, 1, 1, 0, 0, 0;
      h << static_cast<float>(std::log(3.0)), 0, 0, 0;
      SafetensorsWriter w;
      w.add<float>("a", a, DType::F32);
      w.add<float>("b", b, DType::F32);
      w.add<float>("hidden_states", h, DType::F32);
      w.write(dir + "/heads.safetensors");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_fixture: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
