// The model of examples/tiny_gpt.cpp, in a header so that other examples (text generation) can
// rebuild it from the checkpoint tiny_gpt saves: a small causal transformer written with Eigen,
// forward and backward by hand, between embedhead's TokenEmbedding and its FusedHeadLoss.
//
//   x_0      = E[ids]                                        E [V, d], ids [B, T] -> [N, d], N = B*T
//   for each of the L layers (pre-norm, residual):
//     a      = rmsnorm(x) * g_attn                           rmsnorm(x) = x / sqrt(mean(x^2) + eps)
//     q, k, v = a Wq^T, a Wk^T, a Wv^T                       [N, d] each = H heads of head_dim = d / H
//     q, k   = rope(q), rope(k)                              half-split pairs (i, i + head_dim/2), base 10000
//     o_h    = softmax(q_h k_h^T / sqrt(head_dim) + causal mask) v_h      per sequence and head: [T, head_dim]
//     x      = x + concat_h(o_h) Wo^T
//     m      = rmsnorm(x) * g_mlp
//     x      = x + (silu(m Wgate^T) * (m Wup^T)) Wdown^T      SwiGLU MLP, hidden width F
//   h        = rmsnorm(x) * g_final                          [N, d]
//   loss     = cross-entropy(h Wout^T, targets)              FusedHeadLoss: the [N, V] logits never held
//
// The head is untied (Wout [V, d] is its own parameter, no bias), as in Llama; the checkpoint uses
// Llama's tensor names (model.embed_tokens.weight, model.layers.{l}.self_attn.q_proj.weight, ...,
// lm_head.weight), weights stored [out, in] as PyTorch's nn.Linear, and keeps the configuration and
// the byte alphabet in the safetensors metadata. load_model() rebuilds the model from that file.
//
// Generation (a later example): load_model(path) gives the model and the byte alphabet; for a
// prompt of t <= context ids [1, t], model.logits(model.hidden(ids).bottomRows(1)) [1, V] scores
// the next byte (the window is recomputed each step: there is no key/value cache).
//
// Shapes: activations are row-major [N, width] (one token per row, row n is sequence n / T,
// position n % T); attention probabilities [B*H*T, T] (rows of (b, h) at (b*H + h)*T).
#ifndef EMBEDHEAD_EXAMPLES_TINY_GPT_HPP
#define EMBEDHEAD_EXAMPLES_TINY_GPT_HPP

#include <embedhead/embedhead.hpp>
#include <embedhead/io/safetensors.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tiny_gpt {

using embedhead::ConstMatrixRef;
using embedhead::Index;
using embedhead::MatrixRef;
using embedhead::Parameter;
using embedhead::RowMatrix;

struct Config {
  Index V = 0;         // vocabulary: distinct bytes of the corpus
  Index d = 64;        // model width
  Index layers = 2;    // L
  Index heads = 4;     // H; head_dim = d / H (even, for RoPE)
  Index ffn = 192;     // F, the MLP's hidden width
  Index context = 64;  // T: positions the RoPE table covers (the training sequence length)
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  Index head_dim() const { return d / heads; }

  void check() const {
    if (V < 1 || d < 1 || layers < 1 || heads < 1 || ffn < 1 || context < 1 || d % heads != 0 || head_dim() % 2 != 0 ||
        !(rope_theta > 0) || !(norm_eps > 0))
      throw std::invalid_argument("tiny_gpt: invalid configuration (V " + std::to_string(V) + ", d " +
                                  std::to_string(d) + ", heads " + std::to_string(heads) +
                                  "; d / heads must be an even integer)");
  }
};

// ---- kernels on views ----

// x [N, d], g [d, 1] -> y [N, d] = x / rms(x) * g, inv_rms [N, 1] = 1 / sqrt(mean(x^2) + eps).
template <typename Scalar>
void rms_norm_forward(const ConstMatrixRef<Scalar>& x, const ConstMatrixRef<Scalar>& g, double eps, MatrixRef<Scalar> y,
                      MatrixRef<Scalar> inv_rms) {
  const Scalar mean_of = Scalar(1) / static_cast<Scalar>(x.cols());
  for (Index n = 0; n < x.rows(); ++n) {
    const Scalar r = Scalar(1) / std::sqrt(x.row(n).squaredNorm() * mean_of + static_cast<Scalar>(eps));
    inv_rms(n, 0) = r;
    y.row(n) = (x.row(n) * r).cwiseProduct(g.transpose());
  }
}

