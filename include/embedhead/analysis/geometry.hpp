// embedhead: the geometry of an embedding (or unembedding) table E [V, d].
//
//   row_norms, centroid, centroid_distances     per-row statistics, O(V d)
//   mean_pairwise_cosine                        anisotropy: the exact mean cosine over all pairs, O(V d)
//   row_similarity, nearest_neighbours,         cosine / dot top-k by blocked GEMM, never a [Q, V]
//   nearest_neighbours_of_rows, analogy         matrix
//   principal_components, project               block power (subspace) iteration, never a d x d
//                                               covariance nor a centred copy of E
//   undertrained_scores                         Land & Bartolo 2024 (arXiv 2405.05417)
//   summarize_table                             everything above that a summary prints
//
// E is a read-only view (`ConstMatrixRef<Scalar>`, Scalar float or double); statistics are
// accumulated in double; similarity scores come from a GEMM in Scalar and are reported in double.
// Memory beyond the inputs and outputs is O(V) doubles plus O(block) scratch per thread.
//
// Threads: built with OpenMP, the passes over E run as fixed chunks on the OpenMP threads
// (detail::parallel_chunks), each chunk's products one sequential GEMM of the GEMM seam
// (detail/gemm.hpp, Kernel::gemm). Sums over rows are taken in a fixed number of fixed row groups
// and added in group order, and top-k lists are merged under a total order (score, then id), so
// every result is bit-identical for any thread count and with or without OpenMP.
//
// Definitions used throughout:
//   cosine(x, y) = x.y / (||x|| ||y||), and 0 when x or y is the zero vector.
//   The covariance is the population covariance (1/V) sum_v (E[v] - mu)(E[v] - mu)^T.
//   NaN similarity scores never become neighbours; NaN norms / distances sort last.
#ifndef EMBEDHEAD_ANALYSIS_GEOMETRY_HPP
#define EMBEDHEAD_ANALYSIS_GEOMETRY_HPP

#include "../detail/checks.hpp"
#include "../detail/gemm.hpp"
#include "../detail/kernels.hpp"
#include "../detail/parallel.hpp"
#include "../errors.hpp"
#include "../init.hpp"
#include "../types.hpp"

#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <Eigen/QR>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace embedhead {

enum class Similarity { cosine, dot };

// A progress callback: called with (done, total) units of work, at most ~100 times per call and
// always last with (total, total); may be empty. It is only ever called on the calling thread,
// never concurrently. If it throws, the call stops early (remaining blocks are skipped) and the
// exception propagates to the caller; no output is returned.
using Progress = std::function<void(Index done, Index total)>;

// Top-k neighbours. ids [Q, k] (Index, row-major), scores [Q, k] (double), best first; ties broken
// by smaller id. Rows with fewer than k candidates are padded with id -1 and score -inf.
struct Neighbours {
  Eigen::Matrix<Index, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> ids;
  RowMatrix<double> scores;
};

// Top principal directions of the centred rows.
struct PrincipalComponents {
  RowMatrix<double> directions;  // [k, d], orthonormal rows
  Eigen::VectorXd variances;     // [k], variance along each direction (descending)
  double total_variance = 0;     // trace of the (population) covariance
  Eigen::VectorXd explained;     // [k], variances / total_variance
  Eigen::VectorXd mean;          // [d], the centroid that was removed
};

struct UndertrainedScores {
  Eigen::VectorXd magikarp;           // [V], the projection score (empty if no known_unused given)
  Eigen::VectorXd norm;               // [V], row norms
  Eigen::VectorXd centroid_distance;  // [V]
  std::vector<Index> ranking;         // all V ids, most likely under-trained first: by magikarp
                                      // score when known_unused is non-empty, else by ascending
                                      // centroid distance
};

struct TableSummary {
  Index V = 0, d = 0;
  std::array<double, 5> norm_quantiles{};  // min, 25 %, median, 75 %, max
  std::array<double, 5> centroid_distance_quantiles{};
  double centroid_norm = 0;
  double mean_pairwise_cosine = 0;            // NaN when E has fewer than 2 non-zero rows
  PrincipalComponents pcs;                    // top `components` directions
  Eigen::VectorXd norms, centroid_distances;  // [V] each, kept for histograms
};
struct SummaryOptions {
  Index components = 8;  // clamped to d; 0 skips the PCA
  int iterations = 20;
  std::uint64_t seed = 0;
};

namespace detail {

// Rows of E per GEMM / per chunk of the neighbour search, queries per GEMM, and the number of
// fixed row groups over which sums are split (each group summed sequentially, the groups added
// in order: the result does not depend on the thread count).
constexpr Index kGeometryVocabBlock = 1024;
constexpr Index kGeometryQueryBlock = 256;
constexpr Index kGeometryGroups = 32;
// Rows of E per pair of GEMMs in the PCA's passes (a parameter of pca_impl for tuning). At
// d = 2048, p = 16 on the project's machine: 128-256 rows 55 GFLOP/s, 512 rows 54, 1024 rows 46
// (a 2 MB float block stays in L2 between its two products).
constexpr Index kGeometryPcaBlock = 256;
// Candidates kept per thread (queries in flight x k); more queries are handled in several groups.
constexpr Index kGeometryHeapBudget = Index{1} << 20;

inline bool in_parallel() {
#ifdef _OPENMP
  return omp_in_parallel() != 0;
#else
  return false;
#endif
}
// Scratch slots needed by geometry_chunks: one per thread that parallel_chunks may use.
inline Index geometry_slots() {
#ifdef _OPENMP
  return in_parallel() ? 1 : std::max(1, omp_get_max_threads());
#else
  return 1;
#endif
}
inline Index thread_slot(bool nested) {
#ifdef _OPENMP
  return nested ? 0 : omp_get_thread_num();
#else
  (void)nested;
  return 0;
#endif
}

// Rate-limits a Progress callback to about 100 calls (whenever the percentage grows) plus a
// final (total, total).
class ProgressReporter {
 public:
  ProgressReporter(const Progress& callback, Index total) : callback_(callback), total_(total) {}
  Index total() const { return total_; }
  void report(Index done) {
    if (!callback_ || total_ <= 0) return;
    done = std::min(done, total_);
    const Index percent = done * 100 / total_;
    if (percent > last_percent_) {
      last_percent_ = percent;
      callback_(done, total_);
    }
  }
  void finish() { report(total_); }

