#!/usr/bin/env bash
# A PostgreSQL primary with a synchronous streaming-replication standby on loopback, from the
# same binaries as services.sh, for failover tests.
#
#   deploy/local/pgpair.sh start|stop|status|primary|crash|promote|failover
#
# Two nodes, a (PGPAIR_PORT) and b (PGPAIR_PORT+1); at first a is the primary. Every commit waits
# until the standby has flushed it (synchronous_standby_names names both nodes, so whichever is
# the standby counts). `crash` stops the primary the way a crash does (immediate: no shutdown
# checkpoint); `promote` promotes the standby, then clones the old primary afresh from the new one
# (pg_basebackup) and starts it as the new standby: until it is attached, commits on the new
# primary wait, which is what a synchronous standby promises. `failover` does both. `primary`
# prints the primary's port.
#
# For the log source (docs/log-source.md#failover): wal_level = logical, and the standby streams
# through a physical slot of the primary (pgpair_<node>) with hot_standby_feedback and a dbname in
# its primary_conninfo. On PostgreSQL 17+ the standby also synchronizes the primary's failover slots
# (sync_replication_slots = on), and the primary's logical walsenders send nothing the standby has
# not received (synchronized_standby_slots names the standby's physical slot): after a promotion,
# the log source's slot is there, no further than the new primary's log.
#
# Clients connect with a multi-host DSN:
#   host=127.0.0.1,127.0.0.1 port=$PGPAIR_PORT,$((PGPAIR_PORT+1)) target_session_attrs=read-write ...
#
# Environment:
#   PGPAIR_PORT           port of node a (default 39200); node b uses the next one
#   HARVESTER_LOCAL_DIR   data and logs go to its pgpair/ (default <repo>/.local)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STATE=${HARVESTER_LOCAL_DIR:-$ROOT/.local}/pgpair
PORT=${PGPAIR_PORT:-39200}
PG_USER=harvester
PG_PASSWORD=local-dev-secret
PG_DB=harvester

say() { printf '%s\n' "$*"; }
die() { printf 'pgpair.sh: %s\n' "$*" >&2; exit 1; }

# The binaries services.sh uses (installing them if need be; PG_FROM chooses as there).
BIN=$(bash "$ROOT/deploy/local/services.sh" pg-bindir) || die "PostgreSQL server binaries not found"

as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