// dy [N, d], x, g, inv_rms -> dx [N, d] += d loss / dx; dg [d, 1] += sum_n dy * x_hat.
// With x_hat = x r: dx = r (dy*g - x_hat * mean(dy*g * x_hat)).
template <typename Scalar>
void rms_norm_backward(const ConstMatrixRef<Scalar>& dy, const ConstMatrixRef<Scalar>& x,
                       const ConstMatrixRef<Scalar>& g, const ConstMatrixRef<Scalar>& inv_rms, MatrixRef<Scalar> dx,
                       MatrixRef<Scalar> dg) {
  const Scalar mean_of = Scalar(1) / static_cast<Scalar>(x.cols());
  for (Index n = 0; n < x.rows(); ++n) {
    const Scalar r = inv_rms(n, 0);
    const auto x_hat = (x.row(n) * r).eval();
    const auto dx_hat = dy.row(n).cwiseProduct(g.transpose()).eval();
    const Scalar dot = dx_hat.dot(x_hat) * mean_of;
    dx.row(n) += r * (dx_hat - dot * x_hat);
    dg.transpose() += dy.row(n).cwiseProduct(x_hat);
  }
}

// Causal multi-head attention. q, k, v [N, H*hd] (N = B*T) -> out [N, H*hd],
// probs [B*H*T, T] (row i of (b, h): softmax over keys j <= i, zeros above the diagonal).
template <typename Scalar>
void attention_forward(const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<Scalar>& k,
                       const ConstMatrixRef<Scalar>& v, Index B, Index T, Index H, MatrixRef<Scalar> probs,
                       MatrixRef<Scalar> out) {
  const Index hd = q.cols() / H;
  const Scalar scale = Scalar(1) / std::sqrt(static_cast<Scalar>(hd));
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      auto P = probs.middleRows((b * H + h) * T, T);  // [T, T]
      P.noalias() = q.block(b * T, h * hd, T, hd) * k.block(b * T, h * hd, T, hd).transpose();
      for (Index i = 0; i < T; ++i) {  // softmax of row i over j <= i, with its true max
        auto row = P.row(i).head(i + 1);
        row = ((row.array() - row.maxCoeff()) * scale).exp();
        row /= row.sum();
        P.row(i).tail(T - i - 1).setZero();
      }
      out.block(b * T, h * hd, T, hd).noalias() = P * v.block(b * T, h * hd, T, hd);
    }
}

// dout [N, H*hd], q, k, v, probs (from the forward) -> dq, dk, dv [N, H*hd] (written);
// dS [T, T] is scratch. With P the probabilities and dP = dO V^T:
// dV = P^T dO, dS = P * (dP - rowsum(P * dP)), dQ = dS K / sqrt(hd), dK = dS^T Q / sqrt(hd).
template <typename Scalar>
void attention_backward(const ConstMatrixRef<Scalar>& dout, const ConstMatrixRef<Scalar>& q,
                        const ConstMatrixRef<Scalar>& k, const ConstMatrixRef<Scalar>& v,
                        const ConstMatrixRef<Scalar>& probs, Index B, Index T, Index H, MatrixRef<Scalar> dq,
                        MatrixRef<Scalar> dk, MatrixRef<Scalar> dv, RowMatrix<Scalar>& dS) {
  const Index hd = q.cols() / H;
  const Scalar scale = Scalar(1) / std::sqrt(static_cast<Scalar>(hd));
  dS.resize(T, T);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const auto P = probs.middleRows((b * H + h) * T, T);
      const auto dO = dout.block(b * T, h * hd, T, hd);
      dv.block(b * T, h * hd, T, hd).noalias() = P.transpose() * dO;
      dS.noalias() = dO * v.block(b * T, h * hd, T, hd).transpose();  // dP
      for (Index i = 0; i < T; ++i) {
        const Scalar dot = P.row(i).head(i + 1).dot(dS.row(i).head(i + 1));
        dS.row(i) = P.row(i).cwiseProduct((dS.row(i).array() - dot).matrix()) * scale;
      }
      dq.block(b * T, h * hd, T, hd).noalias() = dS * k.block(b * T, h * hd, T, hd);
      dk.block(b * T, h * hd, T, hd).noalias() = dS.transpose() * q.block(b * T, h * hd, T, hd);
    }
}

// ---- the model ----

