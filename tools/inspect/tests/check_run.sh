#!/usr/bin/env bash
# Runs a command and checks its exit status and output (ctest helper for embedhead-inspect).
#
# usage: check_run.sh [--status N] [--expect REGEX]... [--reject REGEX]...
#                     [--lead IDS COUNT [--min-hits H]] -- command [args...]
#   --status N       the exit status required (default 0)
#   --expect REGEX   an extended regex that must match a line of stdout + stderr
#   --reject REGEX   one that must not
#   --lead IDS N     the first N ids of the tool's under-trained candidate list (the lines
#                    "  <rank> <id> ..." after "under-trained candidates") must all be among IDS
#                    (comma-separated, or @FILE to read them from FILE)
#   --min-hits H     with --lead: at least H of the first N must be among IDS (default: all N)
set -uo pipefail
status=0
expects=()
rejects=()
lead_ids=""
lead_count=0
min_hits=""
while [ $# -gt 0 ]; do
  case "$1" in
    --status) status="$2"; shift 2 ;;
    --expect) expects+=("$2"); shift 2 ;;
    --reject) rejects+=("$2"); shift 2 ;;
    --lead) lead_ids="$2"; lead_count="$3"; shift 3 ;;
    --min-hits) min_hits="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "check_run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
out="$(mktemp)"
err="$(mktemp)"
trap 'rm -f "$out" "$err"' EXIT
"$@" >"$out" 2>"$err"
actual=$?
cat "$out"
cat "$err" >&2
failed=0
if [ "$actual" -ne "$status" ]; then
  echo "check_run.sh: FAIL: exit status $actual, expected $status" >&2
  failed=1
fi
for re in "${expects[@]+"${expects[@]}"}"; do
  if ! cat "$out" "$err" | grep -Eq -- "$re"; then
    echo "check_run.sh: FAIL: no line matches: $re" >&2
    failed=1
  fi
done
for re in "${rejects[@]+"${rejects[@]}"}"; do
  if cat "$out" "$err" | grep -Eq -- "$re"; then
    echo "check_run.sh: FAIL: a line matches: $re" >&2
    failed=1
  fi
done
if [ "$lead_count" -gt 0 ]; then
  case "$lead_ids" in
    @*) lead_ids="$(tr -d ' \n' < "${lead_ids#@}")" ;;
  esac
  [ -n "$min_hits" ] || min_hits="$lead_count"
  leading="$(awk '/under-trained candidates/ {on = 1; next} on && /^ +[0-9]+ +[0-9]+ / {print $2} on && /^$/ {exit}' "$out" |
             head -n "$lead_count")"
  n="$(printf '%s\n' "$leading" | grep -c '[0-9]')"
  if [ "$n" -lt "$lead_count" ]; then
    echo "check_run.sh: FAIL: found $n candidate lines, expected at least $lead_count" >&2
    failed=1
  fi
  hits=0
  misses=""
  for id in $leading; do
    case ",$lead_ids," in
      *",$id,"*) hits=$((hits + 1)) ;;
      *) misses="$misses $id" ;;
    esac
  done
  echo "check_run.sh: $hits of the top $lead_count candidates are expected ids (required: $min_hits); others:${misses:- none}"
  if [ "$hits" -lt "$min_hits" ]; then
    echo "check_run.sh: FAIL: only $hits of the top $lead_count candidates are expected ids" >&2
    failed=1
  fi
fi
exit "$failed"
