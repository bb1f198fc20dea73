// embedhead-inspect: what a token table (or an LM head) looks like.
//
// Reads a safetensors checkpoint, finds the token table (GPT-2, Llama and Gemma names are guessed;
// --table / --head name any other), says whether the head is tied, and prints the geometry of the
// chosen matrix: row norms, distances to the centroid, anisotropy (mean pairwise cosine), the top
// principal directions, and the tokens most likely to be under-trained (Land & Bartolo 2024,
// "Fishing for Magikarp"). Answers nearest-neighbour queries and writes an HTML/SVG report.
// With --compare-head A B it runs two heads on the same hidden states instead and prints how far
// apart their output distributions are (analysis/head_comparison.hpp), streaming.
//
// stdout carries the results; stderr carries errors and the progress bar. Exit status: 0 on
// success, 1 for an error in the data or a file, 2 for a command-line mistake.
#include "progress.hpp"
#include "report.hpp"
#include "text.hpp"

#include <embedhead/analysis/geometry.hpp>
#include <embedhead/analysis/head_comparison.hpp>
#include <embedhead/io/checkpoint.hpp>
#include <embedhead/io/safetensors.hpp>
#include <embedhead/low_precision.hpp>
#include <embedhead/output_projection.hpp>
#include <embedhead/quantized_head.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace embedhead;
using inspect::escape_token;
using inspect::format;
using inspect::thousands;
using inspect::usage_error;

constexpr const char* kUsage = R"(usage: embedhead-inspect FILE.safetensors [options]
       embedhead-inspect --compare-head A B [--hidden FILE[:TENSOR] | --tokens N] [--head NAME] [--family F]

Inspects the token table (or the LM head) of a safetensors checkpoint: summary statistics,
under-trained token candidates, nearest neighbours, and an HTML/SVG report.

Which matrix:
  --table NAME         the token table tensor (default: guessed from GPT-2 / Llama / Gemma names)
  --head NAME          the head (unembedding) tensor (default: lm_head.weight when present;
                       without one the model is tied and the head is the table)
  --family F           use the names of layout F (gpt2, llama, gemma) instead of guessing
  --use table|head     analyse the token table (default) or the head; for a tied model they are
                       the same matrix

Summary and under-trained tokens:
  --top N              list the N strongest under-trained candidates (default 20)
  --unused IDS         known-unused token ids (e.g. 3,17,42): candidates are then ranked by the
                       Magikarp score (projection on the mean direction of these rows after
                       removing the first principal component); the ids themselves are not listed
  --unused-file FILE   the same, ids read from FILE (separated by commas or whitespace)
                       Without either, candidates are ranked by ascending distance to the centroid.
  --components K       principal directions to compute (default 8, at least 2)

Neighbours:
  --neighbours IDS     print the K nearest rows (cosine similarity) of each id
  --k K                neighbours per id (default 10)
  --vocab FILE         token strings, one per line (line i is id i), printed beside ids

Report:
  --html FILE          a self-contained HTML report (inline SVG; no scripts or external files)
  --svg PREFIX         the figures as PREFIX-norms.svg, PREFIX-centroid.svg, PREFIX-pca.svg
  --title TEXT         the report's title (default: the file name)
  --max-points N       at most N tokens in the PCA scatter (default 20000; a fixed-seed sample)

Comparing two heads (instead of the above):
  --compare-head A B   run head A and head B on the same hidden states and print, over the states,
                       the mean and max KL(P_A || P_B) in nats (A is the reference), how often their
                       top-1 ids agree, and |P_A - P_B| at A's top id (mean, max). Streaming: a few
                       states at a time, no [N, V] logits kept. A and B are each FILE.safetensors
                       (its head: --head NAME, else the family's head tensor, else the tied table;
                       --family applies) or FILE.safetensors:TENSOR; B may also be 'int8' (A's rows
                       quantized to int8 with a float scale each) or 'bf16' (A rounded to bf16).
                       Heads are taken without a bias.
  --hidden FILE[:T]    the hidden states [N, d], tensor T of FILE (default 'hidden_states')
  --tokens N           without --hidden: N states drawn from N(0, 1), seeded (default 1024); they
                       say less about a trained model than its own hidden states do