 private:
  const Progress& callback_;
  Index total_;
  Index last_percent_ = -1;
};

// parallel_chunks with a scratch slot per thread, progress reported from the calling thread
// (OpenMP thread 0) as base + chunks finished, and an exception from the progress callback
// carried out of the parallel region (the chunks not yet started are then skipped).
template <typename Body>
void geometry_chunks(Index count, Index chunk, bool threaded, ProgressReporter& progress, Index base,
                     const Body& body) {
  std::atomic<Index> finished{0};
  std::atomic<bool> cancelled{false};
  std::exception_ptr error;
  const bool nested = in_parallel();
  parallel_chunks(count, chunk, threaded, [&](Index begin, Index end) {
    if (cancelled.load(std::memory_order_relaxed)) return;
    const Index slot = thread_slot(nested);
    body(begin, end, slot);
    const Index done = finished.fetch_add(1) + 1;
    if (slot == 0 && !error) {
      try {
        progress.report(base + done);
      } catch (...) {
        error = std::current_exception();
        cancelled.store(true);
      }
    }
  });
  if (error) std::rethrow_exception(error);
}

// Fixed row groups for sums: group g of G covers rows [V g / G, V (g + 1) / G).
inline Index geometry_groups(Index V) {
  return std::max<Index>(1, std::min(kGeometryGroups, (V + kGeometryVocabBlock - 1) / kGeometryVocabBlock));
}
inline bool geometry_threaded(Index V, Index d) { return static_cast<double>(V) * static_cast<double>(d) >= 1 << 18; }

template <typename Scalar>
void check_table(const char* where, const ConstMatrixRef<Scalar>& E) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  check_size(where, "V (rows of E)", E.rows());
  check_size(where, "d (columns of E)", E.cols());
}

inline void check_row(const char* where, const char* what, Index id, Index V) {
  if (id < 0 || id >= V) {
    std::ostringstream message;
    message << where << ": " << what << " = " << id << " outside [0, " << V << ")";
    throw index_error(message.str());
  }
}

// NaN-aware order: numbers ascending, NaN after every number (a strict weak order).
inline bool less_nan_last(double a, double b) { return a < b || (!std::isnan(a) && std::isnan(b)); }

// One pass over E: norms [V], the sum of the rows and, when wanted, the sum of the unit rows
// u_v = E[v] / ||E[v]|| (zero rows skipped) with sum ||u_v||^2 and the count of non-zero rows.
struct TableMoments {
  Eigen::VectorXd norms;
  Eigen::VectorXd sum;       // [d]
  Eigen::VectorXd unit_sum;  // [d]
  double unit_square_sum = 0;
  Index nonzero = 0;
};

template <typename Scalar>
TableMoments table_moments(const ConstMatrixRef<Scalar>& E, ProgressReporter& progress, Index base) {
  const Index V = E.rows(), d = E.cols(), G = geometry_groups(V);
  TableMoments m;
  m.norms.resize(V);
  std::vector<Eigen::RowVectorXd> sums(G, Eigen::RowVectorXd::Zero(d)), units(G, Eigen::RowVectorXd::Zero(d));
  std::vector<double> unit_squares(G, 0.0);
  std::vector<Index> nonzeros(G, 0);
  geometry_chunks(G, 1, geometry_threaded(V, d), progress, base, [&](Index g, Index, Index) {
    for (Index v = V * g / G; v < V * (g + 1) / G; ++v) {
      const auto row = E.row(v).template cast<double>();
      const double norm = std::sqrt(row.squaredNorm());
      m.norms[v] = norm;
      sums[g] += row;
      if (norm > 0) {
        const double inverse = 1.0 / norm;
        units[g] += row * inverse;
        unit_squares[g] += (row * inverse).squaredNorm();
        ++nonzeros[g];
      }
    }
  });
  m.sum = Eigen::VectorXd::Zero(d);
  m.unit_sum = Eigen::VectorXd::Zero(d);
  for (Index g = 0; g < G; ++g) {
    m.sum += sums[g].transpose();
    m.unit_sum += units[g].transpose();
    m.unit_square_sum += unit_squares[g];
    m.nonzero += nonzeros[g];
  }
  return m;
}

// ||E[v] - c|| for every v, and sum_v ||E[v] - c||^2 (in group order).
template <typename Scalar>
Eigen::VectorXd distances_to(const ConstMatrixRef<Scalar>& E, const Eigen::VectorXd& c, double* square_sum,
                             ProgressReporter& progress, Index base) {
  const Index V = E.rows(), d = E.cols(), G = geometry_groups(V);
  Eigen::VectorXd out(V);
  std::vector<double> squares(G, 0.0);
  const Eigen::RowVectorXd ct = c.transpose();
  geometry_chunks(G, 1, geometry_threaded(V, d), progress, base, [&](Index g, Index, Index) {
    for (Index v = V * g / G; v < V * (g + 1) / G; ++v) {
      const double s = (E.row(v).template cast<double>() - ct).squaredNorm();
      out[v] = std::sqrt(s);
      squares[g] += s;
    }
  });
  if (square_sum) {
    *square_sum = 0;
    for (Index g = 0; g < G; ++g) *square_sum += squares[g];
  }
  return out;
}

