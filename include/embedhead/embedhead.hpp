// embedhead: the umbrella header. Includes every public header.
#ifndef EMBEDHEAD_EMBEDHEAD_HPP
#define EMBEDHEAD_EMBEDHEAD_HPP

#include "version.hpp"

#include "cross_entropy.hpp"
#include "data_parallel.hpp"
#include "dropout.hpp"
#include "errors.hpp"
#include "fused_head_loss.hpp"
#include "geometry.hpp"
#include "init.hpp"
#include "low_precision.hpp"
#include "npy.hpp"
#include "optimizer.hpp"
#include "output_projection.hpp"
#include "parameter.hpp"
#include "parameter_count.hpp"
#include "position_embedding.hpp"
#include "quantized_embedding.hpp"
#include "token_embedding.hpp"
#include "types.hpp"
#include "vocab_parallel.hpp"
#include "vocab_parallel_fused_head_loss.hpp"
#include "vocabulary.hpp"

#endif  // EMBEDHEAD_EMBEDHEAD_HPP