port_of() { if [ "$1" = a ]; then echo "$PORT"; else echo $((PORT + 1)); fi; }
other() { if [ "$1" = a ]; then echo b; else echo a; fi; }
data() { echo "$STATE/$1/data"; }
running() { [ -f "$(data "$1")/postmaster.pid" ] && as_pg "$BIN/pg_ctl" -D "$(data "$1")" status >/dev/null 2>&1; }
psql_at() { as_pg "$BIN/psql" -h 127.0.0.1 -p "$(port_of "$1")" -U postgres -d postgres -qtAX -v ON_ERROR_STOP=1 -c "$2"; }
version() { "$BIN/pg_config" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/'; }
is_primary() { running "$1" && [ "$(psql_at "$1" 'SELECT pg_is_in_recovery()')" = f ]; }

start_node() {
  local n=$1 try
  running "$n" && return 0
  # The ports may lie in the kernel's ephemeral range, briefly held by some outgoing connection.
  for try in 1 2 3 4 5; do
    as_pg "$BIN/pg_ctl" -D "$(data "$n")" -l "$STATE/$n/postgres.log" -o "-p $(port_of "$n") -c cluster_name=$n" -w -t 60 start >/dev/null && return 0
    grep -q "could not bind" "$STATE/$n/postgres.log" || break
    sleep 2
  done
  tail -n 20 "$STATE/$n/postgres.log" >&2; die "node $n did not start"
}

init_primary() {
  local n=$1 dir; dir=$(data "$n")
  as_pg "$BIN/initdb" -D "$dir" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >"$STATE/$n/initdb.log" 2>&1 ||
    { tail -n 20 "$STATE/$n/initdb.log" >&2; die "initdb failed"; }
  cat >>"$dir/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
unix_socket_directories = '$STATE'
max_connections = 200
shared_buffers = 128MB
fsync = on
wal_level = logical
max_wal_senders = 10
max_replication_slots = 10
wal_keep_size = 256MB
hot_standby = on
hot_standby_feedback = on
synchronous_commit = on
CONF
  if [ "$(version)" -ge 17 ]; then echo "sync_replication_slots = on" >>"$dir/postgresql.conf"; fi
  # Loopback only, trust (replication too): this pair exists for local tests.
  printf 'local all all trust\nhost all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n' >"$dir/pg_hba.conf"
}

# Clone node $1 from the primary $2 and configure it as its standby (application_name = node name,
# which synchronous_standby_names lists), streaming through its physical slot pgpair_$1 on $2 (made
# afresh: one left by an earlier clone of this node would start from where that one stopped).
# -R writes the -d string's dbname into primary_conninfo, which the slot synchronization needs.
clone() {
  local n=$1 from=$2
  rm -rf "$(data "$n")"
  psql_at "$from" "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = 'pgpair_$n'" >/dev/null
  psql_at "$from" "SELECT pg_create_physical_replication_slot('pgpair_$n', true)" >/dev/null
  as_pg "$BIN/pg_basebackup" -D "$(data "$n")" -R -X stream -c fast -S "pgpair_$n" \
    -d "host=127.0.0.1 port=$(port_of "$from") user=postgres dbname=postgres application_name=$n" >"$STATE/$n/basebackup.log" 2>&1 ||
    { tail -n 20 "$STATE/$n/basebackup.log" >&2; die "pg_basebackup of node $n failed"; }
}

start_all() {
  mkdir -p "$STATE/a" "$STATE/b"
  if [ "$(id -u)" = 0 ]; then chown -R postgres "$STATE"; fi
  if [ ! -f "$(data a)/PG_VERSION" ] && [ ! -f "$(data b)/PG_VERSION" ]; then
    init_primary a
  fi
  # Whichever node is not in recovery (no standby.signal) starts first: it is the primary.
  local first=a
  [ -f "$(data a)/standby.signal" ] && first=b
  start_node "$first"
  if ! as_pg "$BIN/psql" -h 127.0.0.1 -p "$(port_of "$first")" -U postgres -d postgres -qtAX \
      -c "SELECT 1 FROM pg_roles WHERE rolname='$PG_USER'" | grep -q 1; then
    psql_at "$first" "CREATE ROLE $PG_USER LOGIN SUPERUSER PASSWORD '$PG_PASSWORD'" >/dev/null
    psql_at "$first" "CREATE DATABASE $PG_DB OWNER $PG_USER" >/dev/null
  fi
  # The standby is cloned afresh at every start: its primary_conninfo names the primary's port,
  # which may not be this start's (PGPAIR_PORT comes from free ports).
  local second; second=$(other "$first")
  stop_node "$second" fast
  clone "$second" "$first"
  start_node "$second"
  # Only now: with no standby attached, a synchronous primary would wait forever for the role
  # and database above. pg_basebackup copies postgresql.auto.conf, so every later primary waits too.
  synchronous "$first" "$second"
  say "pgpair: primary on 127.0.0.1:$(port_of "$first"), synchronous standby on 127.0.0.1:$(port_of "$second")"
}

# Commits on primary $1 wait for a standby's flush from now on (the copy it was cloned from may
# predate the setting); on 17+ its logical walsenders wait for standby $2's physical slot too.
synchronous() {
  psql_at "$1" "ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 (a, b)'" >/dev/null
  if [ "$(version)" -ge 17 ]; then
    psql_at "$1" "ALTER SYSTEM SET synchronized_standby_slots = 'pgpair_$2'" >/dev/null
  fi
  psql_at "$1" "SELECT pg_reload_conf()" >/dev/null
}

stop_node() { running "$1" && as_pg "$BIN/pg_ctl" -D "$(data "$1")" -m "$2" -w -t 60 stop >/dev/null; return 0; }

primary() {
  local n
  for n in a b; do if is_primary "$n"; then echo "$n"; return 0; fi; done
  die "no primary is running"
}

crash() { stop_node "$(primary)" immediate; }

# Promote the standby of a crashed primary, then clone the old primary from it as its standby.
promote() {
  local old new
  if running a; then new=a; else new=b; fi
  old=$(other "$new")
  running "$old" && die "both nodes run: crash the primary first"
  as_pg "$BIN/pg_ctl" -D "$(data "$new")" -w -t 60 promote >/dev/null || die "promoting node $new failed"
  clone "$old" "$new"
  synchronous "$new" "$old"
  start_node "$old"
  say "pgpair: node $old crashed, node $new promoted (127.0.0.1:$(port_of "$new")), node $old is its standby"
}

case "${1:-}" in
  start) start_all ;;
  stop) stop_node a fast; stop_node b fast; say "pgpair: stopped" ;;
  status) for n in a b; do if running "$n"; then say "node $n: running on $(port_of "$n")"; else say "node $n: stopped"; fi; done ;;
  primary) port_of "$(primary)" ;;
  crash) crash ;;
  promote) promote ;;
  failover) crash; promote ;;
  *) die "usage: $0 start|stop|status|primary|crash|promote|failover" ;;
esac
