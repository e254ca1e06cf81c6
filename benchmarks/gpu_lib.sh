# Shared by the GPU shell scripts in benchmarks/: sourced after `set -euo pipefail`, never run.
# Puts the repository on PYTHONPATH and gives
#   run NAME COMMAND...         a failed command is reported and the script goes on (failed=1);
#   start_server LOG PORT ARGS  `kvserve serve ARGS --port PORT` in the background (pid in
#                               $server, stopped on exit), returning once /ready answers;
#   stop_server                 SIGTERM to it and wait.
# The scripts end with `exit $failed`.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0
server=

run() {
    local name=$1
    shift
    echo "== $name" >&2
    "$@" || { echo "FAILED: $name" >&2; failed=1; }
}

stop_server() {
    [[ -n $server ]] || return 0
    kill -TERM "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    server=
}

start_server() {
    local log=$1 port=$2
    shift 2
    python -m kvserve.cli serve "$@" --port "$port" --disable-access-log \
        --uvicorn-log-level warning > "$log" 2>&1 &
    server=$!
    trap stop_server EXIT
    for _ in $(seq 1 300); do
        curl -sf "http://127.0.0.1:$port/ready" > /dev/null && return 0
        kill -0 "$server" 2>/dev/null || { tail -20 "$log" >&2; server=; return 1; }
        sleep 1
    done
    echo "the server did not become ready in 300 s: $log" >&2
    return 1
}
