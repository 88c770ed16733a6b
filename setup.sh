#!/usr/bin/env bash
# The two commands of the README:
#   ./setup.sh up     install everything (Debian packages, the Python package, the base layer)
#                     and run the embedded single-node DSec in the foreground
#   ./setup.sh test   install what the tests need, then run ruff, mypy and the whole test suite
#   ./setup.sh bench NAME [options]   install what the benchmark needs, run bench/NAME.py (usage below)
# Both are idempotent: a second run installs nothing and starts at once.
set -euo pipefail
cd "$(dirname "$0")"
repo=$(pwd)

apt_packages=(python3 crun skopeo umoci zstd erofs-utils debootstrap busybox-static python3-venv python3-dev iproute2 util-linux ca-certificates
  qemu-system-x86 qemu-utils e2fsprogs kmod gcc libc6-dev  # the second line: microVMs (QEMU, qemu-img for their disks, the guest kit)
  btrfs-progs  # the third: the node's file system for per-sandbox disk quotas (disk_limit_mb)
  libseccomp-dev  # the fourth: dsec-enter, the containers' exec helper (with gcc, libc6-dev)
  nftables  # the fifth: egress allowlists (network permissions)
  python3-pip-whl  # pip as a wheel: the registry proxy's tests run real pip inside a sandbox
  runsc  # gVisor, for runtime="gvisor" sandboxes (optional: a node without it reports so)
  lxcfs  # sandboxes' /proc CPU and memory views from their limits (each node runs its own daemon; Debian's service is not used)
  seabios syslinux syslinux-common mtools dosfstools)  # the sixth: firmware booting users' VM images; a bootable test image
# What the test extra builds and runs beyond the node: libvirt-python is built against libvirt's
# headers (pkg-config finds them); its tests run on libvirt's test hypervisor and check the
# provider's XML with xmllint against libvirt's schemas.
test_apt_packages=(libvirt-dev pkg-config libxml2-utils)

need_root() {
  if [ "$(id -u)" != 0 ]; then echo "setup.sh: run as root (sandboxes need mounts, namespaces, cgroups)" >&2; exit 1; fi
}

add_backports() {
  # The microVMs' guest kernel: bookworm's 6.1 has Landlock ABI 2, bookworm-backports' 6.12 has
  # ABI 6, whose signal scoping keeps a process left running from signalling a later command
  # (the guest kit takes the newest linux-image-cloud-amd64 apt knows). Backports' default pin
  # (100) upgrades nothing installed. Later Debian releases ship 6.12 or newer themselves.
  [ "$(. /etc/os-release && echo "${VERSION_CODENAME:-}")" = bookworm ] || return 0
  grep -qs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources && return 0
  printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    > /etc/apt/sources.list.d/dsec-bookworm-backports.sources
  apt-get update -qq
}

install_debian() {
  local missing=()
  add_backports
  for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

install_services_quietly() {
  # Packages that ship a system service (sshd, PostgreSQL, HAProxy, Prometheus): the project starts its own
  # throwaway instances, so installing must neither start nor enable a system-wide one.
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  apt-get update -qq
  mkdir -p /etc/postgresql-common
  [ -e /etc/postgresql-common/createcluster.conf ] || echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf
  local guard=/usr/sbin/policy-rc.d had_guard=0 rc=0
  [ -e "$guard" ] && had_guard=1
  [ $had_guard = 1 ] || { printf '#!/bin/sh\nexit 101\n' > "$guard"; chmod +x "$guard"; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?
  [ $had_guard = 1 ] || rm -f "$guard"
  [ $rc = 0 ] || { echo "setup.sh: installing ${missing[*]} failed" >&2; exit $rc; }
  if command -v systemctl >/dev/null; then
    systemctl disable --now ssh postgresql haproxy prometheus libvirtd >/dev/null 2>&1 || true
  fi
}

install_python() {
  local extra=$1 stamp
  # Debian's interpreter, not a pyenv shim: the shim costs ~230 ms per start.
  [ -x .venv/bin/python ] || /usr/bin/python3 -m venv .venv
  stamp=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)-$extra"
  if [ ! -f "$stamp" ]; then
    .venv/bin/pip install -q --upgrade pip >/dev/null
    if [ "$extra" = test ]; then .venv/bin/pip install -q -e ".[test]"; else .venv/bin/pip install -q -e .; fi
    touch "$stamp"
  fi
}

install_e2b_sdks() {
  # The official E2B SDKs the tests in tests/e2b drive DSec with, one venv per version
  # (tests/e2b/conftest.py E2B_VERSIONS); made once, kept between runs.
  local v dir
  for v in 2.63.0 2.34.0; do
    dir=".venv-e2b-${v%.*}"
    [ -f "$dir/.installed-$v" ] && continue
    rm -rf "$dir"
    /usr/bin/python3 -m venv "$dir"
    "$dir/bin/pip" install -q "e2b==$v"
    touch "$dir/.installed-$v"
  done
  install_e2b_js
}

install_e2b_js() {
  # The official E2B JS SDK (tests/e2b/test_js_sdk.py), pinned by .node-e2b/package-lock.json;
  # kept between runs. It needs Node >= 20.19 (its CommonJS entry require()s ES-only packages);
  # Debian 12's nodejs is 18: then Debian's npm fetches Node's own build of 20 into .node-e2b/runtime.
  local dir=.node-e2b stamp arch
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
  fi
  if ! node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 20 || (a === 20 && b >= 19) ? 0 : 1)'; then
    arch=$(uname -m); arch=${arch/x86_64/x64}; arch=${arch/aarch64/arm64}
    [ -x "$dir/runtime/node_modules/node-linux-$arch/bin/node" ] ||
      npm install -s --no-audit --no-fund --prefix "$dir/runtime" "node-linux-$arch@20.20.2"
  fi
  stamp="$dir/node_modules/.installed-$(sha256sum "$dir/package-lock.json" | cut -c1-16)"
  [ -f "$stamp" ] && return 0
  (cd "$dir" && npm ci -s --no-audit --no-fund)
  touch "$stamp"
}

