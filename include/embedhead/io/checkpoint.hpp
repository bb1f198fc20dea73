// embedhead: checkpoints -- this library's layers to and from safetensors files, under the
// tensor names Hugging Face models use, with the tied/untied rules checked (optimizer state: optimizer_state.hpp).
//
//   family  token table                                 positions     head
//   gpt2    wte.weight (or transformer.wte.weight)      wpe.weight    tied: no lm_head.weight
//   llama   model.embed_tokens.weight                   (rotary)      lm_head.weight, or tied
//   gemma   model.embed_tokens.weight, x Scalar(sqrt d) (rotary)      tied: no lm_head.weight
//
// The classic failure is a tied checkpoint loaded into an untied model (the head is left with
// whatever it had), or an untied one loaded into a tied model (one of the two trained matrices is
// silently dropped). Here both are errors that name the tensor and the reason; the embedding is
// never copied into the head, and a head is tied only by sharing the one Parameter.
//
// Loading is all-or-nothing: every tensor is checked (present, dtype, shape, finite values, the
// tying rule) before the first value is written, so a throw leaves every layer exactly as it was.
// Values are converted straight from the file's mapping into the layers' storage.
//
// Needs <embedhead/io/safetensors.hpp> (nlohmann/json, POSIX); not part of the umbrella header.
#ifndef EMBEDHEAD_IO_CHECKPOINT_HPP
#define EMBEDHEAD_IO_CHECKPOINT_HPP

#include "../output_projection.hpp"
#include "../parameter.hpp"
#include "../position_embedding.hpp"
#include "../token_embedding.hpp"
#include "safetensors.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace embedhead {

enum class ModelFamily { gpt2, llama, gemma };

inline const char* model_family_name(ModelFamily family) {
  switch (family) {
    case ModelFamily::gpt2: return "gpt2";
    case ModelFamily::llama: return "llama";
    case ModelFamily::gemma: return "gemma";
  }
  return "?";
}

// The tensor names of one layout. An empty name means the model has no such tensor.
struct CheckpointNames {
  std::string token_embedding;
  std::string position_embedding;  // learned positions (GPT-2); empty for rotary models
  std::string head_weight;         // absent from the file when the model is tied
  std::string head_bias;           // optional in the file; the usual layouts have none
  bool scale_by_sqrt_d = false;    // Gemma multiplies embeddings by Scalar(sqrt(d))
  bool tied_by_default = false;    // the family's config default for tie_word_embeddings
};

// The Hugging Face names of `family`. With a file, GPT-2's "transformer." prefix (as saved by
// GPT2LMHeadModel) is detected from the names present.
inline CheckpointNames hugging_face_names(ModelFamily family, const SafetensorsFile* file = nullptr) {
  CheckpointNames names;
  switch (family) {
    case ModelFamily::gpt2: {
      const bool prefixed = file && !file->contains("wte.weight") && file->contains("transformer.wte.weight");
      const std::string prefix = prefixed ? "transformer." : "";
      names.token_embedding = prefix + "wte.weight";
      names.position_embedding = prefix + "wpe.weight";
      names.head_weight = "lm_head.weight";
      names.head_bias = "lm_head.bias";
      names.tied_by_default = true;
      break;
    }
    case ModelFamily::llama:
    case ModelFamily::gemma:
      names.token_embedding = "model.embed_tokens.weight";
      names.head_weight = "lm_head.weight";
      names.head_bias = "lm_head.bias";
      names.scale_by_sqrt_d = family == ModelFamily::gemma;
      names.tied_by_default = family == ModelFamily::gemma;
      break;
  }
  return names;
}

// The layout whose token-table name the file has: gpt2 for (transformer.)wte.weight, llama for
// model.embed_tokens.weight. Gemma has Llama's names; only its config tells it apart (the sqrt(d)
// scale), so it is never guessed. \throws format_error naming the file if neither is present.
inline ModelFamily guess_model_family(const SafetensorsFile& file) {
  if (file.contains("wte.weight") || file.contains("transformer.wte.weight")) return ModelFamily::gpt2;
  if (file.contains("model.embed_tokens.weight")) return ModelFamily::llama;
  throw format_error("guess_model_family: '" + file.path() +
                     "' has neither 'wte.weight' (GPT-2) nor 'model.embed_tokens.weight' (Llama/Gemma); "
                     "pass the tensor names explicitly");
}