// Top-k bookkeeping. Candidate a ranks before b when its score is larger, or equal with a smaller id.
struct Candidate {
  double score;
  Index id;
};
inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.id < b.id);
}

// The neighbour search proper; the inputs are checked. exclude: empty or one sorted list of
// distinct in-range ids per query.
template <typename Scalar>
Neighbours neighbours_impl(const ConstMatrixRef<Scalar>& E, const ConstMatrixRef<Scalar>& queries, Index k,
                           Similarity similarity, const std::vector<std::vector<Index>>& exclude,
                           const Progress& progress_callback) {
  const Index V = E.rows(), d = E.cols(), Q = queries.rows();
  const Index kk = std::min(k, V);  // no query can have more than V candidates
  Neighbours result;
  result.ids.setConstant(Q, k, -1);
  result.scores.setConstant(Q, k, -std::numeric_limits<double>::infinity());

  // Cosine: scores are dot products scaled by 1 / ||q|| and 1 / ||E[v]||, the norms computed in
  // double (1 / 0 taken as 0: a zero row's cosine is 0), the queries' once, a block's rows once
  // per block while the block is in cache. This is the dot of the pre-normalised rows without a
  // normalised copy of E or of the queries, and without a separate pass over E for its norms.
  const bool cosine = similarity == Similarity::cosine;
  Eigen::VectorXd inv_q;
  auto inverse = [](double norm) { return norm > 0 ? 1.0 / norm : 0.0; };
  if (cosine) {
    inv_q.resize(Q);
    for (Index q = 0; q < Q; ++q) inv_q[q] = inverse(std::sqrt(queries.row(q).template cast<double>().squaredNorm()));
  }

  // Queries in groups of Qg (so that Qg * kk candidates per thread stay within the budget); per
  // group, the vocabulary in chunks of kGeometryVocabBlock rows over the threads; per chunk, one
  // [Qb, Vb] GEMM per block of kGeometryQueryBlock queries into a reused buffer, then a scan
  // that offers each score to its query's bounded heap (worst candidate on top).
  const Index Qg = std::max<Index>(1, std::min(Q, kGeometryHeapBudget / kk));
  const Index groups = Q > 0 ? (Q + Qg - 1) / Qg : 0;
  const Index chunks = (V + kGeometryVocabBlock - 1) / kGeometryVocabBlock;
  const Index slots = geometry_slots();
  const Index Qb = std::min(kGeometryQueryBlock, Qg);
  std::vector<std::vector<Scalar>> buffers(slots);
  std::vector<std::vector<double>> inv_e(slots, std::vector<double>(cosine ? kGeometryVocabBlock : 0));
  std::vector<std::vector<Candidate>> heaps(slots);
  std::vector<std::vector<Index>> sizes(slots);
  const bool threaded = 2.0 * static_cast<double>(std::min(Q, Qg)) * static_cast<double>(V) * static_cast<double>(d) >=
                        kHeadMinFlops;
  ProgressReporter progress(progress_callback, groups * chunks);

  for (Index group = 0; group < groups; ++group) {
    const Index g0 = group * Qg, g1 = std::min(Q, g0 + Qg), rows = g1 - g0;
    for (Index s = 0; s < slots; ++s) {
      heaps[s].resize(static_cast<std::size_t>(rows * kk));
      sizes[s].assign(static_cast<std::size_t>(rows), 0);
    }
    geometry_chunks(V, kGeometryVocabBlock, threaded, progress, group * chunks, [&](Index v0, Index v1, Index slot) {
      const Index C = v1 - v0;
      std::vector<Scalar>& buffer = buffers[slot];
      if (buffer.size() < static_cast<std::size_t>(Qb * kGeometryVocabBlock))
        buffer.resize(static_cast<std::size_t>(Qb * kGeometryVocabBlock));
      double* inv_block = inv_e[slot].data();
      if (cosine)
        for (Index j = 0; j < C; ++j)
          inv_block[j] = inverse(std::sqrt(E.row(v0 + j).template cast<double>().squaredNorm()));
      for (Index b0 = g0; b0 < g1; b0 += Qb) {
        const Index b1 = std::min(g1, b0 + Qb), B = b1 - b0;
        // scores [B, C] = queries[b0:b1] E[v0:v1]^T: E's rows v0 .. v1 - 1 seen as a [d, C]
        // column-major matrix, no copy.
        gemm::multiply<gemm::Kernel::gemm>(gemm::Op<Scalar, gemm::Layout::row_major, gemm::Layout::col_major>{
            B, C, d, queries.data() + b0 * queries.outerStride(), queries.outerStride(),
            E.data() + v0 * E.outerStride(), E.outerStride(), buffer.data(), C, gemm::Init::zero});
        for (Index q = b0; q < b1; ++q) {
          Candidate* heap = heaps[slot].data() + (q - g0) * kk;
          Index& size = sizes[slot][static_cast<std::size_t>(q - g0)];
          const Scalar* row = buffer.data() + (q - b0) * C;
          // The query's excluded ids inside [v0, v1), walked in step with v.
          const Index* ex = nullptr;
          const Index* ex_end = nullptr;
          if (!exclude.empty()) {
            const std::vector<Index>& list = exclude[static_cast<std::size_t>(q)];
            ex = list.data();
            ex_end = list.data() + list.size();
            ex = std::lower_bound(ex, ex_end, v0);
          }
          const double scale_q = cosine ? inv_q[q] : 1.0;
          for (Index j = 0; j < C; ++j) {
            const Index v = v0 + j;
            if (ex != ex_end && *ex == v) {
              ++ex;
              continue;
            }
            double score = static_cast<double>(row[j]);
            if (cosine) score = score * scale_q * inv_block[j];
            if (std::isnan(score)) continue;
            const Candidate candidate{score, v};
            if (size < kk) {
              heap[size++] = candidate;
              std::push_heap(heap, heap + size, ranks_before);
            } else if (ranks_before(candidate, heap[0])) {
              std::pop_heap(heap, heap + size, ranks_before);
              heap[size - 1] = candidate;
              std::push_heap(heap, heap + size, ranks_before);
            }
          }
        }
      }
    });
    // Merge the threads' lists: the top kk under the total order (score desc, id asc) of the
    // union does not depend on which thread saw which chunk.
    std::vector<Candidate> merged;
    for (Index q = g0; q < g1; ++q) {
      merged.clear();
      for (Index s = 0; s < slots; ++s) {
        const Candidate* heap = heaps[s].data() + (q - g0) * kk;
        merged.insert(merged.end(), heap, heap + sizes[s][static_cast<std::size_t>(q - g0)]);
      }
      const Index n = std::min<Index>(kk, static_cast<Index>(merged.size()));
      std::partial_sort(merged.begin(), merged.begin() + n, merged.end(), ranks_before);
      for (Index i = 0; i < n; ++i) {
        result.ids(q, i) = merged[static_cast<std::size_t>(i)].id;
        result.scores(q, i) = merged[static_cast<std::size_t>(i)].score;
      }
    }
  }
  progress.finish();
  return result;
}

