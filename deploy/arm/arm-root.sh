#!/usr/bin/env bash
# An arm64 Debian root on an x86 Linux host, run through qemu-user: swarm's node installed in it as a user on
# an ARM board installs it, on ggml built for three ARM generations. Run as root; every step is idempotent
# (a step whose result is there already is skipped), so `all` can be run again after any failure.
#
#   deploy/arm/arm-root.sh all                # root, mounts, ggml + node for every build (hours at first)
#   deploy/arm/arm-root.sh root               # debootstrap the root, its apt packages, the host's CA bundle
#   deploy/arm/arm-root.sh mounts | umount    # /proc, /sys (with a CPU id), /dev and the checkout, read-only
#   deploy/arm/arm-root.sh ggml BUILD         # the ggml-python wheel for BUILD (15-40 min under emulation)
#   deploy/arm/arm-root.sh node BUILD         # venv /opt/node-BUILD: the project from a copy of this checkout
#   deploy/arm/arm-root.sh check BUILD        # what ggml reports there, and that torch is not installed
#   deploy/arm/arm-root.sh run BUILD 'CMD'    # CMD in the root, BUILD's venv first on PATH, its QEMU_CPU
#
# BUILD is one of (CMAKE_ARGS -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=<arch>; QEMU_CPU: a CPU that has it):
#   neon          armv8-a                  cortex-a53   plain NEON (phones and boards before 2018)
#   dotprod       armv8.2-a+dotprod        cortex-a76   int8 dot products (most phones since 2018)
#   dotprod-i8mm  armv8.6-a+dotprod+i8mm   max          int8 matrix multiply too (Apple M2+, recent Cortex-X)
# qemu 7.2 has no CPU model with i8mm but `max` (which also has SVE; the build has no +sve, so none is used).
#
# Environment: ARM_ROOT (default /var/lib/swarm-arm/root; /work/arm/root on the project's machine reuses
# its wheels), ARM_SUITE (bookworm), ARM_MIRROR, GGML_VERSION (0.0.45), CMAKE_BUILD_PARALLEL_LEVEL,
# ARM_WITH_TORCH=1 (also install torch into the node venvs: only while the checkout's node still imports it).
set -euo pipefail

ROOT=${ARM_ROOT:-/var/lib/swarm-arm/root}
SUITE=${ARM_SUITE:-bookworm}
MIRROR=${ARM_MIRROR:-http://deb.debian.org/debian}
GGML_VERSION=${GGML_VERSION:-0.0.45}
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
CHECKOUT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SRC=/opt/src/swarm                       # the copy of the checkout inside the root (pip installs from it)
CA=/etc/ssl/certs/host-ca.crt            # the host's CA bundle inside the root
APT_PACKAGES="python3 python3-venv python3-dev build-essential cmake git ca-certificates"

die() { echo "arm-root: $*" >&2; exit 1; }
say() { echo "arm-root: $*" >&2; }

build_cpu() {
    case $1 in
        neon) echo cortex-a53 ;;
        dotprod) echo cortex-a76 ;;
        dotprod-i8mm) echo max ;;
        *) die "unknown build '$1' (neon, dotprod, dotprod-i8mm)" ;;
    esac
}

build_arch() {
    case $1 in
        neon) echo armv8-a ;;
        dotprod) echo armv8.2-a+dotprod ;;
        dotprod-i8mm) echo armv8.6-a+dotprod+i8mm ;;
        *) die "unknown build '$1' (neon, dotprod, dotprod-i8mm)" ;;
    esac
}

cmake_args() { echo "-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=$(build_arch "$1")"; }

# --- the host: qemu-user through binfmt_misc ---------------------------------------------------------------

binfmt() {
    [ "$(id -u)" = 0 ] || die "run as root (debootstrap, chroot and mounts need it)"
    local need=""
    command -v debootstrap >/dev/null || need="$need debootstrap"
    [ -e /usr/bin/qemu-aarch64-static ] || need="$need qemu-user-static"
    command -v update-binfmts >/dev/null || need="$need binfmt-support"
    if [ -n "$need" ]; then
        say "installing$need on the host"
        apt-get install -y --no-install-recommends $need
    fi
    # binfmt_misc is not mounted after every boot (or in every container)
    mountpoint -q /proc/sys/fs/binfmt_misc || mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc
    if ! grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null; then
        update-binfmts --enable qemu-aarch64
    fi
    # the F flag opens the interpreter at registration, so the root needs no copy of qemu in it
    grep -q '^flags:.*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
        || say "warning: qemu-aarch64 is registered without the F flag: copy qemu-aarch64-static in the root"
}

# --- the root ----------------------------------------------------------------------------------------------

# debootstrap leaves its own folder in the root until its second stage has finished
debootstrapped() { [ -x "$ROOT/usr/bin/apt-get" ] && [ ! -d "$ROOT/debootstrap" ]; }