namespace detail {

// One checked tensor -> Parameter copy, applied only after every check of a load has passed.
template <typename Scalar>
struct PendingRead {
  const TensorInfo* tensor;
  Parameter<Scalar>* destination;
};

template <typename Scalar>
const TensorInfo& check_loadable(const SafetensorsFile& file, const std::string& name, const Parameter<Scalar>& p,
                                 const std::string& what) {
  const TensorInfo& t = file.expect(name, p.rows(), p.cols(), what);
  std::int64_t bad = file.first_non_finite(t);
  const char* problem = "a non-finite value";
  if (bad < 0 && std::is_same_v<Scalar, float> && t.dtype == DType::F64) {
    // Finite in the file but beyond float's range: it would load as an infinity.
    bad = first_beyond_float(file.raw(t), t.numel());
    problem = "an F64 value beyond float's range (it would become an infinity)";
  }
  if (bad >= 0) {
    std::ostringstream message;
    message << "load: tensor '" << name << "' in '" << file.path() << "' has " << problem << " at ";
    if (t.shape.size() == 2)
      message << "(" << static_cast<std::uint64_t>(bad) / t.shape[1] << ", "
              << static_cast<std::uint64_t>(bad) % t.shape[1] << ")";
    else
      message << "index " << bad;
    throw value_error(message.str());
  }
  return t;
}

// True when tensors a and b hold the same values once converted to Scalar; else the first
// differing (row, col) in `where`.
// \pre a and b are the file's tensors, of a convertible dtype, [rows, cols] with rows, cols >= 1.
template <typename Scalar>
bool same_values(const SafetensorsFile& file, const TensorInfo& a, const TensorInfo& b, Index rows, Index cols,
                 std::pair<Index, Index>& where) {
  RowMatrix<Scalar> row_a(1, cols), row_b(1, cols);
  // Row r of each is converted from the file's bytes (no allocation per row).
  const unsigned char* data_a = file.raw(a);
  const unsigned char* data_b = file.raw(b);
  const std::size_t bytes_a = static_cast<std::size_t>(cols) * dtype_bytes(a.dtype);
  const std::size_t bytes_b = static_cast<std::size_t>(cols) * dtype_bytes(b.dtype);
  for (Index r = 0; r < rows; ++r) {
    convert_stored_values<Scalar>(data_a + static_cast<std::size_t>(r) * bytes_a, a.dtype, row_a);
    convert_stored_values<Scalar>(data_b + static_cast<std::size_t>(r) * bytes_b, b.dtype, row_b);
    for (Index c = 0; c < cols; ++c)
      if (!(row_a(0, c) == row_b(0, c))) {
        where = {r, c};
        return false;
      }
  }
  return true;
}

}  // namespace detail

