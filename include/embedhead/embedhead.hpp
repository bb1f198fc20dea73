// embedhead: the umbrella header -- every public header that needs nothing beyond Eigen (and
// OpenMP when built with it). The headers with an extra dependency are included on their own:
//   io/safetensors.hpp, io/checkpoint.hpp, io/optimizer_state.hpp,
//   io/update_counts.hpp                                              nlohmann/json, POSIX
//   io/rope_config.hpp (config.json's RoPE settings)                 nlohmann/json, POSIX
//   parallel/mpi_communicator.hpp                                    MPI
//   backends/onednn_head.hpp                                         oneDNN
//
// The layout: the layers, their losses and their shared types at the top level; folders for what
// sits beside them -- optim/ (optimizers, clipping, schedules), io/ (files), parallel/ (ranks),
// analysis/ (table geometry), backends/ (other GEMM libraries) -- and detail/ (no API promise).
#ifndef EMBEDHEAD_EMBEDHEAD_HPP
#define EMBEDHEAD_EMBEDHEAD_HPP

#include "version.hpp"

// Types, errors, parameters and initialisation.
#include "errors.hpp"
#include "init.hpp"
#include "parameter.hpp"
#include "scatter_workspace.hpp"
#include "types.hpp"

// The layers and the losses on the head; ALiBi's attention bias, RoPE's rotation kernels and scalings.
#include "alibi.hpp"
#include "cross_entropy.hpp"
#include "distillation.hpp"
#include "dropout.hpp"
#include "fused_head_loss.hpp"
#include "gemm_backend.hpp"
#include "head_scores.hpp"
#include "interleaved_head.hpp"
#include "low_precision.hpp"
#include "output_projection.hpp"
#include "parameter_count.hpp"
#include "position_embedding.hpp"
#include "quantized_embedding.hpp"
#include "quantized_head.hpp"
#include "rope.hpp"
#include "rope_scaling.hpp"
#include "sampling.hpp"
#include "shortlist.hpp"
#include "token_embedding.hpp"
#include "vocabulary.hpp"

// Optimizers.
#include "optim/adagrad.hpp"
#include "optim/adamw.hpp"
#include "optim/clip.hpp"
#include "optim/lazy_adam.hpp"
#include "optim/lazy_adamw.hpp"
#include "optim/optimizer.hpp"
#include "optim/rowwise_adagrad.hpp"
#include "optim/schedule.hpp"
#include "optim/sgd.hpp"
#include "optim/untrained_guard.hpp"

// Files without JSON: .npy.
#include "io/npy.hpp"

// Several ranks over a Communicator (MPI itself: parallel/mpi_communicator.hpp).
#include "parallel/communicator.hpp"
#include "parallel/data_parallel.hpp"
#include "parallel/vocab_parallel_cross_entropy.hpp"
#include "parallel/vocab_parallel_distillation.hpp"
#include "parallel/vocab_parallel_embedding.hpp"
#include "parallel/vocab_parallel_fused_head_loss.hpp"
#include "parallel/vocab_parallel_output_projection.hpp"

// The geometry of a trained table.
#include "analysis/geometry.hpp"
#include "analysis/head_comparison.hpp"

#endif  // EMBEDHEAD_EMBEDHEAD_HPP