// One layer's parameters, [out, in] as nn.Linear (y = x W^T); norm gains [d, 1].
template <typename Scalar>
struct Layer {
  std::shared_ptr<Parameter<Scalar>> attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down;
};

// What one layer's forward keeps for its backward; N = B*T rows.
template <typename Scalar>
struct LayerCache {
  RowMatrix<Scalar> x, inv_rms1, a;      // input [N, d], 1/rms [N, 1], normed input [N, d]
  RowMatrix<Scalar> q, k, v;             // [N, d], q and k rotated
  RowMatrix<Scalar> probs;               // [B*H*T, T]
  RowMatrix<Scalar> att;                 // [N, d] heads' outputs, before Wo
  RowMatrix<Scalar> x_mid, inv_rms2, m;  // after attention [N, d], 1/rms [N, 1], normed [N, d]
  RowMatrix<Scalar> gate, up, act;       // [N, F]: m Wgate^T, m Wup^T, silu(gate) * up
};

template <typename Scalar>
class Model {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  // Weights ~ N(0, 0.02^2) from `seed` (Wo and Wdown at 0.02 / sqrt(2 L), as GPT-2), gains 1.
  Model(const Config& config, std::uint64_t seed)
      : config_((config.check(), config)),
        embedding_(table("model.embed_tokens.weight", config.V, config.d, seed)),
        head_(config.V, config.d, embedhead::OutputProjectionOptions{false, 0.02, seed + 1}),
        rope_(config.head_dim(), config.head_dim(), embedhead::RopePairing::half_split, config.context,
              embedhead::rope_default_frequencies(config.head_dim(), config.rope_theta)),
        final_norm_(gain("model.norm.weight")) {
    embedhead::Rng rng(seed + 2);
    const double std = 0.02, out_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config.layers));
    const Index d = config.d, F = config.ffn;
    for (Index l = 0; l < config.layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      Layer<Scalar> layer;
      layer.attn_norm = gain(p + "input_layernorm.weight");
      layer.wq = matrix(p + "self_attn.q_proj.weight", d, d, std, rng);
      layer.wk = matrix(p + "self_attn.k_proj.weight", d, d, std, rng);
      layer.wv = matrix(p + "self_attn.v_proj.weight", d, d, std, rng);
      layer.wo = matrix(p + "self_attn.o_proj.weight", d, d, out_std, rng);
      layer.mlp_norm = gain(p + "post_attention_layernorm.weight");
      layer.w_gate = matrix(p + "mlp.gate_proj.weight", F, d, std, rng);
      layer.w_up = matrix(p + "mlp.up_proj.weight", F, d, std, rng);
      layer.w_down = matrix(p + "mlp.down_proj.weight", d, F, out_std, rng);
      layers_.push_back(std::move(layer));
    }
    caches_.resize(static_cast<std::size_t>(config.layers));
  }

  const Config& config() const { return config_; }

  // Every parameter, in checkpoint order, each with its checkpoint name (Parameter::name()).
  std::vector<std::shared_ptr<Parameter<Scalar>>> parameters() const {
    std::vector<std::shared_ptr<Parameter<Scalar>>> list{embedding_.weight_ptr()};
    for (const auto& l : layers_)
      for (const auto& p : {l.attn_norm, l.wq, l.wk, l.wv, l.wo, l.mlp_norm, l.w_gate, l.w_up, l.w_down})
        list.push_back(p);
    list.push_back(final_norm_);
    list.push_back(head_.weight_ptr());
    return list;
  }

  // One training step's forward and backward: ids, targets [B, T] -> mean loss over the B*T
  // targets; every parameter's gradient += d loss / d parameter.
  double forward_backward(const embedhead::IdMatrix<std::int32_t>& ids,
                          const embedhead::IdMatrix<std::int32_t>& targets) {
    const Index B = ids.rows(), T = ids.cols(), N = B * T, d = config_.d;
    hidden(ids);
    dh_.resize(N, d);
    const double loss = loss_.forward_backward(head_, h_, targets, dh_).loss;  // dWout +=, dh_ written
    // Final norm, then the layers in reverse; dx_ carries d loss / d x (the residual stream).
    dx_.setZero(N, d);
    rms_norm_backward<Scalar>(dh_, x_, final_norm_->value(), inv_rms_, dx_, dense(final_norm_));
    for (Index l = config_.layers - 1; l >= 0; --l) layer_backward(l, B, T);
    embedding_.backward(ids, dx_);  // dE[ids] += dx_: the rows present only
    return loss;
  }

  // ids [B, T], targets [B, T] (ignore_index -1 skips a target) -> sum of the counted targets'
  // losses (nats) and their count. No gradient.
  std::pair<double, Index> loss_sum(const embedhead::IdMatrix<std::int32_t>& ids,
                                    const embedhead::IdMatrix<std::int32_t>& targets) {
    hidden(ids);
    embedhead::FusedHeadLossOptions options;
    options.reduction = embedhead::Reduction::sum;
    options.ignore_index = -1;
    embedhead::FusedHeadLoss<Scalar> loss(options);
    const auto result = loss.forward(head_, h_, targets);
    return {result.sum, result.count};
  }

  // ids [B, T] -> the final hidden states [B*T, d] (rmsnorm'd, before the head); also cached.
  const RowMatrix<Scalar>& hidden(const embedhead::IdMatrix<std::int32_t>& ids) {
    const Index B = ids.rows(), T = ids.cols(), N = B * T, d = config_.d;
    if (T > config_.context)
      throw std::invalid_argument("tiny_gpt: sequence length " + std::to_string(T) + " beyond the context " +
                                  std::to_string(config_.context));
    x_.resize(N, d);
    embedding_.forward(ids, x_);
    for (Index l = 0; l < config_.layers; ++l) layer_forward(l, B, T);
    h_.resize(N, d);
    inv_rms_.resize(N, 1);
    rms_norm_forward<Scalar>(x_, final_norm_->value(), config_.norm_eps, h_, inv_rms_);
    return h_;
  }

  // h [N, d] -> logits [N, V] = h Wout^T (for generation).
  RowMatrix<Scalar> logits(const ConstMatrixRef<Scalar>& h) const { return head_.forward(h); }

 private:
  std::shared_ptr<Parameter<Scalar>> gain(const std::string& name) {
    return std::make_shared<Parameter<Scalar>>(RowMatrix<Scalar>::Ones(config_.d, 1), name);
  }
  static std::shared_ptr<Parameter<Scalar>> table(const std::string& name, Index V, Index d, std::uint64_t seed) {
    embedhead::Rng rng(seed);
    return matrix(name, V, d, 0.02, rng);
  }
  static std::shared_ptr<Parameter<Scalar>> matrix(const std::string& name, Index rows, Index cols, double std,
                                                   embedhead::Rng& rng) {
    auto p = std::make_shared<Parameter<Scalar>>(rows, cols, name);
    embedhead::init_normal<Scalar>(p->value(), std, rng);
    return p;
  }
  // The full gradient of a dense parameter, to add into.
  static Eigen::Map<RowMatrix<Scalar>> dense(const std::shared_ptr<Parameter<Scalar>>& p) {
    return p->grad().dense_accumulator();
  }

  // x_ [N, d] -> x_ after layer l; the cache keeps what the backward needs.
  void layer_forward(Index l, Index B, Index T) {
    const Layer<Scalar>& w = layers_[static_cast<std::size_t>(l)];
    LayerCache<Scalar>& c = caches_[static_cast<std::size_t>(l)];
    const Index N = B * T, d = config_.d, H = config_.heads;
    c.x = x_;
    c.inv_rms1.resize(N, 1);
    c.a.resize(N, d);
    rms_norm_forward<Scalar>(c.x, w.attn_norm->value(), config_.norm_eps, c.a, c.inv_rms1);
    c.q.noalias() = c.a * w.wq->value().transpose();
    c.k.noalias() = c.a * w.wk->value().transpose();
    c.v.noalias() = c.a * w.wv->value().transpose();
    embedhead::rope_forward(rope_, c.q, H, T, 0);
    embedhead::rope_forward(rope_, c.k, H, T, 0);
    c.probs.resize(B * H * T, T);
    c.att.resize(N, d);
    attention_forward<Scalar>(c.q, c.k, c.v, B, T, H, c.probs, c.att);
    c.x_mid = c.x;
    c.x_mid.noalias() += c.att * w.wo->value().transpose();
    c.inv_rms2.resize(N, 1);
    c.m.resize(N, d);
    rms_norm_forward<Scalar>(c.x_mid, w.mlp_norm->value(), config_.norm_eps, c.m, c.inv_rms2);
    c.gate.noalias() = c.m * w.w_gate->value().transpose();
    c.up.noalias() = c.m * w.w_up->value().transpose();
    // silu(g) = g * sigmoid(g)
    c.act = (c.gate.array() / (Scalar(1) + (-c.gate.array()).exp()) * c.up.array()).matrix();
    x_ = c.x_mid;
    x_.noalias() += c.act * w.w_down->value().transpose();
  }

  // dx_ [N, d] = d loss / d (layer l's output) -> d loss / d (its input); weight gradients +=.
  void layer_backward(Index l, Index B, Index T) {
    const Layer<Scalar>& w = layers_[static_cast<std::size_t>(l)];
    const LayerCache<Scalar>& c = caches_[static_cast<std::size_t>(l)];
    const Index H = config_.heads;
    // MLP: out = act Wdown^T, act = silu(gate) * up.
    dense(w.w_down).noalias() += dx_.transpose() * c.act;
    d_act_.noalias() = dx_ * w.w_down->value();
    {
      sigmoid_ = (Scalar(1) / (Scalar(1) + (-c.gate.array()).exp())).matrix();
      const auto sig = sigmoid_.array();
      d_up_ = (d_act_.array() * c.gate.array() * sig).matrix();  // d/d up = silu(gate)
      // d silu(g) / dg = sig (1 + g (1 - sig))
      d_gate_ = (d_act_.array() * c.up.array() * sig * (Scalar(1) + c.gate.array() * (Scalar(1) - sig))).matrix();
    }
    dense(w.w_gate).noalias() += d_gate_.transpose() * c.m;
    dense(w.w_up).noalias() += d_up_.transpose() * c.m;
    d_norm_.noalias() = d_gate_ * w.w_gate->value();
    d_norm_.noalias() += d_up_ * w.w_up->value();
    // dx_ is now d loss / d x_mid: the residual path plus the norm's share.
    rms_norm_backward<Scalar>(d_norm_, c.x_mid, w.mlp_norm->value(), c.inv_rms2, dx_, dense(w.mlp_norm));
    // Attention: x_mid = x + att Wo^T.
    dense(w.wo).noalias() += dx_.transpose() * c.att;
    d_att_.noalias() = dx_ * w.wo->value();
    dq_.resize(c.q.rows(), c.q.cols());
    dk_.resize(c.k.rows(), c.k.cols());
    dv_.resize(c.v.rows(), c.v.cols());
    attention_backward<Scalar>(d_att_, c.q, c.k, c.v, c.probs, B, T, H, dq_, dk_, dv_, dS_);
    embedhead::rope_backward(rope_, dq_, H, T, 0);  // R^T: back to before the rotation
    embedhead::rope_backward(rope_, dk_, H, T, 0);
    dense(w.wq).noalias() += dq_.transpose() * c.a;
    dense(w.wk).noalias() += dk_.transpose() * c.a;
    dense(w.wv).noalias() += dv_.transpose() * c.a;
    d_norm_.noalias() = dq_ * w.wq->value();
    d_norm_.noalias() += dk_ * w.wk->value();
    d_norm_.noalias() += dv_ * w.wv->value();
    rms_norm_backward<Scalar>(d_norm_, c.x, w.attn_norm->value(), c.inv_rms1, dx_, dense(w.attn_norm));
  }

  Config config_;
  embedhead::TokenEmbedding<Scalar> embedding_;
  embedhead::OutputProjection<Scalar> head_;
  embedhead::RopeTable<Scalar> rope_;
  std::shared_ptr<Parameter<Scalar>> final_norm_;
  std::vector<Layer<Scalar>> layers_;
  std::vector<LayerCache<Scalar>> caches_;
  embedhead::FusedHeadLoss<Scalar> loss_;
  RowMatrix<Scalar> x_, h_, inv_rms_, dh_, dx_;                                             // [N, d], [N, 1]
  RowMatrix<Scalar> sigmoid_, d_act_, d_gate_, d_up_, d_norm_, d_att_, dq_, dk_, dv_, dS_;  // backward scratch
};

