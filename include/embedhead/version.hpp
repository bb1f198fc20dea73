// embedhead version macros.
//
// This file is the single source of truth for the project version: the
// top-level CMakeLists.txt parses EMBEDHEAD_VERSION_{MAJOR,MINOR,PATCH} from
// it, so keep each of those three on its own line as `#define NAME <integer>`.

#ifndef EMBEDHEAD_VERSION_HPP
#define EMBEDHEAD_VERSION_HPP

#define EMBEDHEAD_VERSION_MAJOR 0
#define EMBEDHEAD_VERSION_MINOR 1
#define EMBEDHEAD_VERSION_PATCH 0

// Single comparable number: major * 10000 + minor * 100 + patch (0.1.0 -> 100).
// Usable in preprocessor conditionals, e.g. `#if EMBEDHEAD_VERSION >= 100`.
#define EMBEDHEAD_VERSION (EMBEDHEAD_VERSION_MAJOR * 10000 + EMBEDHEAD_VERSION_MINOR * 100 + EMBEDHEAD_VERSION_PATCH)

#endif  // EMBEDHEAD_VERSION_HPP
