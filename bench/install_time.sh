#!/usr/bin/env bash
# Time README's quick start on this machine with pip's cache off: `python3 -m venv`, then
# `pip install -e SRC`, then the first `duplex-gateway` start (model packages fetched and
# converted into an empty cache) until /healthz answers. Prints one JSON object, then
# which weight carriers or llama.cpp packages pip installed (there should be none).
#
#     bench/install_time.sh [SRC=.] [VENV=/tmp/venv-fresh] [CACHE=/tmp/fresh_cache] [PORT=8799]
#
# It deletes VENV and CACHE first; it uses the network, so run it on a quiet machine.
set -u
SRC=${1:-.}; VENV=${2:-/tmp/venv-fresh}; CACHE=${3:-/tmp/fresh_cache}; PORT=${4:-8799}
export PIP_NO_CACHE_DIR=1
rm -rf "$VENV" "$CACHE"
t0=$(date +%s.%N)
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -e "$SRC" || { echo "pip install failed" >&2; exit 1; }
t1=$(date +%s.%N)
DUPLEX_GATEWAY_CACHE="$CACHE" "$VENV/bin/duplex-gateway" --port "$PORT" >"$CACHE.log" 2>&1 &
pid=$!
until curl -sf "http://127.0.0.1:$PORT/healthz" >/dev/null; do
  kill -0 "$pid" 2>/dev/null || { echo "the gateway exited; see $CACHE.log" >&2; exit 1; }
  sleep 0.2
done
t2=$(date +%s.%N)
kill "$pid"; wait "$pid"
printf '{"pip_install_s": %.1f, "first_start_s": %.1f, "total_s": %.1f, "load_average": "%s"}\n' \
  "$(echo "$t1 - $t0" | bc)" "$(echo "$t2 - $t1" | bc)" "$(echo "$t2 - $t0" | bc)" \
  "$(cut -d' ' -f1-3 /proc/loadavg)"
"$VENV/bin/pip" list 2>/dev/null | grep -i -E "llama|^llm|smollm2|piper-voice|silero-vad|noter-models" \
  || echo "not installed: llama-cpp-python, llm, llm-gguf or any weight carrier"