// Subspace iteration on the covariance C = (1/V) sum_v (E[v] - mu)(E[v] - mu)^T with p = k +
// max(k, 8) columns (at most d), `iterations` applications of C, the last one followed by
// Rayleigh-Ritz. Each application is one pass over E in blocks of kGeometryPcaBlock rows:
//   T  = E_b Y - 1 (mu^T Y)        [Vb, p]   projections of the centred rows (GEMM in Scalar)
//   Z += (T^T E_b)^T                [d, p]    (GEMM in Scalar, accumulated in double per block)
// and finally Z = (Z - mu (sum_v T_v)^T) / V, which equals C Y exactly in exact arithmetic since
// sum_v (E[v] - mu) T_v = sum_v E[v] T_v - mu sum_v T_v. So centring is implicit (no centred copy
// of E). Subtracting mu^T Y from T before the second product, rather than forming
// E^T E Y - V mu mu^T Y, avoids two large terms that nearly cancel when the mean is large
// (anisotropic tables): the error stays at the scale of one rounded projection. Never forms a
// d x d matrix.
template <typename Scalar>
PrincipalComponents pca_impl(const ConstMatrixRef<Scalar>& E, const Eigen::VectorXd& mean, double total_variance,
                             Index k, int iterations, std::uint64_t seed, ProgressReporter& progress, Index base,
                             Index block = kGeometryPcaBlock) {
  const Index V = E.rows(), d = E.cols(), G = geometry_groups(V);
  const Index p = std::min(d, k + std::max<Index>(k, 8));
  using ColMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;

  // Start: a seeded Gaussian [d, p], orthonormalised.
  Eigen::MatrixXd Y(d, p);
  const Rng rng(seed);
  for (Index j = 0; j < p; ++j)
    for (Index i = 0; i < d; ++i) Y(i, j) = rng.normal_at(2 * static_cast<std::uint64_t>(j * d + i));
  auto orthonormalise = [p](const Eigen::MatrixXd& M) -> Eigen::MatrixXd {
    Eigen::HouseholderQR<Eigen::MatrixXd> qr(M);
    return qr.householderQ() * Eigen::MatrixXd::Identity(M.rows(), p);
  };
  Y = orthonormalise(Y);

  const Index slots = geometry_slots();
  std::vector<RowMatrix<Scalar>> T(slots), Zb(slots);
  std::vector<Eigen::MatrixXd> Zg(G);
  std::vector<Eigen::RowVectorXd> Tsum(G);
  Eigen::MatrixXd Z(d, p);
  for (int it = 0; it < iterations; ++it) {
    const ColMatrix Ys = Y.cast<Scalar>();
    const Eigen::RowVectorXd m = mean.transpose() * Y;  // mu^T Y, [p]
    geometry_chunks(G, 1, geometry_threaded(V, d), progress, base + it * G, [&](Index g, Index, Index slot) {
      Zg[g].setZero(d, p);
      Tsum[g].setZero(p);
      for (Index r0 = V * g / G, end = V * (g + 1) / G; r0 < end; r0 += block) {
        const Index rows = std::min(block, end - r0);
        RowMatrix<Scalar>& t = T[slot];
        RowMatrix<Scalar>& zb = Zb[slot];
        t.setZero(rows, p);
        gemm::multiply<gemm::Kernel::gemm>(gemm::Op<Scalar, gemm::Layout::row_major, gemm::Layout::col_major>{
            rows, p, d, E.data() + r0 * E.outerStride(), E.outerStride(), Ys.data(), d, t.data(), p});
        for (Index i = 0; i < rows; ++i) {
          const Eigen::RowVectorXd centred = t.row(i).template cast<double>() - m;
          t.row(i) = centred.cast<Scalar>();
          Tsum[g] += t.row(i).template cast<double>();
        }
        // Z_b^T [p, d] = T^T E_b: T^T is the [p, rows] column-major view of the row-major T. In this
        // orientation (a wide [p, d] result) Eigen's GEMM runs ~1.7x faster than as Z_b = E_b^T T
        // (measured at rows = 1024, d = 2048, p = 16 on the project's machine: 55 vs 32 GFLOP/s).
        zb.setZero(p, d);
        gemm::multiply<gemm::Kernel::gemm>(gemm::Op<Scalar, gemm::Layout::col_major, gemm::Layout::row_major>{
            p, d, rows, t.data(), p, E.data() + r0 * E.outerStride(), E.outerStride(), zb.data(), d});
        Zg[g] += zb.transpose().template cast<double>();
      }
    });
    Z.setZero();
    Eigen::RowVectorXd tsum = Eigen::RowVectorXd::Zero(p);
    for (Index g = 0; g < G; ++g) {
      Z += Zg[g];
      tsum += Tsum[g];
    }
    Z = (Z - mean * tsum) / static_cast<double>(V);
    if (it + 1 < iterations) Y = orthonormalise(Z);
  }

  // Rayleigh-Ritz on span(Y): B = Y^T C Y [p, p]; its eigenpairs give the Ritz vectors Y W and
  // the Rayleigh quotients (variances) of those directions.
  Eigen::MatrixXd B = Y.transpose() * Z;
  B = (0.5 * (B + B.transpose())).eval();
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(B);
  PrincipalComponents pc;
  pc.directions.resize(k, d);
  pc.variances.resize(k);
  for (Index j = 0; j < k; ++j) {
    const Index col = p - 1 - j;  // eigenvalues ascending
    Eigen::VectorXd direction = Y * solver.eigenvectors().col(col);
    direction.normalize();
    // Sign convention: the component of largest magnitude is positive.
    Index at = 0;
    direction.cwiseAbs().maxCoeff(&at);
    if (direction[at] < 0) direction = -direction;
    pc.directions.row(j) = direction.transpose();
    pc.variances[j] = std::max(0.0, solver.eigenvalues()[col]);
  }
  pc.total_variance = total_variance;
  pc.explained = total_variance > 0 ? Eigen::VectorXd(pc.variances / total_variance) : Eigen::VectorXd::Zero(k);
  pc.mean = mean;
  return pc;
}

