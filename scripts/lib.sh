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

# Skipped tests. Tests record each skip in $KVWIRE_SKIP_LOG through
# kvwire-testkit's `skip` (one line: NEED<TAB>CRATE<TAB>TEST<TAB>REASON);
# a script step that cannot run records itself with skip_record.
skip_record() { # NEED WHAT WHY
    [ -n "${KVWIRE_SKIP_LOG:-}" ] || return 0
    printf '%s\t%s\t%s\t%s\n' "$1" script "$2" "$3" >> "$KVWIRE_SKIP_LOG"
}

# skip_summary LOG VM: prints `N skipped: ...` with each test and its reason
# (`0 skipped` when none), one line per test however many runs skipped it.
# With VM=passed, an RDMA test the host skipped and the soft-RoCE VM then ran
# (kvwire-transport's `verbs` tests, kvwire-e2e's `verbs_rails`, both run
# there with a device required) is listed as run there, not as skipped.
skip_summary() {
    local log=$1 vm=${2:-}
    [ -f "$log" ] || : > "$log"
    awk -F'\t' -v vm="$vm" '
        NF < 4 { next }
        { key = $2 "\t" $3 }
        seen[key]++ { next }
        $1 == "rdma" && vm == "passed" && (($2 == "kvwire-transport" && $3 ~ /^verbs::/) || ($2 == "kvwire-e2e" && $3 ~ /verbs_rails/)) {
            invm++; next
        }
        { n++; line[n] = sprintf("  %-6s %s %s: %s", $1, $2, $3, $4) }
        END {
            if (n == 0) print "0 skipped"; else { print n " skipped:"; for (i = 1; i <= n; i++) print line[i] }
            if (invm > 0) print "(" invm " RDMA tests the host skipped ran in the soft-RoCE VM, a device required there)"
        }' "$log"
}
