#!/bin/sh
# NVIDIA Dynamo's standalone KV indexer (ai-dynamo-runtime) listening to the engines of one
# node AND to that node's kvtierd, so that a block in the node's pool counts for every
# engine of the node (docs/guides/routers.md).
#
# Each engine is an instance id, optionally with its own KV-event endpoint (its GPU blocks,
# dp_rank 0). kvtierd's endpoint is registered under every instance id at dp_rank
# $KVTIERD_DP_RANK (1: a rank the engines do not use), with its replay endpoint, through
# the indexer's POST /register.
#
#   ENGINES="1=tcp://10.0.0.7:5557 2=tcp://10.0.0.7:5567" \
#   KVTIERD_EVENTS=tcp://10.0.0.7:5600 KVTIERD_REPLAY=tcp://10.0.0.7:5601 \
#   BLOCK_SIZE=16 ./dynamo-indexer.sh
#
# ENGINES         "id[=endpoint] ..." (an engine without events of its own: just its id)
# KVTIERD_EVENTS  [kv_events] endpoint of the node's daemon
# KVTIERD_REPLAY  [kv_events] replay_endpoint ("" = none: a lost batch stays lost)
# BLOCK_SIZE      the engines' block size in tokens (Dynamo drops stores of another size)
# MODEL           the model name /query is asked with (default "default")
# PORT            the indexer's HTTP port (default 8090)
# PYTHON          the Python with ai-dynamo-runtime installed (default python3)
set -eu

: "${ENGINES:?ENGINES=\"1=tcp://host:5557 2=...\"}"
: "${KVTIERD_EVENTS:?KVTIERD_EVENTS=tcp://host:port of the daemon's [kv_events] endpoint}"
: "${BLOCK_SIZE:?BLOCK_SIZE=the engines' block size in tokens}"
KVTIERD_REPLAY=${KVTIERD_REPLAY:-}
KVTIERD_DP_RANK=${KVTIERD_DP_RANK:-1}
MODEL=${MODEL:-default}
PORT=${PORT:-8090}
PYTHON=${PYTHON:-python3}
URL="http://127.0.0.1:$PORT"

workers=""
for engine in $ENGINES; do
    case "$engine" in
    *=*) workers="$workers,$engine" ;;
    esac
done

set -- -m dynamo.indexer --port "$PORT" --block-size "$BLOCK_SIZE" --model-name "$MODEL"
if [ -n "$workers" ]; then
    set -- "$@" --workers "${workers#,}"
fi
"$PYTHON" "$@" &
indexer=$!
trap 'kill "$indexer" 2>/dev/null' INT TERM

tries=0
until curl -fsS "$URL/health" >/dev/null 2>&1; do
    tries=$((tries + 1))
    if [ "$tries" -gt 300 ] || ! kill -0 "$indexer" 2>/dev/null; then
        echo "dynamo-indexer.sh: the indexer did not answer $URL/health" >&2
        kill "$indexer" 2>/dev/null
        exit 1
    fi
    sleep 0.1
done

replay=""
if [ -n "$KVTIERD_REPLAY" ]; then
    replay=", \"replay_endpoint\": \"$KVTIERD_REPLAY\""
fi
for engine in $ENGINES; do
    id=${engine%%=*}
    curl -fsS -X POST "$URL/register" -H 'Content-Type: application/json' -d "{
        \"instance_id\": $id, \"dp_rank\": $KVTIERD_DP_RANK, \"endpoint\": \"$KVTIERD_EVENTS\",
        \"model_name\": \"$MODEL\", \"block_size\": $BLOCK_SIZE$replay}" >/dev/null || {
        echo "dynamo-indexer.sh: /register of instance $id refused" >&2
        kill "$indexer"
        exit 1
    }
    echo "dynamo-indexer.sh: instance $id: kvtierd's events at dp_rank $KVTIERD_DP_RANK"
done
wait "$indexer"