// Loads the token table, and the head and learned positions when given, from `file` under
// `names`, into existing layers of the right shapes.
// Tying rules (the head is tied when head->weight_ptr() == embedding.weight_ptr()):
//   tied head,   no head tensor in the file        -> the table serves both (nothing else to load)
//   tied head,   head tensor equal to the table    -> accepted (some exporters write both)
//   tied head,   head tensor different             -> shape/value_error: an untied checkpoint
//   untied head, head tensor present               -> loaded into the head
//   untied head, no head tensor                    -> value_error: a tied checkpoint; tie the
//                                                     head (tie_to) or pass another name
// A head bias must be in the file exactly when the head has one. The scale (Gemma's sqrt(d)) is a
// setting of the TokenEmbedding, checked against names.scale_by_sqrt_d.
// \throws format_error (missing tensor, dtype, bad file), shape_error (shapes), value_error
// (tying, bias, scale, non-finite values), each naming the tensor and the file. Every layer is
// unchanged on throw. Cost: one pass over the tensors read (two over a tied head tensor).
template <typename Scalar>
void load_checkpoint(const SafetensorsFile& file, const CheckpointNames& names, TokenEmbedding<Scalar>& embedding,
                     OutputProjection<Scalar>* head = nullptr, LearnedPositionEmbedding<Scalar>* positions = nullptr) {
  const std::string where = "load_checkpoint('" + file.path() + "')";
  std::vector<detail::PendingRead<Scalar>> pending;
  if (embedding.options().scale_by_sqrt_d != names.scale_by_sqrt_d)
    throw value_error(where + ": the layout " + (names.scale_by_sqrt_d ? "scales" : "does not scale") +
                      " embeddings by sqrt(d) but the TokenEmbedding " +
                      (embedding.options().scale_by_sqrt_d ? "does" : "does not"));
  const TensorInfo& table = detail::check_loadable(file, names.token_embedding, embedding.weight(),
                                                   "the token embedding");
  pending.push_back({&table, &embedding.weight()});

  if (positions) {
    if (names.position_embedding.empty())
      throw value_error(where + ": a position table was given but this layout has no learned positions");
    pending.push_back(
        {&detail::check_loadable(file, names.position_embedding, positions->weight(), "the position embedding"),
         &positions->weight()});
  }

  if (head) {
    const bool tied = head->is_tied_to(embedding);
    const TensorInfo* head_tensor = names.head_weight.empty() ? nullptr : file.find(names.head_weight);
    if (tied && head_tensor) {
      detail::check_loadable(file, names.head_weight, head->weight(), "the (tied) head");
      std::pair<Index, Index> differ{0, 0};
      if (!detail::same_values<Scalar>(file, table, *head_tensor, embedding.vocab_size(), embedding.dim(), differ)) {
        std::ostringstream message;
        message << where << ": the head is tied to the token embedding, but '" << names.head_weight
                << "' differs from '" << names.token_embedding << "' at (" << differ.first << ", " << differ.second
                << "): this is an untied checkpoint. Build an untied head (OutputProjection(V, d)) to load both";
        throw value_error(message.str());
      }
    } else if (!tied && !head_tensor) {
      throw value_error(where + ": the head is untied but the file has no '" + names.head_weight +
                        "': this is a tied checkpoint (the table '" + names.token_embedding +
                        "' is also the head). Tie the head with tie_to(embedding) instead of loading a copy");
    } else if (!tied) {
      pending.push_back(
          {&detail::check_loadable(file, names.head_weight, head->weight(), "the head weight"), &head->weight()});
    }
    const TensorInfo* bias_tensor = names.head_bias.empty() ? nullptr : file.find(names.head_bias);
    if (head->bias() && !bias_tensor)
      throw value_error(where + ": the head has a bias [" + std::to_string(head->vocab_size()) +
                        "] but the file has no '" +
                        (names.head_bias.empty() ? std::string("<bias>") : names.head_bias) + "'");
    if (!head->bias() && bias_tensor)
      throw value_error(where + ": the file has '" + names.head_bias +
                        "' but the head has no bias (build it with OutputProjectionOptions::bias = true)");
    if (bias_tensor)
      pending.push_back({&detail::check_loadable(file, names.head_bias, *head->bias(), "the head bias"), head->bias()});
  }

  // Every check passed: write.
  for (const auto& read : pending) file.read<Scalar>(*read.tensor, read.destination->value());
}

// The layers of a pretrained model's two ends, built from a file.
template <typename Scalar>
struct PretrainedLayers {
  TokenEmbedding<Scalar> token_embedding;
  OutputProjection<Scalar> head;
  std::optional<LearnedPositionEmbedding<Scalar>> position_embedding;  // GPT-2 only
  bool tied = false;
};

struct PretrainedOptions {
  // As the model's config.json: unset takes "tied iff the file has no head tensor". true with a
  // head tensor that differs from the table, or false without one, is an error (see
  // load_checkpoint).
  std::optional<bool> tie_word_embeddings;
  std::optional<Index> padding_idx;  // passed to the TokenEmbedding
  // Freeze every loaded parameter (table, head weight and bias, positions), as PyTorch's
  // Embedding.from_pretrained(freeze=True): no gradient is accumulated, optimizers skip them.
  // Unfreeze a layer with set_frozen(false).
  bool freeze = false;
};

