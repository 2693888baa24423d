#!/bin/sh
# The install steps every image shares (run by its Dockerfile at build time, as root):
#   install.sh deps REQUIREMENTS LOCK   the venv /opt/venv with REQUIREMENTS (the image's direct pins,
#                                       images/<name>/requirements*.txt); every transitive version
#                                       pinned by LOCK, the image's own lock resolved for its platform
#                                       (requirements/images/<name>-<cpu|gpu>.txt, images/lock.py)
#   install.sh compiler                 gcc/g++ (GPU images): Triton builds its launcher with a C
#                                       compiler at the first kernel launch, torch.compile's C++ with
#                                       g++; pinned for Debian bookworm, libc6-dev exactly the base's
#                                       libc6 (they must match; the base's patch level moves with its tag)
#   install.sh app                      rollpacker itself (no dependencies) + the health check
set -eu
case "${1:-}" in
deps)
    req=${2:?usage: install.sh deps REQUIREMENTS LOCK}
    lock=${3:?usage: install.sh deps REQUIREMENTS LOCK}
    python3 -m venv /opt/venv
    /opt/venv/bin/pip install --no-cache-dir -r "$req" -c "$lock"
    ;;
compiler)
    apt-get update
    apt-get install -y --no-install-recommends gcc=4:12.2.0-3 g++=4:12.2.0-3 \
        "libc6-dev=$(dpkg-query -W -f='${Version}' libc6)"
    rm -rf /var/lib/apt/lists/*
    gcc --version > /dev/null
    ;;
app)
    /opt/venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation /opt/rollpacker/app
    rm -rf /opt/rollpacker/app/build
    install -m 0755 /opt/rollpacker/healthcheck.py /usr/local/bin/rollpacker-healthcheck
    /opt/venv/bin/rollpacker --help > /dev/null
    ;;
*)
    echo "usage: install.sh deps REQUIREMENTS LOCK | install.sh compiler | install.sh app" >&2
    exit 2
    ;;
esac
