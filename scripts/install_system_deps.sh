#!/bin/sh
# System packages gyre-jax's sandboxed executions need (config.rollout.sandbox="bwrap"): Debian's bubblewrap.
# As root with apt-get (CI, containers) it installs them; otherwise it prints the one command to run and
# exits 0 (the default training run does not need them; bwrap-sandboxed runs then fail at start naming it).
set -u
if command -v bwrap >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null; }
  if command -v bwrap >/dev/null 2>&1; then
    echo "install_system_deps: installed bubblewrap ($(bwrap --version))"
    exit 0
  fi
  echo "install_system_deps: apt-get could not install bubblewrap; run: apt-get update && apt-get install -y bubblewrap" >&2
  exit 0
fi
echo "install_system_deps: bubblewrap (bwrap) is missing; sandboxed runs need it: sudo apt-get install -y bubblewrap" >&2
exit 0
