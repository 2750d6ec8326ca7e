# Shared helpers for kvwire's scripts. Sourced, not run.

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
loud() {
    printf '\n\033[1;33m!!! %s\033[0m\n\n' "$*" >&2
}
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# need_apt PKG... : make sure Debian packages are installed. As root, install
# them; otherwise print the exact command and fail.
need_apt() {
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -eq 0 ]; then
        say "installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq </dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null >/dev/null \
            || die "apt-get install ${missing[*]} failed"
    else
        die "missing packages: ${missing[*]} — run: sudo apt-get install -y ${missing[*]}"
    fi
}

need_rust() {
    command -v cargo >/dev/null 2>&1 || die "cargo not found — install Rust (https://rustup.rs) and re-run"
    # The linker needs a C toolchain; the verbs crate (sideway) builds a
    # small C stub with cmake and generates bindings with libclang. None of
    # it links libibverbs: RDMA is loaded at run time.
    need_apt gcc libc6-dev cmake libclang-dev
    # Discovery: etcd-client compiles etcd's .proto files in its build
    # script (tonic/prost), which needs protoc and the well-known types
    # (google/protobuf/*.proto, in libprotobuf-dev); the discovery tests
    # start a real etcd (/usr/bin/etcd) on loopback.
    need_apt protobuf-compiler libprotobuf-dev etcd-server
}