Other:
  --progress           draw progress bars on stderr even when it is not a terminal
  --no-progress        never draw them (default: draw when stderr is a terminal)
  -h, --help           this text

Exit status: 0 success, 1 error in a file or its data, 2 command-line error.
)";

struct Options {
  std::string file;
  std::optional<std::string> table, head, family;
  bool use_head = false;
  Index top = 20;
  std::vector<Index> unused;
  std::string unused_source;  // "--unused" or "--unused-file FILE", for messages
  std::vector<Index> neighbours;
  Index k = 10;
  Index components = 8;
  std::optional<std::string> vocab, html, svg, title;
  Index max_points = 20000;
  int progress = -1;                 // -1 auto, 0 never, 1 always
  std::vector<std::string> compare;  // --compare-head A B
  std::optional<std::string> hidden;
  Index tokens = 1024;
};

Index parse_count(const std::string& option, const std::string& value, Index min) {
  const auto ids = inspect::parse_ids(value, option);
  if (ids.size() != 1 || ids[0] < min)
    throw usage_error(option + ": expected one integer >= " + std::to_string(min) + ", got '" + value + "'");
  return ids[0];
}

Options parse_options(int argc, char** argv) {
  Options o;
  const auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw usage_error(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--table")
      o.table = value(i);
    else if (a == "--head")
      o.head = value(i);
    else if (a == "--family") {
      o.family = value(i);
      if (*o.family != "gpt2" && *o.family != "llama" && *o.family != "gemma")
        throw usage_error("--family: '" + *o.family + "' is not one of gpt2, llama, gemma");
    } else if (a == "--use") {
      const std::string v = value(i);
      if (v != "table" && v != "head") throw usage_error("--use: '" + v + "' is not 'table' or 'head'");
      o.use_head = v == "head";
    } else if (a == "--top")
      o.top = parse_count(a, value(i), 0);
    else if (a == "--unused") {
      const auto ids = inspect::parse_ids(value(i), a);
      o.unused.insert(o.unused.end(), ids.begin(), ids.end());
      o.unused_source = "--unused";
    } else if (a == "--unused-file") {
      const std::string path = value(i);
      const auto ids = inspect::parse_ids(inspect::read_text_file(path, a), a + " " + path);
      o.unused.insert(o.unused.end(), ids.begin(), ids.end());
      o.unused_source = "--unused-file " + path;
    } else if (a == "--neighbours" || a == "--neighbors") {
      const auto ids = inspect::parse_ids(value(i), a);
      o.neighbours.insert(o.neighbours.end(), ids.begin(), ids.end());
    } else if (a == "--k")
      o.k = parse_count(a, value(i), 1);
    else if (a == "--components")
      o.components = parse_count(a, value(i), 2);
    else if (a == "--vocab")
      o.vocab = value(i);
    else if (a == "--html")
      o.html = value(i);
    else if (a == "--svg")
      o.svg = value(i);
    else if (a == "--title")
      o.title = value(i);
    else if (a == "--max-points")
      o.max_points = parse_count(a, value(i), 1);
    else if (a == "--compare-head") {
      o.compare.push_back(value(i));
      o.compare.push_back(value(i));
    } else if (a == "--hidden")
      o.hidden = value(i);
    else if (a == "--tokens")
      o.tokens = parse_count(a, value(i), 1);
    else if (a == "--progress")
      o.progress = 1;
    else if (a == "--no-progress")
      o.progress = 0;
    else if (a.size() > 1 && a[0] == '-')
      throw usage_error("unknown option '" + a + "'");
    else if (o.file.empty())
      o.file = a;
    else
      throw usage_error("more than one input file ('" + o.file + "' and '" + a + "')");
  }
  if (!o.compare.empty()) {
    if (!o.file.empty())
      throw usage_error("--compare-head A B takes its files itself; '" + o.file + "' is one too many");
    if (o.compare[0] == "int8" || o.compare[0] == "bf16")
      throw usage_error("--compare-head: A must be a file (the reference head); '" + o.compare[0] + "' is B's form");
    return o;
  }
  if (o.hidden || o.tokens != 1024) throw usage_error("--hidden and --tokens go with --compare-head");
  if (o.file.empty()) throw usage_error("no input file");
  if (o.unused.empty() && !o.unused_source.empty()) throw usage_error(o.unused_source + ": no ids given");
  return o;
}

