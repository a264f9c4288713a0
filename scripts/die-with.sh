#!/usr/bin/env bash
# A process that goes with the run that started it. INFERPLANE_DIE_WITH_PID (the test suite
# and the benchmarks set it to their own pid): once that process is gone, this process's
# whole group is ended (TERM, then KILL 15 s later). A run killed before its teardown
# otherwise leaves its engines (~2.4 GB each) and stacks (web, workers, drains) running; an
# orphaned engine once ran a CI machine out of memory.
#   scripts/die-with.sh COMMAND [ARGS...]   run COMMAND so (it keeps this pid: exec)
#   source scripts/die-with.sh              the same for the sourcing script (engine.sh)
# The watcher leaves with the process it watches over, so none outlives its process.
if [[ -n "${INFERPLANE_DIE_WITH_PID:-}" ]]; then
  _watched=$$
  _group="$(ps -o pgid= -p $$ | tr -d ' ')"
  (
    trap '' TERM
    while kill -0 "$_watched" 2>/dev/null; do
      if ! kill -0 "$INFERPLANE_DIE_WITH_PID" 2>/dev/null; then
        kill -TERM -- "-$_group" 2>/dev/null
        sleep 15
        kill -KILL -- "-$_group" 2>/dev/null
        exit 0
      fi
      sleep 2
    done
  ) </dev/null &
fi
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  exec "$@"
fi