template <typename Scalar>
void check_pca_arguments(const char* where, const ConstMatrixRef<Scalar>& E, Index k, int iterations) {
  check_table(where, E);
  check_range(where, "k", k, 1, E.cols());
  check_range(where, "iterations", iterations, 1, std::numeric_limits<int>::max());
}

// The 0, 25, 50, 75 and 100 % quantiles of x (numpy's default linear interpolation), NaN last.
inline std::array<double, 5> quantiles(const Eigen::VectorXd& x) {
  std::array<double, 5> out{};
  if (x.size() == 0) return out;
  std::vector<double> sorted(x.data(), x.data() + x.size());
  std::sort(sorted.begin(), sorted.end(), less_nan_last);
  const double last = static_cast<double>(sorted.size() - 1);
  for (int i = 0; i < 5; ++i) {
    const double h = last * 0.25 * i;
    const auto lo = static_cast<std::size_t>(std::floor(h));
    const std::size_t hi = std::min(lo + 1, sorted.size() - 1);
    out[static_cast<std::size_t>(i)] = sorted[lo] + (h - static_cast<double>(lo)) * (sorted[hi] - sorted[lo]);
  }
  return out;
}

}  // namespace detail

// E [V, d] -> norms [V] (double): ||E[v]||_2.
// \throws value_error if V or d < 1. Cost: V d.
template <typename Scalar>
Eigen::VectorXd row_norms(const ConstMatrixRef<Scalar>& E) {
  detail::check_table("row_norms", E);
  Eigen::VectorXd out(E.rows());
  detail::parallel_ranges(E.rows(), 4096, [&](Index v0, Index v1) {
    for (Index v = v0; v < v1; ++v) out[v] = std::sqrt(E.row(v).template cast<double>().squaredNorm());
  });
  return out;
}

// E [V, d] -> centroid [d] (double): mean of rows [0, V).
// \throws value_error if V or d < 1. Cost: V d.
template <typename Scalar>
Eigen::VectorXd centroid(const ConstMatrixRef<Scalar>& E) {
  detail::check_table("centroid", E);
  const Progress none;
  detail::ProgressReporter progress(none, 0);
  return detail::table_moments<Scalar>(E, progress, 0).sum / static_cast<double>(E.rows());
}

// E [V, d], c [d] -> [V] (double): ||E[v] - c||_2.
// \throws value_error if V or d < 1, shape_error unless c has d entries. Cost: V d.
template <typename Scalar>
Eigen::VectorXd centroid_distances(const ConstMatrixRef<Scalar>& E, const Eigen::VectorXd& c) {
  detail::check_table("centroid_distances", E);
  detail::check_shape("centroid_distances", "c", c, E.cols(), 1);
  const Progress none;
  detail::ProgressReporter progress(none, 0);
  return detail::distances_to<Scalar>(E, c, nullptr, progress, 0);
}

// E [V, d] -> the exact mean pairwise cosine over all ordered pairs i != j (anisotropy), in O(V d):
//   (||sum_i u_i||^2 - sum_i ||u_i||^2) / (V (V - 1)),  u_i = E[i] / ||E[i]||
// Zero rows have cosine 0 with everything: they are skipped in the sums but counted in V.
// \throws value_error if V or d < 1 or fewer than 2 rows are non-zero.
template <typename Scalar>
double mean_pairwise_cosine(const ConstMatrixRef<Scalar>& E) {
  detail::check_table("mean_pairwise_cosine", E);
  const Progress none;
  detail::ProgressReporter progress(none, 0);
  const detail::TableMoments m = detail::table_moments<Scalar>(E, progress, 0);
  if (m.nonzero < 2) {
    std::ostringstream message;
    message << "mean_pairwise_cosine: " << m.nonzero << " non-zero rows of " << E.rows() << ", needs at least 2";
    throw value_error(message.str());
  }
  const double V = static_cast<double>(E.rows());
  return (m.unit_sum.squaredNorm() - m.unit_square_sum) / (V * (V - 1));
}

