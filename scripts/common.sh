# Shared by scripts/demo.sh and scripts/test.sh (sourced, not run).

phase() {
  printf '\n==================================================================\n'
  printf '== %s\n' "$*"
  printf '==================================================================\n'
}

# ccache: EMBEDHEAD_CCACHE=1 uses it, 0 does not; unset, it is used when installed and CI is not
# set (a CI clone on a new machine starts from a cold cache, where it only costs a little).
embedhead_launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=)
case "${EMBEDHEAD_CCACHE:-auto}" in
  1) embedhead_launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache) ;;
  auto)
    if [ -z "${CI:-}" ] && command -v ccache > /dev/null 2>&1; then
      embedhead_launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    fi ;;
esac

# configure <build dir> <c++ compiler> <cmake arguments...>: a build directory made before with
# another generator or compiler is emptied first (CMake cannot switch either in place).
configure() {
  local dir="$1" cxx="$2"
  shift 2
  cxx="$(command -v "$cxx")" || { echo "configure: error: compiler '$2' not found" >&2; return 1; }
  # Ninja when it is installed (it keeps both cores busy to the last target), else CMake's
  # default. Looked up here, after scripts/install_deps.sh has run.
  local embedhead_generator=()
  if command -v ninja > /dev/null 2>&1; then
    embedhead_generator=(-G Ninja)
  fi
  local cache="$dir/CMakeCache.txt" want_gen="${embedhead_generator[1]:-}"
  if [ -f "$cache" ]; then
    local old_gen old_cxx
    old_gen="$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$cache")"
    old_cxx="$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$cache")"
    if { [ -n "$want_gen" ] && [ "$old_gen" != "$want_gen" ]; } ||
       [ "$cxx" != "$old_cxx" ]; then
      echo "configure: $dir was made with '$old_gen' / '$old_cxx'; starting it afresh"
      rm -rf "$dir"
    fi
  fi
  cmake -S . -B "$dir" "${embedhead_generator[@]}" "-DCMAKE_CXX_COMPILER=$cxx" "${embedhead_launcher[@]}" "$@"
}
