#!/bin/bash
# clawstream/kafka image: `kafka-start` runs the single-node KRaft broker; `kafka-health` (same script) checks it.
#
# Configuration: compose/kafka-local/server.properties.in (the one `clawstream kafka up` writes), with the listener
# opened to the container's network and advertised as $KAFKA_ADVERTISED_LISTENERS. Environment:
#   KAFKA_PORT (9092), KAFKA_CONTROLLER_PORT (9093), KAFKA_ADVERTISED_LISTENERS (PLAINTEXT://<hostname>:<port>),
#   KAFKA_DATA_DIR (/var/lib/kafka/data), KAFKA_HEAP (512m), KAFKA_CLUSTER_ID (random on first start).
set -euo pipefail
PORT="${KAFKA_PORT:-9092}"
CPORT="${KAFKA_CONTROLLER_PORT:-9093}"
DATA="${KAFKA_DATA_DIR:-/var/lib/kafka/data}"
CONF=/opt/kafka/config
LIBS=/opt/kafka/libs

if [ "$(basename "$0")" = kafka-health ]; then
  # The broker's listener accepts connections (it opens after the broker has joined its own KRaft quorum).
  exec 3<>"/dev/tcp/127.0.0.1/$PORT"
  exit 0
fi

ADV="${KAFKA_ADVERTISED_LISTENERS:-PLAINTEXT://$(hostname):$PORT}"
mkdir -p "$DATA"
props=/tmp/server.properties
# One node (node id 1, its own controller as the only voter): replication 1, min ISR 1, as `clawstream kafka up`.
sed -e "s|{port}|$PORT|g" -e "s|{controller_port}|$CPORT|g" -e "s|{log_dir}|$DATA|g" \
    -e "s|{node_id}|1|g" -e "s|{voters}|1@127.0.0.1:$CPORT|g" -e "s|{replication}|1|g" -e "s|{min_isr}|1|g" \
    -e "s|^listeners=.*|listeners=PLAINTEXT://0.0.0.0:$PORT,CONTROLLER://127.0.0.1:$CPORT|" \
    -e "s|^advertised.listeners=.*|advertised.listeners=$ADV|" "$CONF/server.properties.in" >"$props"
log4j="-Dlog4j2.configurationFile=$CONF/log4j2.properties"
if [ ! -f "$DATA/meta.properties" ]; then
  cid="${KAFKA_CLUSTER_ID:-$(java -Xmx128m "$log4j" -cp "$LIBS/*" kafka.tools.StorageTool random-uuid | tail -1)}"
  echo "[kafka-start] formatting $DATA (cluster id $cid)"
  java -Xmx256m "$log4j" -cp "$LIBS/*" kafka.tools.StorageTool format -t "$cid" -c "$props" --ignore-formatted
fi
heap="${KAFKA_HEAP:-512m}"
exec java "-Xms$heap" "-Xmx$heap" -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExplicitGCInvokesConcurrent \
  -Djava.awt.headless=true "$log4j" -cp "$LIBS/*" kafka.Kafka "$props"