// E [V, d], rows a, b -> cosine (0 if either row is zero) or dot product, in double.
// \throws value_error if V or d < 1, index_error unless 0 <= a, b < V.
template <typename Scalar>
double row_similarity(const ConstMatrixRef<Scalar>& E, Index a, Index b, Similarity similarity) {
  detail::check_table("row_similarity", E);
  detail::check_row("row_similarity", "a", a, E.rows());
  detail::check_row("row_similarity", "b", b, E.rows());
  const Eigen::RowVectorXd x = E.row(a).template cast<double>(), y = E.row(b).template cast<double>();
  const double dot = x.dot(y);
  if (similarity == Similarity::dot) return dot;
  const double nx = x.norm(), ny = y.norm();
  return nx > 0 && ny > 0 ? dot / (nx * ny) : 0.0;
}

// E [V, d], queries [Q, d] -> Neighbours ids / scores [Q, k]: the top-k rows of E by similarity,
// best first, ties broken by smaller id, padded with (-1, -inf) past the number of candidates.
// `exclude` is empty or holds Q lists; list q's ids (duplicates allowed) are not candidates for
// query q. Cosine scores use cosine(zero, x) = 0. Computed block by block: a [256, 1024] GEMM in
// Scalar per block of queries and of rows of E into a reused buffer, each score offered to a
// bounded heap per query; never a [Q, V] matrix. Threads (OpenMP) over the blocks of E, with the
// per-thread lists merged by (score, id): identical results for any thread count.
// \throws value_error if V, d or k < 1; shape_error if queries has a column count other than d or
// exclude has a size other than 0 or Q; index_error for an excluded id outside [0, V).
// Cost: 2 Q V d flops; memory O(threads (256 x 1024 + min(Q, 2^20 / k) k)) beyond the result.
template <typename Scalar>
Neighbours nearest_neighbours(const ConstMatrixRef<Scalar>& E, const ConstMatrixRef<Scalar>& queries, Index k,
                              Similarity similarity = Similarity::cosine,
                              const std::vector<std::vector<Index>>& exclude = {}, const Progress& progress = {}) {
  const char* where = "nearest_neighbours";
  detail::check_table(where, E);
  detail::check_size(where, "k", k);
  const Index V = E.rows(), Q = queries.rows();
  detail::check_shape(where, "queries", queries, Q, E.cols());
  if (!exclude.empty() && static_cast<Index>(exclude.size()) != Q) {
    std::ostringstream message;
    message << where << ": exclude has " << exclude.size() << " lists, expected 0 or " << Q << " (one per query)";
    throw shape_error(message.str());
  }
  std::vector<std::vector<Index>> sorted(exclude.size());
  for (std::size_t q = 0; q < exclude.size(); ++q) {
    for (std::size_t i = 0; i < exclude[q].size(); ++i) {
      const Index id = exclude[q][i];
      if (id < 0 || id >= V) {
        std::ostringstream message;
        message << where << ": exclude id " << id << " at (query=" << q << ", i=" << i << ") outside [0, " << V << ")";
        throw index_error(message.str());
      }
    }
    sorted[q] = exclude[q];
    std::sort(sorted[q].begin(), sorted[q].end());
    sorted[q].erase(std::unique(sorted[q].begin(), sorted[q].end()), sorted[q].end());
  }
  return detail::neighbours_impl<Scalar>(E, queries, k, similarity, sorted, progress);
}

// E [V, d], ids (n of them) -> Neighbours [n, k] of the rows E[ids[i]], each query row excluded
// from its own list. \throws as nearest_neighbours, and index_error for an id outside [0, V).
template <typename Scalar>
Neighbours nearest_neighbours_of_rows(const ConstMatrixRef<Scalar>& E, const std::vector<Index>& ids, Index k,
                                      Similarity similarity = Similarity::cosine, const Progress& progress = {}) {
  const char* where = "nearest_neighbours_of_rows";
  detail::check_table(where, E);
  detail::check_size(where, "k", k);
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= E.rows()) {
      std::ostringstream message;
      message << where << ": id " << ids[i] << " at i=" << i << " outside [0, " << E.rows() << ")";
      throw index_error(message.str());
    }
  const Index n = static_cast<Index>(ids.size());
  RowMatrix<Scalar> queries(n, E.cols());
  std::vector<std::vector<Index>> exclude(ids.size());
  for (Index i = 0; i < n; ++i) {
    queries.row(i) = E.row(ids[static_cast<std::size_t>(i)]);
    exclude[static_cast<std::size_t>(i)] = {ids[static_cast<std::size_t>(i)]};
  }
  return detail::neighbours_impl<Scalar>(E, queries, k, similarity, exclude, progress);
}

