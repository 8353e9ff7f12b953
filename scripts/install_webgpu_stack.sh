#!/usr/bin/env bash
# Installs what the L5 WebGPU tests need on Debian 12: Mesa's lavapipe (a software Vulkan
# driver) from bookworm-backports, since Dawn rejects stock bookworm's Mesa 22. The backports
# source is derived from the machine's own Debian source (same mirror and keyring), so no
# registry host is written here. The Python side (onnxruntime-ep-webgpu) is a test extra in
# pyproject.toml. Safe to run twice; needs root.
set -euo pipefail

if dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null | grep -q 'bpo12'; then
  echo "install_webgpu_stack: lavapipe from bookworm-backports is already installed"
  exit 0
fi
. /etc/os-release
if [ "${VERSION_CODENAME:-}" != "bookworm" ]; then
  echo "install_webgpu_stack: expected Debian 12 (bookworm), found ${PRETTY_NAME:-unknown}; install Mesa >= 25 lavapipe by hand" >&2
  exit 1
fi

target=/etc/apt/sources.list.d/bookworm-backports.sources
if [ ! -f "$target" ]; then
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    # First deb822 stanza (the main archive), with its suites swapped for backports.
    awk 'BEGIN{RS=""; ORS="\n"} NR==1' /etc/apt/sources.list.d/debian.sources \
      | grep -v '^#' | sed 's/^Suites:.*/Suites: bookworm-backports/' > "$target"
  elif [ -f /etc/apt/sources.list ]; then
    line=$(grep -E '^deb [^ ]+ bookworm ' /etc/apt/sources.list | head -n 1)
    [ -n "$line" ] || { echo "install_webgpu_stack: no bookworm line in /etc/apt/sources.list" >&2; exit 1; }
    uri=$(echo "$line" | awk '{print $2}')
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\n' "$uri" > "$target"
  else
    echo "install_webgpu_stack: found no Debian apt source to derive bookworm-backports from" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers libvulkan1 >/dev/null
echo "install_webgpu_stack: installed mesa-vulkan-drivers $(dpkg-query -W -f='${Version}' mesa-vulkan-drivers)"