// ---- the checkpoint ----

// The configuration and the byte alphabet (id -> byte) as safetensors metadata strings.
inline std::map<std::string, std::string> config_metadata(const Config& c, const std::vector<unsigned char>& alphabet) {
  const auto real = [](double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%.17g", x);  // round-trips exactly
    return std::string(text);
  };
  static const char digits[] = "0123456789abcdef";
  std::string hex;
  for (const unsigned char byte : alphabet) {
    hex.push_back(digits[byte >> 4]);
    hex.push_back(digits[byte & 15]);
  }
  return {{"model_type", "embedhead_tiny_gpt"},
          {"vocab_size", std::to_string(c.V)},
          {"hidden_size", std::to_string(c.d)},
          {"num_hidden_layers", std::to_string(c.layers)},
          {"num_attention_heads", std::to_string(c.heads)},
          {"intermediate_size", std::to_string(c.ffn)},
          {"max_position_embeddings", std::to_string(c.context)},
          {"rope_theta", real(c.rope_theta)},
          {"rope_pairing", "half_split"},
          {"rms_norm_eps", real(c.norm_eps)},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", "false"},
          {"alphabet_hex", hex}};
}

// Writes every parameter (F32, under its Llama name; norm gains as vectors [d]) and the config.
// `extra` metadata (e.g. the held-out loss) is added beside it.
inline void save_model(const std::string& path, const Model<float>& model, const std::vector<unsigned char>& alphabet,
                       const std::map<std::string, std::string>& extra = {}) {
  embedhead::SafetensorsWriter writer;
  for (const auto& p : model.parameters())
    writer.add<float>(p->name(), std::shared_ptr<const Parameter<float>>(p), embedhead::DType::F32, p->cols() == 1);
  for (const auto& [key, value] : config_metadata(model.config(), alphabet)) writer.set_metadata(key, value);
  for (const auto& [key, value] : extra) writer.set_metadata(key, value);
  writer.write(path);
}