// E [V, d], rows a, b, c -> Neighbours [1, k]: "a is to b as c is to ?" by 3CosAdd (Mikolov et al.
// 2013): the cosine neighbours of u_b - u_a + u_c, u = E[row] / ||E[row]|| (a zero row stays zero),
// formed in double and rounded to Scalar, with a, b and c excluded. Normalising first, as
// word2vec's and gensim's analogy do, keeps a long row from dominating the query.
// Caveat (the seeds' own): the famous answers need that exclusion. Without it the nearest row to
// u_king - u_man + u_woman is usually "king" itself (Nissim, van Noord & van der Goot 2020, "Fair
// is better than sensational"); queen's cosine there was only about 0.57, and LLM token tables
// solve such analogies far less reliably than word2vec did. Treat a hit as a hint, not a proof.
// \throws value_error if V, d or k < 1, index_error unless 0 <= a, b, c < V.
template <typename Scalar>
Neighbours analogy(const ConstMatrixRef<Scalar>& E, Index a, Index b, Index c, Index k) {
  const char* where = "analogy";
  detail::check_table(where, E);
  detail::check_size(where, "k", k);
  detail::check_row(where, "a", a, E.rows());
  detail::check_row(where, "b", b, E.rows());
  detail::check_row(where, "c", c, E.rows());
  auto unit = [&](Index v) -> Eigen::RowVectorXd {
    const Eigen::RowVectorXd x = E.row(v).template cast<double>();
    const double n = x.norm();
    return n > 0 ? Eigen::RowVectorXd(x / n) : x;
  };
  const RowMatrix<Scalar> query = (unit(b) - unit(a) + unit(c)).template cast<Scalar>();
  std::vector<Index> ex = {a, b, c};
  std::sort(ex.begin(), ex.end());
  ex.erase(std::unique(ex.begin(), ex.end()), ex.end());
  return detail::neighbours_impl<Scalar>(E, query, k, Similarity::cosine, {ex}, Progress{});
}

// E [V, d] -> the top k principal directions of the centred rows, by block power (subspace)
// iteration with Householder QR re-orthonormalisation on [d, p], p = min(d, k + max(k, 8)), and a
// final Rayleigh-Ritz step; `iterations` passes over E (each 4 V d p flops), plus two for the mean
// and the total variance. variances are Rayleigh quotients of the directions under the population
// covariance (divided by V); total_variance = sum_v ||E[v] - mu||^2 / V. Directions are fixed in
// sign (largest-magnitude component positive); with a spectral gap lambda_k > lambda_{p+1} the
// error shrinks like (lambda_{p+1} / lambda_k)^iterations. The start is seeded (seed): the result
// is reproducible and independent of the thread count. Memory: O(d p (32 + threads) + 256 p
// threads) doubles; never a d x d matrix nor a copy of E.
// \throws value_error if V or d < 1, k outside [1, d] or iterations < 1.
template <typename Scalar>
PrincipalComponents principal_components(const ConstMatrixRef<Scalar>& E, Index k, int iterations = 20,
                                         std::uint64_t seed = 0, const Progress& progress = {}) {
  detail::check_pca_arguments("principal_components", E, k, iterations);
  const Index G = detail::geometry_groups(E.rows());
  detail::ProgressReporter reporter(progress, (2 + static_cast<Index>(iterations)) * G);
  const Eigen::VectorXd mean = detail::table_moments<Scalar>(E, reporter, 0).sum / static_cast<double>(E.rows());
  double square_sum = 0;
  detail::distances_to<Scalar>(E, mean, &square_sum, reporter, G);
  PrincipalComponents pc = detail::pca_impl<Scalar>(E, mean, square_sum / static_cast<double>(E.rows()), k, iterations,
                                                    seed, reporter, 2 * G);
  reporter.finish();
  return pc;
}

// E [V, d], pc (k directions of width d) -> [V, k] coordinates (E[v] - pc.mean) . pc.directions[j],
// in double (for a 2-D scatter: k = 2).
// \throws value_error if V or d < 1; shape_error unless pc.mean has d entries and pc.directions
// has d columns.
template <typename Scalar>
RowMatrix<double> project(const ConstMatrixRef<Scalar>& E, const PrincipalComponents& pc) {
  detail::check_table("project", E);
  const Index V = E.rows(), d = E.cols(), k = pc.directions.rows();
  detail::check_shape("project", "pc.mean", pc.mean, d, 1);
  detail::check_shape("project", "pc.directions", pc.directions, k, d);
  RowMatrix<double> out(V, k);
  const Eigen::RowVectorXd mean = pc.mean.transpose();
  // Row by row, k dot products in double: each coordinate's arithmetic depends on its row only.
  detail::parallel_chunks(V, detail::kGeometryVocabBlock, detail::geometry_threaded(V, d), [&](Index v0, Index v1) {
    Eigen::RowVectorXd centred(d);
    for (Index v = v0; v < v1; ++v) {
      centred = E.row(v).template cast<double>() - mean;
      for (Index j = 0; j < k; ++j) out(v, j) = centred.dot(pc.directions.row(j));
    }
  });
  return out;
}

