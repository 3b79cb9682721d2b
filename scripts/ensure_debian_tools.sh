#!/usr/bin/env bash
# Make sure the command-line tools the operator tests drive are installed; print their paths.
#
#   scripts/ensure_debian_tools.sh prometheus            # -> /usr/bin/prometheus
#   scripts/ensure_debian_tools.sh chromium chromedriver # -> two lines
#
# Each tool missing from PATH (and /usr/bin, /usr/lib/chromium) is installed from its Debian
# package with apt-get (needs root), in one apt run; `apt-get update` runs only when the package
# lists do not know a package yet. Exits non-zero when a tool cannot be had: a test that needs it
# must fail, not skip. The time apt took goes to stderr, so CI logs show what installs cost.
set -euo pipefail
log() { echo "ensure_debian_tools: $*" >&2; }

package_of() {
    case "$1" in
        prometheus) echo prometheus ;;
        chromium) echo chromium ;;
        chromedriver) echo chromium-driver ;;
        *) log "no Debian package known for $1"; return 1 ;;
    esac
}

find_tool() {
    local p
    p=$(command -v "$1" 2>/dev/null || true)
    [ -z "$p" ] && for d in /usr/bin /usr/lib/chromium; do
        [ -x "$d/$1" ] && { p="$d/$1"; break; }
    done
    [ -n "$p" ] && echo "$p"
}

missing=()
for tool in "$@"; do
    find_tool "$tool" >/dev/null || missing+=("$(package_of "$tool")")
done

if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || { log "missing ${missing[*]} and not root"; exit 1; }
    export DEBIAN_FRONTEND=noninteractive
    start=$(date +%s)
    if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
        apt-get update -qq >&2
    fi
    log "installing ${missing[*]}"
    # No recommends: prometheus would pull in node-exporter and friends, chromium its fonts.
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
    log "apt took $(( $(date +%s) - start )) s for ${missing[*]}"
fi

for tool in "$@"; do
    find_tool "$tool" || { log "$tool still missing after install"; exit 1; }
done