root() {
    binfmt
    if ! debootstrapped; then
        [ -z "$(ls -A "$ROOT" 2>/dev/null)" ] \
            || die "$ROOT is neither empty nor a finished root: move it away (after '$0 umount') and rerun"
        say "debootstrap $SUITE arm64 into $ROOT (10-20 min)"
        mkdir -p "$ROOT"
        debootstrap --arch=arm64 "$SUITE" "$ROOT" "$MIRROR"
    fi
    # pip and apt inside reach the internet through whatever the host trusts (a proxy's own CA included)
    mkdir -p "$(dirname "$ROOT$CA")"
    cp "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$ROOT$CA"
    mounts
    local missing
    missing=$(inroot "" "for p in $APT_PACKAGES; do dpkg -s \$p >/dev/null 2>&1 || printf '%s ' \$p; done")
    if [ -n "$missing" ]; then
        say "apt-get install in the root:" $missing
        inroot "" "apt-get update &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing"
    fi
}

# A CPU id for anything that asks: /proc/cpuinfo under qemu-user is the host's x86 one, and /sys is the
# host's, without ARM's identification registers (PyTorch's cpuinfo reads the CPU lists, oneDNN the MIDR).
# The root's /sys/devices/system/cpu is replaced by a made-up tree of the host's CPU count, each a Cortex-A76
# (MIDR 0x414fd0b1; the kernels ggml picks come from the auxiliary vector qemu sets for QEMU_CPU, not this).
fake_cpus() {
    local dir=$ROOT/opt/fake-sys-cpu n i
    n=$(nproc)
    [ -e "$dir/cpu$((n - 1))/regs/identification/midr_el1" ] && [ ! -e "$dir/cpu$n" ] && return 0
    rm -rf "$dir"
    mkdir -p "$dir"
    for f in possible present online; do echo "0-$((n - 1))" >"$dir/$f"; done
    echo 255 >"$dir/kernel_max"
    for ((i = 0; i < n; i++)); do
        mkdir -p "$dir/cpu$i/regs/identification" "$dir/cpu$i/topology" "$dir/cpu$i/cpufreq"
        echo 1 >"$dir/cpu$i/online"
        echo 0x00000000414fd0b1 >"$dir/cpu$i/regs/identification/midr_el1"
        echo 0x0000000000000000 >"$dir/cpu$i/regs/identification/revidr_el1"
        echo "$i" >"$dir/cpu$i/topology/core_id"
        echo 0 >"$dir/cpu$i/topology/physical_package_id"
        echo 0 >"$dir/cpu$i/topology/cluster_id"
        echo "$i" >"$dir/cpu$i/topology/thread_siblings_list"
        echo "0-$((n - 1))" >"$dir/cpu$i/topology/core_siblings_list"
        echo 2000000 >"$dir/cpu$i/cpufreq/cpuinfo_max_freq"
        echo 500000 >"$dir/cpu$i/cpufreq/cpuinfo_min_freq"
    done
}

mounts() {
    debootstrapped || die "no finished root at $ROOT: run '$0 root' first"
    mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
    if ! mountpoint -q "$ROOT/sys"; then
        mount --rbind /sys "$ROOT/sys"
    fi
    # slave: what is mounted under the root's /sys (the CPU tree below) never propagates back to the host's
    mount --make-rslave "$ROOT/sys"
    fake_cpus
    local cpus=$ROOT/sys/devices/system/cpu
    mountpoint -q "$cpus" || mount --bind "$ROOT/opt/fake-sys-cpu" "$cpus"
    if ! mountpoint -q "$ROOT/dev"; then
        mount --rbind /dev "$ROOT/dev"
        mount --make-rslave "$ROOT/dev"
    fi
    # the checkout, read-only at its own path: scripts and fixtures of the current tree without a copy
    mkdir -p "$ROOT$CHECKOUT"
    if ! mountpoint -q "$ROOT$CHECKOUT"; then
        mount --bind "$CHECKOUT" "$ROOT$CHECKOUT"
        mount -o remount,ro,bind "$ROOT$CHECKOUT"
    fi
}

umount_all() {
    # never `rm -rf` the root while these are up: /dev is the host's own
    for m in "$ROOT$CHECKOUT" "$ROOT/sys" "$ROOT/dev" "$ROOT/proc"; do
        if mountpoint -q "$m"; then umount -R "$m"; fi
    done
}

# CMD in the root with a clean environment; $1: a build (its venv first on PATH, its QEMU_CPU) or "".
# EXEC=exec: this script becomes the command (`run`: whoever started it can signal the command itself).
inroot() {
    local build=$1 cmd=$2 path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin cpu=""
    mounts
    if [ -n "$build" ]; then
        cpu=$(build_cpu "$build")
        path=/opt/node-$build/bin:$path
    fi
    ${EXEC:-} chroot "$ROOT" /usr/bin/env -i PATH="$path" HOME=/root LANG=C.UTF-8 \
        SSL_CERT_FILE=$CA PIP_CERT=$CA REQUESTS_CA_BUNDLE=$CA PIP_DISABLE_PIP_VERSION_CHECK=1 \
        PIP_FIND_LINKS=/opt/wheels PYTHONDONTWRITEBYTECODE=1 \
        ${QEMU_CPU:+QEMU_CPU=$QEMU_CPU} ${cpu:+QEMU_CPU=$cpu} \
        ${CMAKE_ARGS:+CMAKE_ARGS="$CMAKE_ARGS"} CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        ${http_proxy:+http_proxy=$http_proxy} ${https_proxy:+https_proxy=$https_proxy} \
        ${HTTP_PROXY:+HTTP_PROXY=$HTTP_PROXY} ${HTTPS_PROXY:+HTTPS_PROXY=$HTTPS_PROXY} \
        ${NO_PROXY:+NO_PROXY=$NO_PROXY} ${no_proxy:+no_proxy=$no_proxy} \
        /bin/bash -c "cd / && $cmd"
}