struct LoadedModel {
  std::unique_ptr<Model<float>> model;
  std::vector<unsigned char> alphabet;          // id -> byte
  std::map<std::string, std::string> metadata;  // everything the file's metadata holds
};

// Rebuilds the model save_model wrote. \throws std::runtime_error (or embedhead's format_error /
// shape_error, naming the tensor) for a missing key, a tensor of the wrong shape, or a file
// written by something else.
inline LoadedModel load_model(const std::string& path) {
  const auto file = embedhead::SafetensorsFile::open(path);
  const auto& meta = file.metadata();
  const auto field = [&](const std::string& key) -> const std::string& {
    const auto it = meta.find(key);
    if (it == meta.end()) throw std::runtime_error("tiny_gpt: '" + path + "' has no metadata '" + key + "'");
    return it->second;
  };
  if (field("model_type") != "embedhead_tiny_gpt" || field("rope_pairing") != "half_split" ||
      field("tie_word_embeddings") != "false" || field("hidden_act") != "silu")
    throw std::runtime_error("tiny_gpt: '" + path + "' is not a checkpoint of this model");
  // A metadata number, parsed whole, or an error naming the key.
  const auto number = [&](const std::string& key) {
    const std::string& text = field(key);
    std::size_t used = 0;
    double value = 0;
    try {
      value = std::stod(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != text.size())
      throw std::runtime_error("tiny_gpt: '" + path + "': metadata '" + key + "' = '" + text + "' is not a number");
    return value;
  };
  const auto integer = [&](const std::string& key) {
    const double value = number(key);
    if (value != std::floor(value) || value < 1 || value > 1e9)
      throw std::runtime_error("tiny_gpt: '" + path + "': metadata '" + key + "' is not an integer in [1, 1e9]");
    return static_cast<Index>(value);
  };
  Config c;
  c.V = integer("vocab_size");
  c.d = integer("hidden_size");
  c.layers = integer("num_hidden_layers");
  c.heads = integer("num_attention_heads");
  c.ffn = integer("intermediate_size");
  c.context = integer("max_position_embeddings");
  c.rope_theta = number("rope_theta");
  c.norm_eps = number("rms_norm_eps");
  LoadedModel out;
  const std::string& hex = field("alphabet_hex");
  if (static_cast<Index>(hex.size()) != 2 * c.V)
    throw std::runtime_error("tiny_gpt: '" + path + "': alphabet_hex does not hold vocab_size bytes");
  for (std::size_t i = 0; i < hex.size(); i += 2)
    out.alphabet.push_back(static_cast<unsigned char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  out.model = std::make_unique<Model<float>>(c, 0);
  for (const auto& p : out.model->parameters()) {
    const embedhead::TensorInfo& t = file.expect(p->name(), p->rows(), p->cols(), "tiny_gpt::load_model");
    file.read<float>(t, p->value());
  }
  out.metadata = meta;
  return out;
}

}  // namespace tiny_gpt

#endif  // EMBEDHEAD_EXAMPLES_TINY_GPT_HPP