install_console_js() {
  # xterm.js for the web console's terminal (src/dsec/apiserver/console/), pinned by
  # .node-console/package-lock.json; the apiserver serves its dist files, no CDN at run time.
  local dir=.node-console stamp
  if ! command -v npm >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
  fi
  stamp="$dir/node_modules/.installed-$(sha256sum "$dir/package-lock.json" | cut -c1-16)"
  [ -f "$stamp" ] && return 0
  (cd "$dir" && npm ci -s --no-audit --no-fund)
  touch "$stamp"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up)
    # HAProxy: the edge's name check (TLS server name, HTTP Host) for permissions naming domains.
    need_root; install_debian; install_services_quietly haproxy; install_python base; install_console_js
    exec .venv/bin/dsec up "$@"
    ;;
  test)
    apt_packages+=(chromium chromium-driver "${test_apt_packages[@]}")  # chromium: the web console's browser test
    # libvirt-daemon*, dnsmasq-base: tests/cluster/test_libvirt_real.py runs its own libvirtd
    # (in namespaces of its own; the package's system service is never started).
    need_root; install_debian
    install_services_quietly postgresql haproxy prometheus libvirt-daemon libvirt-daemon-driver-qemu dnsmasq-base
    install_python test; install_e2b_sdks
    install_console_js
    .venv/bin/dsec base --data-dir "${DSEC_TEST_DATA_DIR:-/var/lib/dsec-test}"
    .venv/bin/ruff check src tests bench
    .venv/bin/ruff format --check src tests bench
    .venv/bin/mypy
    # The slowest tests named in every log: where the next minute of CI time comes from.
    .venv/bin/pytest -q -p no:cacheprovider --durations=30 "$@"
    # CI: the host-wide tests again beside a running `dsec up` node, as two suites at once on two
    # data directories (every node owns its names; tests/beside_node.py).
    if [ "${CI:-}" = true ]; then exec .venv/bin/python -m tests.beside_node; fi
    ;;
  bench)
    which=${1:-create}
    shift || true
    if [ "$which" = controlplane ] || [ "$which" = burst ]; then
      # Simulated nodes only: no sandbox, no mount, no sshd; the Python package is enough.
      [ -x .venv/bin/python ] || { need_root; install_debian; }
      install_python base
      exec .venv/bin/python "bench/$which.py" "$@"
    fi
    apt_packages+=("${test_apt_packages[@]}")
    need_root; install_debian; install_services_quietly openssh-server openssh-client sshfs haproxy; install_python test
    exec .venv/bin/python "bench/$which.py" "$@"
    ;;
  *)
    echo "usage: ./setup.sh up [dsec up options] | ./setup.sh test [pytest options] | ./setup.sh bench create|ondemand|controlplane|fncall|rl|vm|cpuclass|egress|egress_names|egress_headers|exec|density|e2b|gvisor|ksm|seccomp|socket_tables|create_phases|lxcfs|burst|layer_reads" >&2
    exit 2
    ;;
esac