// The 2-D tensors of a file (the possible tables), for error messages.
std::string list_tables(const SafetensorsFile& file) {
  std::ostringstream out;
  std::size_t shown = 0, matrices = 0;
  for (const TensorInfo& t : file.tensors())
    if (t.shape.size() == 2) {
      ++matrices;
      if (shown < 25) {
        out << "\n  " << t.name << " " << t.shape_string() << " " << dtype_name(t.dtype);
        ++shown;
      }
    }
  if (matrices > shown) out << "\n  ... and " << matrices - shown << " more";
  if (matrices == 0) return " none (the file has " + std::to_string(file.tensors().size()) + " tensors, no 2-D one)";
  return out.str();
}

const TensorInfo& find_matrix(const SafetensorsFile& file, const std::string& name, const std::string& what) {
  const TensorInfo* t = file.find(name);
  if (!t)
    throw format_error(what + " '" + name + "' is not in '" + file.path() +
                       "'; its 2-D tensors are:" + list_tables(file));
  if (t->shape.size() != 2 || t->shape[0] < 1 || t->shape[1] < 1)
    throw shape_error(what + " '" + name + "' in '" + file.path() + "' is " + t->shape_string() +
                      "; a table is [V, d] with V, d >= 1");
  return *t;
}

void check_ids(const std::vector<Index>& ids, Index V, const std::string& option) {
  for (const Index id : ids)
    if (id < 0 || id >= V)
      throw index_error(option + ": id " + std::to_string(id) + " outside [0, " + std::to_string(V) + ")");
}

std::string token_of(const std::vector<std::string>& vocab, Index id) {
  if (id < 0 || static_cast<std::size_t>(id) >= vocab.size()) return {};
  return escape_token(vocab[static_cast<std::size_t>(id)]);
}

