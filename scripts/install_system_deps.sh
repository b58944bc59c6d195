#!/bin/sh
# System packages gyre-jax's tests and sandboxed executions need, from Debian:
# - bubblewrap: sandboxed executions (config.rollout.sandbox="bwrap");
# - chromium: the live view's browser test (tests/commands/test_live.py drives it headless; docs/commands.md).
# As root with apt-get (CI, containers) it installs the missing ones; otherwise it prints the one command to run and
# exits 0 (the default training run needs neither; bwrap-sandboxed runs then fail at start naming it).
set -u
missing=""
command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
if [ -z "$missing" ]; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  apt-get install -y -q $missing >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $missing >/dev/null; }
  still=""
  command -v bwrap >/dev/null 2>&1 || still="$still bubblewrap"
  command -v chromium >/dev/null 2>&1 || still="$still chromium"
  if [ -z "$still" ]; then
    echo "install_system_deps: installed$missing"
    exit 0
  fi
  echo "install_system_deps: apt-get could not install$still; run: apt-get update && apt-get install -y$still" >&2
  exit 0
fi
echo "install_system_deps:$missing missing (sandboxed runs need bubblewrap, the live view's browser test chromium): sudo apt-get install -y$missing" >&2
exit 0
