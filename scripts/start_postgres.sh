#!/usr/bin/env bash
# Start a throwaway PostgreSQL server for the telemetry tests and print its DSN.
#
#   DSN=$(scripts/start_postgres.sh)            # stdout: postgresql://...
#   scripts/start_postgres.sh --stop            # stop it
#
# Idempotent: a second call reuses the running server. Installs Debian's `postgresql` package
# if no server binaries are found (needs root). The cluster lives in $EVERYSTOP_PG_DIR
# (default /tmp/everystop-pg), listens on 127.0.0.1 only (5432 when free, else a free port), and
# trusts local connections: it is a test fixture, never a deployment. The DSN is also written to
# $EVERYSTOP_PG_DIR/dsn.
set -euo pipefail

DIR=${EVERYSTOP_PG_DIR:-/tmp/everystop-pg}
DB=${EVERYSTOP_PG_DB:-everystop_test}
DATA=$DIR/data
log() { echo "start_postgres: $*" >&2; }

find_bindir() {
    local d
    for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
        [ -x "$d/initdb" ] && { echo "$d"; return; }
    done
    command -v initdb >/dev/null 2>&1 && dirname "$(command -v initdb)"
}

BIN=$(find_bindir || true)
if [ -z "$BIN" ]; then
    [ "$(id -u)" = 0 ] || { log "PostgreSQL is not installed and we are not root"; exit 1; }
    log "installing Debian's postgresql package"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq postgresql >&2
    BIN=$(find_bindir)
fi

# PostgreSQL refuses to run as root: run the server as the `postgres` account then.
if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    as_pg() { runuser -u postgres -- "$@"; }
    PGUSER=postgres
else
    as_pg() { "$@"; }
    PGUSER=$(id -un)
fi

mkdir -p "$DIR"
[ "$(id -u)" = 0 ] && chown postgres "$DIR"

if [ "${1:-}" = "--stop" ]; then
    [ -f "$DATA/PG_VERSION" ] && as_pg "$BIN/pg_ctl" -D "$DATA" -m fast stop >&2 || true
    exit 0
fi

if [ ! -f "$DATA/PG_VERSION" ]; then
    log "initializing a cluster in $DATA"
    as_pg "$BIN/initdb" -D "$DATA" -U "$PGUSER" --auth=trust -E UTF8 --no-sync >/dev/null
fi

if as_pg "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
    PORT=$(cat "$DIR/port")
else
    PORT=$(python3 - <<'EOF'
import socket
def free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return 0
        return s.getsockname()[1]
print(free(5432) or free(0))
EOF
)
    echo "$PORT" > "$DIR/port"
    # fsync off and a socket directory inside the cluster: fast, and no /var/run permissions.
    as_pg "$BIN/pg_ctl" -D "$DATA" -l "$DIR/server.log" -w -t 30 start \
        -o "-h 127.0.0.1 -p $PORT -k $DATA -c fsync=off -c synchronous_commit=off -c full_page_writes=off" >&2
fi

if ! as_pg "$BIN/psql" -h 127.0.0.1 -p "$PORT" -U "$PGUSER" -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = '$DB'" | grep -q 1; then
    as_pg "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U "$PGUSER" "$DB"
fi

DSN="postgresql://$PGUSER@127.0.0.1:$PORT/$DB"
echo "$DSN" > "$DIR/dsn"
echo "$DSN"