// Up to `max_points` ids for the scatter: all of them when V is small enough, otherwise a
// fixed-seed partial Fisher-Yates shuffle (embedhead::Rng, the same on every platform), with
// every candidate added; sorted.
std::vector<Index> scatter_ids(Index V, Index max_points, const std::vector<Index>& candidates) {
  std::vector<Index> ids(static_cast<std::size_t>(V));
  for (Index v = 0; v < V; ++v) ids[static_cast<std::size_t>(v)] = v;
  if (V <= max_points) return ids;
  Rng rng(20240);
  for (Index i = 0; i < max_points; ++i) {
    const auto j = i + static_cast<Index>(rng.next_bits() % static_cast<std::uint64_t>(V - i));
    std::swap(ids[static_cast<std::size_t>(i)], ids[static_cast<std::size_t>(j)]);
  }
  ids.resize(static_cast<std::size_t>(max_points));
  ids.insert(ids.end(), candidates.begin(), candidates.end());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

std::string quantile_row(const char* label, const std::array<double, 5>& q) {
  return format("  %-20s %10.4f %10.4f %10.4f %10.4f %10.4f\n", label, q[0], q[1], q[2], q[3], q[4]);
}

// "FILE.safetensors:NAME" -> {FILE.safetensors, NAME}; anything else -> {it, ""}.
std::pair<std::string, std::string> split_tensor_spec(const std::string& spec) {
  const std::string suffix = ".safetensors:";
  const std::size_t at = spec.rfind(suffix);
  if (at == std::string::npos) return {spec, ""};
  return {spec.substr(0, at + suffix.size() - 1), spec.substr(at + suffix.size())};
}

// The head of a checkpoint: the tensor named in the spec, else --head, else the family's head
// tensor when the file has it, else (tied) the token table. -> its name.
std::string head_tensor_name(const SafetensorsFile& file, const std::string& named, const Options& o) {
  if (!named.empty()) return named;
  if (o.head) return *o.head;
  ModelFamily family = ModelFamily::gpt2;
  if (o.family)
    family = *o.family == "gpt2" ? ModelFamily::gpt2 : *o.family == "llama" ? ModelFamily::llama : ModelFamily::gemma;
  else
    try {
      family = guess_model_family(file);
    } catch (const format_error&) {
      throw format_error("'" + file.path() +
                         "' has neither GPT-2 nor Llama/Gemma names; name the head as FILE.safetensors:TENSOR or "
                         "with --head NAME. Its 2-D tensors are:" +
                         list_tables(file));
    }
  const CheckpointNames names = hugging_face_names(family, &file);
  return file.contains(names.head_weight) ? names.head_weight : names.token_embedding;
}

struct LoadedHead {
  std::string description;
  RowMatrix<float> W;
};

LoadedHead load_head(const std::string& spec, const Options& o) {
  const auto [path, named] = split_tensor_spec(spec);
  const SafetensorsFile file = SafetensorsFile::open(path);
  const std::string name = head_tensor_name(file, named, o);
  const TensorInfo& t = find_matrix(file, name, "head");
  return {file.path() + "  " + t.name + " " + t.shape_string() + " " + dtype_name(t.dtype), file.read<float>(t.name)};
}

int run_compare(const Options& o) {
  const LoadedHead a = load_head(o.compare[0], o);
  const Index V = a.W.rows(), d = a.W.cols();
  const std::string& form = o.compare[1];
  std::optional<LoadedHead> b;
  std::string b_description;
  if (form == "int8") {
    b_description = "int8 rounding of A (one float scale per row)";
  } else if (form == "bf16") {
    b_description = "bf16 rounding of A";
  } else {
    b = load_head(form, o);
    b_description = b->description;
    if (b->W.rows() != V || b->W.cols() != d)
      throw shape_error("--compare-head: head B is [" + std::to_string(b->W.rows()) + ", " +
                        std::to_string(b->W.cols()) + "], head A [" + std::to_string(V) + ", " + std::to_string(d) +
                        "]: the heads must have the same shape");
  }
  RowMatrix<float> h;
  std::string hidden_description;
  if (o.hidden) {
    auto [path, name] = split_tensor_spec(*o.hidden);
    if (name.empty()) name = "hidden_states";
    const SafetensorsFile file = SafetensorsFile::open(path);
    const TensorInfo& t = find_matrix(file, name, "hidden states");
    if (t.shape[1] != static_cast<std::uint64_t>(d))
      throw shape_error("--hidden: '" + name + "' in '" + file.path() + "' is " + t.shape_string() +
                        "; the heads take d = " + std::to_string(d) + " columns");
    h = file.read<float>(name);
    hidden_description = file.path() + "  " + name + " " + t.shape_string() + " " + dtype_name(t.dtype);
  } else {
    h.resize(o.tokens, d);
    Rng rng(20241);
    init_normal<float>(h, 1.0, rng);
    hidden_description = std::to_string(o.tokens) + " states from N(0, 1), seed 20241 (not a model's own states)";
  }

  const RowMatrix<float> no_bias(0, 1);
  const auto float_head = [&](const RowMatrix<float>& W) {
    return [&W, &no_bias](const ConstMatrixRef<float>& x, MatrixRef<float> logits) {
      output_projection_forward<float>(x, W, no_bias, logits);
    };
  };
  HeadComparison c;
  if (form == "int8") {
    const QuantizedOutputProjection int8(a.W);
    c = compare_heads(h, V, float_head(a.W),
                      [&](const ConstMatrixRef<float>& x, MatrixRef<float> logits) { int8.forward(x, logits); });
  } else if (form == "bf16") {
    LowPrecisionOutputProjection<Eigen::bfloat16> bf16(RowMatrix<Eigen::bfloat16>(a.W.cast<Eigen::bfloat16>()));
    c = compare_heads(h, V, float_head(a.W),
                      [&](const ConstMatrixRef<float>& x, MatrixRef<float> logits) { bf16.forward(x, logits); });
  } else {
    c = compare_heads(h, V, float_head(a.W), float_head(b->W));
  }
  std::printf("A             %s\n", a.description.c_str());
  std::printf("B             %s\n", b_description.c_str());
  std::printf("hidden        %s\n", hidden_description.c_str());
  std::printf("\nover %lld states, V = %lld:\n", static_cast<long long>(c.tokens), static_cast<long long>(V));
  std::printf("mean KL       %.6g nats   (KL(P_A || P_B), A the reference)\n", c.mean_kl);
  std::printf("max KL        %.6g nats\n", c.max_kl);
  std::printf("same top-1    %.3f %%\n", 100 * c.same_top1);
  std::printf("|delta p|     mean %.6g, max %.6g   (|P_A - P_B| at A's top id)\n", c.mean_abs_dp_top, c.max_abs_dp_top);
  return 0;
}

int run(int argc, char** argv) {
  const Options o = parse_options(argc, argv);
  if (!o.compare.empty()) return run_compare(o);
  const bool draw_progress = o.progress == 1 || (o.progress == -1 && ::isatty(STDERR_FILENO));

  const SafetensorsFile file = SafetensorsFile::open(o.file);

  // ---- which tensors ----
  std::string table_name, head_name, layout;
  if (o.table) {
    table_name = *o.table;
    layout = "given by --table";
    if (o.family) layout = *o.family;
  } else {
    ModelFamily family = ModelFamily::gpt2;
    if (o.family) {
      family = *o.family == "gpt2" ? ModelFamily::gpt2 : *o.family == "llama" ? ModelFamily::llama : ModelFamily::gemma;
      layout = *o.family + " (from --family)";
    } else {
      try {
        family = guess_model_family(file);
      } catch (const format_error&) {
        throw format_error(
            "'" + file.path() +
            "' has neither GPT-2 ('wte.weight') nor Llama/Gemma "
            "('model.embed_tokens.weight') names; choose the table with --table NAME. Its 2-D tensors are:" +
            list_tables(file));
      }
      layout = std::string(model_family_name(family)) + " (guessed from the tensor names)";
    }
    const CheckpointNames names = hugging_face_names(family, &file);
    table_name = names.token_embedding;
    if (!o.head) head_name = names.head_weight;
  }
  if (o.head)
    head_name = *o.head;
  else if (head_name.empty())
    head_name = "lm_head.weight";  // --table without --head: the usual name

  const TensorInfo& table = find_matrix(file, table_name, "token table");
  const TensorInfo* head = nullptr;
  if (o.head)
    head = &find_matrix(file, head_name, "head");  // named explicitly: must exist
  else if (file.contains(head_name))
    head = &find_matrix(file, head_name, "head");
  const bool tied = head == nullptr;
  if (head && head->shape != table.shape)
    std::fprintf(stderr, "embedhead-inspect: note: head '%s' is %s, the table %s\n", head->name.c_str(),
                 head->shape_string().c_str(), table.shape_string().c_str());
  const TensorInfo& chosen = (o.use_head && head) ? *head : table;

  std::printf("file          %s\n", file.path().c_str());
  std::printf("layout        %s\n", layout.c_str());
  std::printf("token table   %s %s %s\n", table.name.c_str(), table.shape_string().c_str(), dtype_name(table.dtype));
  if (tied)
    std::printf("head          tied: no '%s' tensor, the head is the token table\n", head_name.c_str());
  else
    std::printf("head          untied: %s %s %s\n", head->name.c_str(), head->shape_string().c_str(),
                dtype_name(head->dtype));
  std::printf("analysing     %s%s\n", chosen.name.c_str(),
              o.use_head ? (tied ? " (the head; tied, so the table)" : " (the head / unembedding)")
                         : " (the token table)");

  // ---- load and check the ids against V ----
  RowMatrix<float> M;
  {
    inspect::ProgressPass pass(draw_progress, "reading " + chosen.name);
    M = file.read<float>(chosen.name);
  }
  const Index V = M.rows(), d = M.cols();
  if (V < 2) throw value_error("'" + chosen.name + "' has V = " + std::to_string(V) + " row; at least 2 are needed");
  check_ids(o.unused, V, o.unused_source.empty() ? "--unused" : o.unused_source);
  check_ids(o.neighbours, V, "--neighbours");
  std::vector<std::string> vocab;
  if (o.vocab) {
    vocab = inspect::read_vocab(*o.vocab);
    if (static_cast<Index>(vocab.size()) != V)
      std::fprintf(stderr, "embedhead-inspect: note: --vocab %s has %zu lines for V = %lld rows\n", o.vocab->c_str(),
                   vocab.size(), static_cast<long long>(V));
  }
  std::vector<Index> unused = o.unused;
  std::sort(unused.begin(), unused.end());
  unused.erase(std::unique(unused.begin(), unused.end()), unused.end());

  // ---- the summary ----
  SummaryOptions summary_options;
  summary_options.components = std::min(o.components, d);
  TableSummary summary;
  {
    inspect::ProgressPass pass(draw_progress, "summary");
    summary = summarize_table<float>(M, summary_options, pass.callback());
  }
  UndertrainedScores scores;
  {
    inspect::ProgressPass pass(draw_progress, "under-trained scores");
    scores = undertrained_scores<float>(M, unused, pass.callback());
  }
  const bool magikarp = !unused.empty();
  std::vector<Index> candidates;
  for (const Index id : scores.ranking) {
    if (static_cast<Index>(candidates.size()) >= std::min(o.top, V)) break;
    if (!std::binary_search(unused.begin(), unused.end(), id)) candidates.push_back(id);
  }
  const auto score_of = [&](Index id) { return magikarp ? scores.magikarp(id) : scores.centroid_distance(id); };

  std::printf("\nV = %lld, d = %lld, dtype %s, %s\n", static_cast<long long>(V), static_cast<long long>(d),
              dtype_name(chosen.dtype), tied ? "tied" : "untied");
  std::printf("\n  %-20s %10s %10s %10s %10s %10s\n", "", "min", "25%", "median", "75%", "max");
  std::fputs(quantile_row("row norm", summary.norm_quantiles).c_str(), stdout);
  std::fputs(quantile_row("centroid distance", summary.centroid_distance_quantiles).c_str(), stdout);
  std::printf("\ncentroid norm                       %.4f\n", summary.centroid_norm);
  std::printf("anisotropy (mean pairwise cosine)   %.4f\n", summary.mean_pairwise_cosine);
  const PrincipalComponents& pcs = summary.pcs;
  std::printf("principal directions (explained variance):");
  double cumulative = 0;
  for (Index j = 0; j < pcs.explained.size(); ++j) {
    cumulative += pcs.explained(j);
    std::printf(" PC%lld %.2f%%", static_cast<long long>(j + 1), 100 * pcs.explained(j));
  }
  std::printf("  (top %lld together: %.2f%%)\n", static_cast<long long>(pcs.explained.size()), 100 * cumulative);

  const std::string rule = magikarp
                               ? "ranked by the Magikarp score (higher = more likely under-trained) against " +
                                     std::to_string(unused.size()) + " known-unused ids, which are not listed"
                               : "ranked by ascending distance to the centroid (pass --unused for the Magikarp score)";
  const char* score_name = magikarp ? "magikarp" : "";
  std::printf("\ntop %zu under-trained candidates, %s:\n", candidates.size(), rule.c_str());
  std::printf("  %5s %8s %10s %14s%s  %s\n", "rank", "id", "norm", "centroid dist", magikarp ? "       magikarp" : "",
              vocab.empty() ? "" : "token");
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const Index id = candidates[i];
    const std::string token = token_of(vocab, id);
    std::printf("  %5zu %8lld %10.4f %14.4f%s  %s\n", i + 1, static_cast<long long>(id), scores.norm(id),
                scores.centroid_distance(id), magikarp ? format(" %14.6g", score_of(id)).c_str() : "",
                vocab.empty() ? "" : ("'" + token + "'").c_str());
  }

  // ---- neighbours ----
  if (!o.neighbours.empty()) {
    const Index k = std::min(o.k, V - 1);
    Neighbours nb;
    {
      inspect::ProgressPass pass(draw_progress, "neighbours");
      nb = nearest_neighbours_of_rows<float>(M, o.neighbours, k, Similarity::cosine, pass.callback());
    }
    for (std::size_t q = 0; q < o.neighbours.size(); ++q) {
      const Index id = o.neighbours[q];
      std::printf("\nneighbours of %lld%s (cosine):\n", static_cast<long long>(id),
                  vocab.empty() ? "" : (" '" + token_of(vocab, id) + "'").c_str());
      for (Index j = 0; j < k; ++j) {
        const Index n = nb.ids(static_cast<Index>(q), j);
        if (n < 0) break;
        std::printf("  %3lld. %8lld  %8.4f%s\n", static_cast<long long>(j + 1), static_cast<long long>(n),
                    nb.scores(static_cast<Index>(q), j),
                    vocab.empty() ? "" : ("  '" + token_of(vocab, n) + "'").c_str());
      }
    }
  }

  // ---- the report ----
  if (o.html || o.svg) {
    inspect::ReportData r;
    const std::string base = file.path().substr(file.path().find_last_of('/') + 1);
    r.title = o.title ? *o.title : "Embedding report: " + base;
    r.subtitle = file.path() + "  -  " + chosen.name + " " + chosen.shape_string() + " " + dtype_name(chosen.dtype) +
                 (tied ? ", tied head" : ", untied head") + (o.use_head && head ? " (analysing the head)" : "");
    r.V = V;
    r.norms = summary.norms;
    r.distances = summary.centroid_distances;
    r.candidates = candidates;
    r.candidate_rule = rule;
    r.score_name = score_name;
    for (const Index id : candidates) {
      r.candidate_tokens.push_back(token_of(vocab, id));
      r.candidate_scores.push_back(score_of(id));
    }
    const auto q = [](const std::array<double, 5>& a) {
      return format("%.3g / %.3g / %.3g / %.3g / %.3g", a[0], a[1], a[2], a[3], a[4]);
    };
    r.facts = {
        {"V (rows)", thousands(V)},
        {"d (columns)", thousands(d)},
        {"dtype", dtype_name(chosen.dtype)},
        {"head", tied ? "tied" : "untied"},
        {"anisotropy", format("%.4f", summary.mean_pairwise_cosine)},
        {"centroid norm", format("%.4g", summary.centroid_norm)},
        {"tensor", chosen.name + " " + chosen.shape_string()},
        {"row norm min / 25% / median / 75% / max", q(summary.norm_quantiles)},
        {"centroid distance min / 25% / median / 75% / max", q(summary.centroid_distance_quantiles)},
        {"PC1 / PC2 explained variance", pcs.explained.size() >= 2
                                             ? format("%.2f%% / %.2f%%", 100 * pcs.explained(0), 100 * pcs.explained(1))
                                             : std::string("-")},
        {format("top %lld principal directions together", static_cast<long long>(pcs.explained.size())),
         format("%.2f%%", 100 * cumulative)},
        {"under-trained ranking", magikarp ? "Magikarp score, " + std::to_string(unused.size()) + " known-unused ids"
                                           : "ascending centroid distance"},
    };
    // Project only the shown rows.
    const std::vector<Index> ids = scatter_ids(V, o.max_points, candidates);
    RowMatrix<float> shown(static_cast<Index>(ids.size()), d);
    for (std::size_t i = 0; i < ids.size(); ++i) shown.row(static_cast<Index>(i)) = M.row(ids[i]);
    PrincipalComponents top2 = pcs;
    top2.directions = pcs.directions.topRows(std::min<Index>(2, pcs.directions.rows()));
    r.points = project<float>(shown, top2);
    if (r.points.cols() < 2) {  // d = 1: a flat second axis
      r.points.conservativeResize(Eigen::NoChange, 2);
      r.points.col(1).setZero();
    }
    r.point_ids = ids;
    r.subsampled = static_cast<Index>(ids.size()) < V;
    r.explained[0] = pcs.explained.size() > 0 ? pcs.explained(0) : 0;
    r.explained[1] = pcs.explained.size() > 1 ? pcs.explained(1) : 0;
    std::printf("\n");
    if (o.html) {
      inspect::write_file(*o.html, inspect::report_html(r));
      std::printf("wrote %s\n", o.html->c_str());
    }
    if (o.svg)
      for (const std::string& path : inspect::write_svgs(r, *o.svg)) std::printf("wrote %s\n", path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "embedhead-inspect: error: %s\n(see embedhead-inspect --help)\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "embedhead-inspect: error: %s\n", e.what());
    return 1;
  }
}
