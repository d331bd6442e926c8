#!/usr/bin/env bash
# A KRaft Kafka cluster of N nodes on loopback (each node broker and controller), from the same jars
# as services.sh, for fault tests: brokers killed and restarted one at a time.
#
#   deploy/local/cluster.sh start|stop|status|kill-node I|stop-node I|start-node I
#
# Node I (1..N, at most 9) listens on
#   KAFKA_CLUSTER_PORT+I-1         PLAINTEXT, advertised as itself (tests, writers, checkers)
#   KAFKA_CLUSTER_PORT+10+I-1      CONTROLLER
#   KAFKA_CLUSTER_PORT+20K+I-1     PROXIEDK (K = 1..KAFKA_CLUSTER_PROXIED), advertised as
#                                  KAFKA_CLUSTER_PORT+20K+10+I-1: a client that bootstraps there
#                                  reaches every broker through TCP proxies a test runs on those
#                                  ports, so the test can cut that one client off
# With 3 nodes or more: default.replication.factor=3 and min.insync.replicas=2 (internal topics
# too), so one broker can die without losing an acknowledged (acks=all) record or availability.
#
# Environment:
#   KAFKA_CLUSTER_NODES   number of nodes (default 3)
#   KAFKA_CLUSTER_PORT    first port (default 39100); the cluster uses this port to +20K+19
#   KAFKA_CLUSTER_PROXIED number of proxied listeners K (default 1, at most 3)
#   KAFKA_HEAP            each broker's JVM heap (default 512m)
#   KAFKA_JVM_OPTIONS     the brokers' other JVM options (default -XX:+UseG1GC)
#   HARVESTER_LOCAL_DIR   data, logs and pid files go to its kafka-cluster/ (default <repo>/.local)
#   KAFKA_VERSION         as in services.sh, which resolves the jars
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STATE=${HARVESTER_LOCAL_DIR:-$ROOT/.local}/kafka-cluster
CACHE=${HARVESTER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/outbox-harvester}
NODES=${KAFKA_CLUSTER_NODES:-3}
PROXIED=${KAFKA_CLUSTER_PROXIED:-1}
BASE=${KAFKA_CLUSTER_PORT:-39100}
KAFKA_VERSION=${KAFKA_VERSION:-4.1.1}
KAFKA_HEAP=${KAFKA_HEAP:-512m}
KAFKA_JVM_OPTIONS=${KAFKA_JVM_OPTIONS:--XX:+UseG1GC}
LIBS=$CACHE/kafka-$KAFKA_VERSION/libs