// Under-trained token indicators for an unembedding (or embedding) table U [V, d].
// Always: norm[v] = ||U[v]|| and centroid_distance[v] = ||U[v] - mean_v U[v]||.
// With known_unused (ids of tokens known never to occur in training, e.g. reserved/unused
// special tokens), the indicator of Land & Bartolo 2024, "Fishing for Magikarp: Automatically
// Detecting Under-trained Tokens in Large Language Models" (arXiv 2405.05417):
//   w         = the first principal direction of U (centred PCA, 20 iterations, seed 0)
//   U'[v]     = U[v] - (U[v] . w) w          the first component removed (a constant component
//                                            shared by all rows in trained models)
//   r         = mean over known_unused of U'[v]   the reference "unused" direction
//   magikarp  = U'[v] . r                    higher = closer to the known-unused tokens
// computed without a copy of U: U'[v] . r = U[v] . r - (U[v] . w)(w . r). ranking lists every id,
// by magikarp descending when known_unused is non-empty, else by centroid_distance ascending
// (under-trained rows stay near their initialisation, close to the centroid); ties by smaller id,
// NaN scores last.
// \throws value_error if V or d < 1; index_error for a known_unused id outside [0, V).
template <typename Scalar>
UndertrainedScores undertrained_scores(const ConstMatrixRef<Scalar>& U, const std::vector<Index>& known_unused = {},
                                       const Progress& progress = {}) {
  const char* where = "undertrained_scores";
  detail::check_table(where, U);
  const Index V = U.rows(), d = U.cols();
  for (std::size_t i = 0; i < known_unused.size(); ++i)
    if (known_unused[i] < 0 || known_unused[i] >= V) {
      std::ostringstream message;
      message << where << ": known_unused id " << known_unused[i] << " at i=" << i << " outside [0, " << V << ")";
      throw index_error(message.str());
    }
  const Index G = detail::geometry_groups(V);
  constexpr int kIterations = 20;
  const bool magikarp = !known_unused.empty();
  detail::ProgressReporter reporter(progress, (2 + (magikarp ? kIterations + 1 : 0)) * G);
  UndertrainedScores out;
  detail::TableMoments m = detail::table_moments<Scalar>(U, reporter, 0);
  const Eigen::VectorXd mean = m.sum / static_cast<double>(V);
  out.norm = std::move(m.norms);
  double square_sum = 0;
  out.centroid_distance = detail::distances_to<Scalar>(U, mean, &square_sum, reporter, G);
  out.ranking.resize(static_cast<std::size_t>(V));
  for (Index v = 0; v < V; ++v) out.ranking[static_cast<std::size_t>(v)] = v;
  if (magikarp) {
    const PrincipalComponents pc = detail::pca_impl<Scalar>(U, mean, square_sum / static_cast<double>(V), 1,
                                                            kIterations, 0, reporter, 2 * G);
    const Eigen::RowVectorXd w = pc.directions.row(0);
    Eigen::RowVectorXd r = Eigen::RowVectorXd::Zero(d);
    for (const Index id : known_unused) r += U.row(id).template cast<double>();
    r /= static_cast<double>(known_unused.size());
    r -= r.dot(w) * w;
    const double wr = w.dot(r);  // ~0 after the projection; kept so that the identity is exact
    out.magikarp.resize(V);
    detail::parallel_chunks(V, detail::kGeometryVocabBlock, detail::geometry_threaded(V, d), [&](Index v0, Index v1) {
      for (Index v = v0; v < v1; ++v) {
        const Eigen::RowVectorXd x = U.row(v).template cast<double>();
        out.magikarp[v] = x.dot(r) - x.dot(w) * wr;
      }
    });
    reporter.report((3 + kIterations) * G);
    const Eigen::VectorXd& s = out.magikarp;
    std::sort(out.ranking.begin(), out.ranking.end(), [&](Index a, Index b) {
      if (s[a] != s[b] || std::isnan(s[a]) || std::isnan(s[b])) {
        if (std::isnan(s[a]) || std::isnan(s[b])) {
          if (std::isnan(s[a]) && std::isnan(s[b])) return a < b;
          return std::isnan(s[b]);
        }
        return s[a] > s[b];
      }
      return a < b;
    });
  } else {
    const Eigen::VectorXd& s = out.centroid_distance;
    std::sort(out.ranking.begin(), out.ranking.end(), [&](Index a, Index b) {
      if (detail::less_nan_last(s[a], s[b])) return true;
      if (detail::less_nan_last(s[b], s[a])) return false;
      return a < b;
    });
  }
  reporter.finish();
  return out;
}

// E [V, d] -> TableSummary: V, d, row norms and centroid distances ([V] each, with their min,
// quartiles and max, numpy's linear interpolation), the centroid's norm, the mean pairwise cosine
// (NaN when fewer than 2 rows are non-zero, instead of mean_pairwise_cosine's throw) and the top
// min(components, d) principal components (none when components = 0). 2 + iterations passes over E.
// \throws value_error if V or d < 1, components < 0 or iterations < 1.
template <typename Scalar>
TableSummary summarize_table(const ConstMatrixRef<Scalar>& E, const SummaryOptions& options = {},
                             const Progress& progress = {}) {
  const char* where = "summarize_table";
  detail::check_table(where, E);
  detail::check_range(where, "options.components", options.components, 0, std::numeric_limits<Index>::max());
  detail::check_range(where, "options.iterations", options.iterations, 1, std::numeric_limits<int>::max());
  const Index V = E.rows(), d = E.cols(), G = detail::geometry_groups(V);
  const Index k = std::min(options.components, d);
  detail::ProgressReporter reporter(progress, (2 + (k > 0 ? static_cast<Index>(options.iterations) : 0)) * G);
  TableSummary s;
  s.V = V;
  s.d = d;
  detail::TableMoments m = detail::table_moments<Scalar>(E, reporter, 0);
  const Eigen::VectorXd mean = m.sum / static_cast<double>(V);
  s.centroid_norm = mean.norm();
  s.mean_pairwise_cosine = m.nonzero >= 2 ? (m.unit_sum.squaredNorm() - m.unit_square_sum) /
                                                (static_cast<double>(V) * static_cast<double>(V - 1))
                                          : std::numeric_limits<double>::quiet_NaN();
  s.norms = std::move(m.norms);
  double square_sum = 0;
  s.centroid_distances = detail::distances_to<Scalar>(E, mean, &square_sum, reporter, G);
  s.norm_quantiles = detail::quantiles(s.norms);
  s.centroid_distance_quantiles = detail::quantiles(s.centroid_distances);
  const double total_variance = square_sum / static_cast<double>(V);
  if (k > 0) {
    s.pcs = detail::pca_impl<Scalar>(E, mean, total_variance, k, options.iterations, options.seed, reporter, 2 * G);
  } else {
    s.pcs.total_variance = total_variance;
    s.pcs.mean = mean;
  }
  reporter.finish();
  return s;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_ANALYSIS_GEOMETRY_HPP
