#!/usr/bin/env bash
# Debian's bubblewrap (bwrap), which the Python tool's sandbox runs tool code in
# (megatron_tepo/environments/processes.py): present, nothing to do; missing, installed with apt-get
# as root; elsewhere (not root, or apt-get failed) one line on stderr says what to run, and the
# status is 1.
#   bash tools/install_bubblewrap.sh PREFIX [CONSEQUENCE]
# PREFIX starts the line (the caller's name); CONSEQUENCE ends it (what happens without bwrap).
# Called by tools/test.sh and examples/tiny_tepo/run.sh (--task tir).
prefix=${1:-install_bubblewrap.sh}
consequence=${2:-}
command -v bwrap >/dev/null 2>&1 && exit 0
if ((EUID != 0)); then
  echo "$prefix: bubblewrap (bwrap) is missing and this is not root: \`sudo apt-get install -y bubblewrap\`${consequence:+; $consequence}" >&2
  exit 1
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1; } \
  || { echo "$prefix: apt-get install bubblewrap failed${consequence:+: $consequence}" >&2; exit 1; }
