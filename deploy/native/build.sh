#!/usr/bin/env bash
# Builds the harvester's native modules for a Python that has the harvester and confluent-kafka
# installed, into that Python's harvester package:
#   deploy/native/build.sh PYTHON [CACHE_DIR]
# First the log source's decoder of the usual layout's inserts (harvester/postgres/log/_usual_insert.c,
# Python's headers only), then the producer's native loop (harvester/kafka/_rdkafka_*.c).
# The loop links the librdkafka inside confluent-kafka's wheel (the one the rest of the harvester runs)
# and compiles against librdkafka's headers: /usr/include/librdkafka when installed, else those of
# Debian's librdkafka-dev package, fetched once into CACHE_DIR (default $HARVESTER_NATIVE_CACHE, else
# .local/native). librdkafka keeps its ABI across 2.x, so older headers serve the wheel's newer
# library. Without a C compiler, or without librdkafka's headers for the loop, it fails, and what it
# did not build runs in Python: the decoder's twin, the producer's loop in a child (docs/log-source.md).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$(dirname "$here")")
python=${1:?usage: build.sh PYTHON [CACHE_DIR]}
cache=${2:-${HARVESTER_NATIVE_CACHE:-$root/.local/native}}
sources=("$root/harvester/kafka/_rdkafka_loop.c" "$root/harvester/kafka/_rdkafka_reports.c")

# -P: the package that Python installed, not a checkout in the working directory. One value a line
# (paths may hold spaces).
mapfile -t found < <("$python" -P - <<'PY'
import glob, os, sysconfig
import confluent_kafka, harvester
libs = os.path.join(os.path.dirname(os.path.dirname(confluent_kafka.__file__)), "confluent_kafka.libs")
found = sorted(glob.glob(os.path.join(libs, "librdkafka*.so*")))
print(os.path.dirname(harvester.__file__), sysconfig.get_config_var("EXT_SUFFIX"),
      sysconfig.get_paths()["include"], found[0] if found else "-", sep="\n")
PY
)
[ "${#found[@]}" = 4 ] || { echo "build.sh: $python could not import harvester and confluent_kafka" >&2; exit 1; }
package=${found[0]} suffix=${found[1]} include=${found[2]} library=${found[3]}

# Written beside, then moved into place: a process that has the module loaded keeps its copy.
output=$package/postgres/log/_usual_insert$suffix
${CC:-cc} -shared -fPIC -O2 -Wall -Wextra -std=c11 -I"$include" "$root/harvester/postgres/log/_usual_insert.c" \
  -o "$output.tmp"
mv "$output.tmp" "$output"
echo "built $output"

[ "$library" != - ] || { echo "build.sh: no librdkafka in confluent-kafka's wheel" >&2; exit 1; }

headers=/usr/include
if [ ! -f "$headers/librdkafka/rdkafka.h" ]; then
  headers=$cache/librdkafka-dev/usr/include
  if [ ! -f "$headers/librdkafka/rdkafka.h" ]; then
    mkdir -p "$cache"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    # apt's package lists may be missing (a fresh image): refreshed once, where that is allowed.
    (cd "$work" && { apt-get download librdkafka-dev || { apt-get update -qq && apt-get download librdkafka-dev; }; } \
      >"$work/download.log" 2>&1) ||
      { tail -n 5 "$work/download.log" >&2
        echo "build.sh: could not fetch Debian's librdkafka-dev for librdkafka's headers" >&2; exit 1; }
    rm -rf "$cache/librdkafka-dev"
    dpkg-deb -x "$work"/librdkafka-dev_*.deb "$cache/librdkafka-dev"
  fi
fi

output=$package/kafka/_rdkafka_loop$suffix
# Two run paths: beside an installed confluent-kafka (site-packages/harvester/kafka/ ->
# site-packages/confluent_kafka.libs), and the library's own directory for an editable checkout.
${CC:-cc} -shared -fPIC -O2 -Wall -Wextra -std=c11 -D_DEFAULT_SOURCE \
  -I"$include" -I"$headers" "${sources[@]}" "$library" -lpthread \
  -Wl,-rpath,"\$ORIGIN/../../confluent_kafka.libs" -Wl,-rpath,"$(dirname "$library")" \
  -o "$output.tmp"
mv "$output.tmp" "$output"
echo "built $output"
