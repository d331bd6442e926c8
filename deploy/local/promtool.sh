#!/usr/bin/env bash
# Prints the path of a `promtool` (Prometheus's rule checker), for the tests of deploy/prometheus/.
#
#   deploy/local/promtool.sh
#
# Takes `promtool` from PATH when there is one; else unpacks Debian's `prometheus` package into
# $HARVESTER_CACHE_DIR (default: ~/.cache/outbox-harvester) without installing it: only the promtool
# binary is used, and no Prometheus service is set up or started.
set -euo pipefail

CACHE=${HARVESTER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/outbox-harvester}
DIR=$CACHE/prometheus-deb

die() { printf 'promtool.sh: %s\n' "$*" >&2; exit 1; }

if command -v promtool >/dev/null; then command -v promtool; exit 0; fi
if [ -x "$DIR/usr/bin/promtool" ]; then printf '%s\n' "$DIR/usr/bin/promtool"; exit 0; fi

command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null ||
  die "promtool not found; install Prometheus's promtool (Debian: the 'prometheus' package) and put it on PATH"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! (cd "$work" && apt-get download -qq prometheus >/dev/null 2>&1); then
  [ "$(id -u)" = 0 ] || die "cannot download Debian's 'prometheus' package (run 'apt-get update' as root, or put promtool on PATH)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  (cd "$work" && apt-get download -qq prometheus >/dev/null 2>&1) || die "cannot download Debian's 'prometheus' package"
fi
mkdir -p "$CACHE"
unpacked=$(mktemp -d "$DIR.XXXXXX")  # unpacked aside, then moved: a concurrent run never sees half a tree
dpkg-deb -x "$work"/prometheus_*.deb "$unpacked"
[ -x "$DIR/usr/bin/promtool" ] && rm -rf "$unpacked" || { rm -rf "$DIR"; mv "$unpacked" "$DIR"; }
[ -x "$DIR/usr/bin/promtool" ] || die "Debian's 'prometheus' package has no usr/bin/promtool"
printf '%s\n' "$DIR/usr/bin/promtool"
