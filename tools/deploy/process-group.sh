#!/usr/bin/env bash
# Run a command in its own process group and, when it ends, kill whatever is left of that group:
# engines (vLLM's EngineCore and workers) orphaned by a test killed mid-way must not outlive it.
set -u
setsid "$@" &
pid=$!
trap 'kill -TERM -- -"$pid" 2>/dev/null' INT TERM
wait "$pid"
rc=$?
kill -KILL -- -"$pid" 2>/dev/null
exit "$rc"
