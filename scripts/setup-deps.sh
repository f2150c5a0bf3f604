#!/bin/sh
# Makes sure the Debian packages moonstep builds and tests with are present.  Installs what is missing
# when it can (root, apt-get, a reachable archive); otherwise only checks and says what is missing, so a
# host with no package access can still run the tests of a build carried there.
# Usage: setup-deps.sh [--check | --fuzz]
set -u
# gnuplot-nox draws the PNG/SVG plots of `moonstep compare` (without it: SVG from moonstep's own renderer);
# tmux drives the REPL through a terminal in tests/repl_spec.lua; python3-numpy runs the Python bridge's tests
pkgs="luajit libluajit-5.1-dev lua-busted libopenblas-dev liblapacke-dev libdlpack-dev libreadline-dev pkg-config gnuplot-nox tmux python3-numpy"
# `make fuzz` (only) asks for clang and its libFuzzer/sanitizer runtimes
[ "${1:-}" = "--fuzz" ] && pkgs="$pkgs clang libclang-rt-14-dev"
missing=""
for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ] && [ "${1:-}" != "--check" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup-deps: installing$missing"
    if { [ -n "$(ls /var/lib/apt/lists/ 2>/dev/null | grep _Packages)" ] || apt-get update -qq; } &&
       DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null; then
        missing=""
    else
        echo "setup-deps: could not install$missing (no package access?)"
    fi
fi
# what really matters is that the tools and headers are reachable (a carried bundle counts)
for tool in luajit busted; do
    command -v "$tool" >/dev/null || { echo "setup-deps: '$tool' not found on PATH"; exit 1; }
done
[ -z "$missing" ] || echo "setup-deps: packages not installed:$missing (continuing with what is reachable)"
exit 0