# --- ggml, per build ---------------------------------------------------------------------------------------

ggml() {
    local build=$1 out=/opt/ggml-wheels/$1
    build_cpu "$build" >/dev/null
    if ls "$ROOT$out"/ggml_python-"$GGML_VERSION"-*.whl >/dev/null 2>&1; then
        say "ggml-python $GGML_VERSION for $build is built already ($ROOT$out): reused"
        return 0
    fi
    root
    # the build venv: pip's build backend for ggml-python (scikit-build-core) and a wheel cache in /opt/wheels
    inroot "" "set -e; mkdir -p /opt/wheels; [ -x /opt/base/bin/pip ] || python3 -m venv /opt/base;
        /opt/base/bin/pip install -q --upgrade pip wheel setuptools scikit-build-core"
    say "building ggml-python $GGML_VERSION for $build: $(cmake_args "$build") QEMU_CPU=$(build_cpu "$build")"
    # the sdist is compiled with this build's flags; QEMU_CPU must have them (configure runs test programs)
    QEMU_CPU=$(build_cpu "$build") CMAKE_ARGS=$(cmake_args "$build") inroot "" "set -e; mkdir -p $out;
        nice -n 19 /opt/base/bin/pip wheel -v --no-binary ggml-python --no-deps --no-cache-dir \
            ggml-python==$GGML_VERSION -w $out"
}

# --- the node, per build -----------------------------------------------------------------------------------

sync_checkout() {
    # the checkout's files as `git clone` would give them, plus the ones not committed yet (not the ignored)
    mkdir -p "$ROOT$SRC"
    (cd "$CHECKOUT" && git ls-files -z --cached --others --exclude-standard \
        | xargs -0 sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh \
        | tar --null -T - -cf -) | tar -C "$ROOT$SRC" -xf -
    # and none it no longer has (pip's build/ and *.egg-info from the last install go too)
    (cd "$ROOT$SRC" && find . -type f -printf '%P\0') | (cd "$CHECKOUT" && while IFS= read -r -d '' f; do
        [ -e "$f" ] || rm -f "$ROOT$SRC/$f"; done)
}

node() {
    local build=$1 venv=/opt/node-$1 wheel
    build_cpu "$build" >/dev/null
    wheel=$(ls "$ROOT/opt/ggml-wheels/$build"/ggml_python-"$GGML_VERSION"-*.whl 2>/dev/null | head -1) \
        || die "no ggml wheel for $build: run '$0 ggml $build' first"
    wheel=/opt/ggml-wheels/$build/${wheel##*/}
    root
    sync_checkout
    say "node venv $venv (ggml: ${wheel##*/}; the project from a copy of $CHECKOUT at $SRC)"
    local torch=""
    [ -n "${ARM_WITH_TORCH:-}" ] && torch=torch==2.9.1
    # ggml first, from the build's wheel: pip then never builds ggml-python from PyPI's sdist for the project.
    # Where the plain install still pulls torch, the node gets pyproject's other dependencies and the project
    # with --no-deps; once `pip install .` is torch-free it is installed as a user would.
    inroot "$build" "set -e; [ -x $venv/bin/pip ] || python3 -m venv $venv
        nice -n 19 $venv/bin/pip install -q --upgrade pip
        nice -n 19 $venv/bin/pip install -q --force-reinstall --no-deps $wheel
        if [ \$(python3 $SRC/deploy/arm/node_deps.py $SRC/pyproject.toml pulls-torch) = yes ]; then
            python3 $SRC/deploy/arm/node_deps.py $SRC/pyproject.toml requirements >$venv/node-requirements.txt
            nice -n 19 $venv/bin/pip install -q -r $venv/node-requirements.txt $torch
            nice -n 19 $venv/bin/pip install -q --no-deps $SRC
        else
            nice -n 19 $venv/bin/pip install -q $SRC $torch    # (a local folder is reinstalled every time)
        fi"
    check "$build"
}

check() {
    inroot "$1" "cd /tmp && python $SRC/deploy/arm/check.py"
}

case ${1:-} in
    all)
        root
        for b in neon dotprod dotprod-i8mm; do ggml "$b"; node "$b"; done
        ;;
    root | mounts | binfmt) "$1" ;;
    umount) umount_all ;;
    ggml | node | check)
        [ $# -eq 2 ] || die "usage: $0 $1 BUILD"
        "$1" "$2"
        ;;
    run)
        [ $# -eq 3 ] || die "usage: $0 run BUILD 'CMD'"
        EXEC=exec inroot "$2" "cd $SRC && $3"
        ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