// Builds the token embedding, the head (tied or untied as the file and options say) and, for
// GPT-2, the learned positions, shaped from the file, and loads them. \throws as load_checkpoint.
template <typename Scalar>
PretrainedLayers<Scalar> from_pretrained(const SafetensorsFile& file, const CheckpointNames& names,
                                         const PretrainedOptions& options = {}) {
  const TensorInfo& table = file.at(names.token_embedding);
  if (table.shape.size() != 2 || table.shape[0] < 1 || table.shape[1] < 1)
    throw shape_error("from_pretrained: tensor '" + names.token_embedding + "' in '" + file.path() + "' is " +
                      table.shape_string() + "; a token table is [V, d] with V, d >= 1");
  const Index V = static_cast<Index>(table.shape[0]), d = static_cast<Index>(table.shape[1]);
  const bool has_head_tensor = !names.head_weight.empty() && file.contains(names.head_weight);
  const bool tied = options.tie_word_embeddings.value_or(!has_head_tensor);

  TokenEmbeddingOptions embedding_options;
  embedding_options.scale_by_sqrt_d = names.scale_by_sqrt_d;
  embedding_options.padding_idx = options.padding_idx;
  TokenEmbedding<Scalar> embedding(std::make_shared<Parameter<Scalar>>(V, d, "token_embedding.weight"),
                                   embedding_options);

  std::shared_ptr<Parameter<Scalar>> bias;
  if (!tied && !names.head_bias.empty() && file.contains(names.head_bias))
    bias = std::make_shared<Parameter<Scalar>>(V, 1, "lm_head.bias");
  OutputProjection<Scalar> head = tied ? OutputProjection<Scalar>(embedding)
                                       : OutputProjection<Scalar>(std::make_shared<Parameter<Scalar>>(V, d,
                                                                                                      "lm_head.weight"),
                                                                  bias);

  std::optional<LearnedPositionEmbedding<Scalar>> positions;
  if (!names.position_embedding.empty() && file.contains(names.position_embedding)) {
    const TensorInfo& p = file.at(names.position_embedding);
    if (p.shape.size() != 2 || p.shape[0] < 1 || p.shape[1] != static_cast<std::uint64_t>(d))
      throw shape_error("from_pretrained: tensor '" + names.position_embedding + "' in '" + file.path() + "' is " +
                        p.shape_string() + "; positions are [T_max, d] with d = " + std::to_string(d));
    positions.emplace(
        std::make_shared<Parameter<Scalar>>(static_cast<Index>(p.shape[0]), d, "position_embedding.weight"));
  }
  load_checkpoint<Scalar>(file, names, embedding, &head, positions ? &*positions : nullptr);
  if (options.freeze) {
    embedding.weight().set_frozen(true);
    head.weight().set_frozen(true);
    if (head.bias()) head.bias()->set_frozen(true);
    if (positions) positions->weight().set_frozen(true);
  }
  return PretrainedLayers<Scalar>{std::move(embedding), std::move(head), std::move(positions), tied};
}

// Adds the layers to `writer` under `names`: the table, the positions if given, and the head's W
// only when it is untied (head->is_tied_to(embedding) is false: a tied head is the table; writing
// it twice would make the file look untied to tools that do not compare), and its bias if it has
// one. Metadata {"format": "pt"} as transformers writes, and "embedhead.tied". `dtype` is the
// stored type (F32, F64, F16 or BF16). The writer shares the layers' Parameters (no copy; they
// stay alive as long as the writer does) and writes their values as they are when write() runs,
// in the shapes they have now: a parameter resized in between (resize_vocabulary, resize_rows)
// makes write() throw shape_error naming the tensor and both shapes, and nothing is written; add
// the resized layers to a new writer instead.
// \throws value_error for positions with a layout that has no position name, and as
// SafetensorsWriter::add (a name added before, or not UTF-8); the writer is unchanged on throw.
// write() throws value_error for a value that `dtype` cannot hold (e.g. 1e5 as F16).
template <typename Scalar>
void add_checkpoint(SafetensorsWriter& writer, const CheckpointNames& names, const TokenEmbedding<Scalar>& embedding,
                    const OutputProjection<Scalar>* head = nullptr,
                    const LearnedPositionEmbedding<Scalar>* positions = nullptr, DType dtype = DType::F32) {
  if (positions && names.position_embedding.empty())
    throw value_error("save_checkpoint: a position table was given but this layout has no position tensor name");
  SafetensorsWriter staged = writer;  // all or nothing: the entries are added to a copy, then swapped in
  staged.set_metadata("format", "pt");
  staged.add<Scalar>(names.token_embedding, embedding.weight_ptr(), dtype);
  if (positions) staged.add<Scalar>(names.position_embedding, positions->weight_ptr(), dtype);
  const bool tied = head && head->is_tied_to(embedding);
  if (head && !tied) staged.add<Scalar>(names.head_weight, head->weight_ptr(), dtype);
  // A bias is the head's own even when W is shared (load_checkpoint asks for it exactly when the
  // head has one).
  if (head && head->bias()) staged.add<Scalar>(names.head_bias, head->bias_ptr(), dtype, /*as_vector=*/true);
  staged.set_metadata("embedhead.tied", tied ? "true" : "false");
  writer = std::move(staged);
}

// add_checkpoint into a new file at `path` (written atomically, see SafetensorsWriter::write).
// \throws as add_checkpoint, value_error for a value that `dtype` cannot hold (naming the tensor,
// the value and its (row, col)), and io_error; nothing at `path` changes on throw.
template <typename Scalar>
void save_checkpoint(const std::string& path, const CheckpointNames& names, const TokenEmbedding<Scalar>& embedding,
                     const OutputProjection<Scalar>* head = nullptr,
                     const LearnedPositionEmbedding<Scalar>* positions = nullptr, DType dtype = DType::F32) {
  SafetensorsWriter writer;
  add_checkpoint<Scalar>(writer, names, embedding, head, positions, dtype);
  writer.write(path);
}

}  // namespace embedhead

#endif  // EMBEDHEAD_IO_CHECKPOINT_HPP