say() { printf '%s\n' "$*"; }
die() { printf 'cluster.sh: %s\n' "$*" >&2; exit 1; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

client_port() { echo $((BASE + $1 - 1)); }
controller_port() { echo $((BASE + 10 + $1 - 1)); }
proxied_port() { echo $((BASE + 20 * $2 + $1 - 1)); }  # node, listener set
proxy_port() { echo $((BASE + 20 * $2 + 10 + $1 - 1)); }
node_dir() { echo "$STATE/node-$1"; }
pid_file() { echo "$(node_dir "$1")/kafka.pid"; }

running() { local f; f=$(pid_file "$1"); [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null; }

java_cp() { java -Xms128m -Xmx"$KAFKA_HEAP" $KAFKA_JVM_OPTIONS -Dlog4j2.configurationFile="$STATE/log4j2.properties" -cp "$LIBS/*" "$@"; }

configure() {
  local i=$1 dir voters="" j rf=$((NODES < 3 ? NODES : 3)) isr=$((NODES < 3 ? 1 : 2))
  dir=$(node_dir "$i")
  for j in $(seq 1 "$NODES"); do voters+="${voters:+,}$j@127.0.0.1:$(controller_port "$j")"; done
  local k listeners="PLAINTEXT://127.0.0.1:$(client_port "$i")" advertised protocols="PLAINTEXT:PLAINTEXT"
  advertised=$listeners
  for k in $(seq 1 "$PROXIED"); do
    listeners+=",PROXIED$k://127.0.0.1:$(proxied_port "$i" "$k")"
    advertised+=",PROXIED$k://127.0.0.1:$(proxy_port "$i" "$k")"
    protocols+=",PROXIED$k:PLAINTEXT"
  done
  mkdir -p "$dir"
  cat >"$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=$i
controller.quorum.voters=$voters
listeners=$listeners,CONTROLLER://127.0.0.1:$(controller_port "$i")
advertised.listeners=$advertised
controller.listener.names=CONTROLLER
listener.security.protocol.map=$protocols,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$dir/data
num.partitions=1
auto.create.topics.enable=false
default.replication.factor=$rf
min.insync.replicas=$isr
unclean.leader.election.enable=false
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$isr
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
transaction.max.timeout.ms=900000
initial.broker.registration.timeout.ms=600000
PROPS
}

start_node() {
  local i=$1 dir
  dir=$(node_dir "$i")
  if running "$i"; then return 0; fi
  local wait=0
  # A port of the kernel's ephemeral range can be some client's for a moment: give it 30 s.
  while port_open "$(client_port "$i")"; do
    [ $wait -ge 60 ] && die "port $(client_port "$i") is taken by a process this script did not start"
    wait=$((wait + 1)); sleep 0.5
  done
  configure "$i"
  if [ ! -f "$dir/data/meta.properties" ]; then
    java_cp kafka.tools.StorageTool format -t "$(cat "$STATE/cluster.id")" -c "$dir/server.properties" >"$dir/format.log" 2>&1 ||
      { tail -n 20 "$dir/format.log" >&2; die "formatting node $i failed"; }
  fi
  nohup java -Xms128m -Xmx"$KAFKA_HEAP" $KAFKA_JVM_OPTIONS -Dlog4j2.configurationFile="$STATE/log4j2.properties" \
    -cp "$LIBS/*" kafka.Kafka "$dir/server.properties" >>"$dir/kafka.log" 2>&1 </dev/null &
  echo $! >"$(pid_file "$i")"
}

# Every listener open (the broker binds them one by one and exits if one is taken).
listening() {
  local k
  port_open "$(client_port "$1")" || return 1
  for k in $(seq 1 "$PROXIED"); do port_open "$(proxied_port "$1" "$k")" || return 1; done
}

# Seconds a node may take to open its ports: 120 on an idle machine, times the load per core when
# the machine is busier (at a load of 39 on 2 cores a broker took longer than 120 s), at most 900.
# Read again on every look, so a load that rises during the start-up stretches it too.
start_budget() {
  awk -v cores="$(nproc 2>/dev/null || echo 1)" \
    '{ f = $1 / cores; if (f < 1) f = 1; b = 120 * f; if (b > 900) b = 900; printf "%d\n", b }' /proc/loadavg
}

wait_node() {
  local i=$1 started=$SECONDS budget=120 now tries=0
  until listening "$i" && running "$i"; do
    if ! running "$i"; then
      # Its ports lie in the kernel's ephemeral range: an outgoing connection of any process may
      # hold one for a while; on a loaded machine the quorum can take longer than the broker waits
      # for it ("waiting for the controller to acknowledge", seen at a load of 35 on 2 cores). Try
      # again, a few times.
      if grep -qE "Address already in use|waiting for the controller to acknowledge" "$(node_dir "$i")/kafka.log" &&
        [ $tries -lt 10 ]; then
        tries=$((tries + 1)); : >"$(node_dir "$i")/kafka.log"; sleep 3; start_node "$i"; continue
      fi
      tail -n 30 "$(node_dir "$i")/kafka.log" >&2; die "node $i exited during start-up"
    fi
    now=$(start_budget)
    [ "$now" -gt "$budget" ] && budget=$now
    [ $((SECONDS - started)) -ge "$budget" ] &&
      die "node $i did not open its ports within $budget s (load $(cut -d' ' -f1-3 /proc/loadavg); log: $(node_dir "$i")/kafka.log)"
    sleep 0.5
  done
}

stop_node() {
  local i=$1 signal=$2 pid
  if running "$i"; then
    pid=$(cat "$(pid_file "$i")")
    kill "-$signal" "$pid"
    for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$(pid_file "$i")"
}

start_all() {
  [ -f "$LIBS/.complete" ] || bash "$ROOT/deploy/local/services.sh" resolve-kafka
  mkdir -p "$STATE"
  [ -f "$STATE/cluster.id" ] || java_cp kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1 >"$STATE/cluster.id"
  cat >"$STATE/log4j2.properties" <<'LOG'
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.stdout.ref = STDOUT
LOG
  local i
  for i in $(seq 1 "$NODES"); do start_node "$i"; done
  for i in $(seq 1 "$NODES"); do wait_node "$i"; done
  say "kafka cluster: $NODES nodes on 127.0.0.1:$(client_port 1)..$(client_port "$NODES")"
}

node_arg() {
  [[ "${1:-}" =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ] && [ "$1" -le "$NODES" ] || die "node must be 1..$NODES"
}

case "${1:-}" in
  start) start_all ;;
  stop)
    # All at once: stopped one by one, the last brokers wait for a controller quorum that is gone.
    for i in $(seq 1 "$NODES"); do stop_node "$i" TERM & done
    wait
    say "kafka cluster: stopped" ;;
  status)
    rc=0
    for i in $(seq 1 "$NODES"); do
      if running "$i"; then say "node $i: running on 127.0.0.1:$(client_port "$i")"; else say "node $i: stopped"; rc=1; fi
    done
    exit $rc ;;
  kill-node) node_arg "${2:-}"; stop_node "$2" KILL ;;
  stop-node) node_arg "${2:-}"; stop_node "$2" TERM ;;
  start-node) node_arg "${2:-}"; start_node "$2"; wait_node "$2" ;;
  *) die "usage: $0 start|stop|status|kill-node I|stop-node I|start-node I" ;;
esac
