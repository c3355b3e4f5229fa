#!/usr/bin/env bash
# A real kube-apiserver (+ etcd, + the garbage collector) on loopback, for the operator tests.
#
# node.sh sources this file for a single node whose pods really run (kubelet, containerd).
#
#   cluster.sh build          build kube-apiserver + kube-controller-manager once, cached in
#                             $SLOTUNE_K8S_CACHE (default ~/.cache/slotune-k8s); installs the
#                             Debian packages it needs when run as root (apt-get update first)
#   cluster.sh up DIR [PID]   start etcd, kube-apiserver, kube-controller-manager
#                             (garbagecollector only) under DIR; writes DIR/kubeconfig (admin),
#                             DIR/operator.kubeconfig (user "slotune-operator", RBAC applies),
#                             DIR/pids; prints the kubeconfig path. With PID, a watchdog stops
#                             the cluster when that process exits (a killed test run leaks nothing)
#   cluster.sh down DIR       stop what `up DIR` started
#   cluster.sh restart-apiserver DIR [SECONDS]
#                             kill -9 the kube-apiserver, start it again SECONDS (5) later on the
#                             same port and etcd (a control-plane crash, for the fault tests)
#
# No registry ships a Kubernetes server binary, so `build` compiles Debian bookworm's
# `kubernetes` source package (1.20.2, full tree with vendor/) with Debian's golang-1.19:
#   - GOPATH mode (GO111MODULE=off), the tree placed at $GOPATH/src/k8s.io/kubernetes;
#   - the tarball lacks pkg/generated/openapi/zz_generated.openapi.go: openapi-gen is built
#     from vendor/ and run over every package tagged +k8s:openapi-gen=true first;
#   - vendored modern-go/reflect2 1.0.1 crashes under Go >= 1.18 on the first custom
#     resource: replaced with Debian's golang-github-modern-go-reflect2-dev (1.0.2);
#   - 1.20 serves CronJob only as batch/v1beta1: not patched; slotune schedules re-tuning
#     with operator timers instead (see slotune/operator/schedule.py).
# Cold build: ~6.5 min on 2 cores (plus the apt downloads); later runs reuse the cached
# binaries (the source tree and Go cache are removed; SLOTUNE_K8S_KEEP_SRC=1 keeps them).
set -euo pipefail

CACHE="${SLOTUNE_K8S_CACHE:-$HOME/.cache/slotune-k8s}"
BIN="$CACHE/bin"
GO=/usr/lib/go-1.19/bin/go
APT_PKGS=(etcd-server golang-1.19-go golang-github-modern-go-reflect2-dev dpkg-dev openssl)

log() { echo "[cluster.sh] $*" >&2; }

ensure_packages() {  # [nosrc]: only the packages, not the kubernetes source
  local missing=()
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  local need_src=0
  [ -f "$CACHE/src/.unpacked" ] || [ "${1:-}" = nosrc ] || need_src=1
  if [ ${#missing[@]} -eq 0 ] && [ $need_src -eq 0 ]; then return; fi
  if [ "$(id -u)" != 0 ]; then
    log "missing: ${missing[*]:-} (source: $need_src); run as root or install them"; exit 1
  fi
  # `apt-get source` needs a deb-src line for bookworm main (stock images ship none).
  if [ $need_src -eq 1 ] && ! apt-cache showsrc kubernetes 2>/dev/null | grep -q '^Package: kubernetes'; then
    cat > /etc/apt/sources.list.d/slotune-deb-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  fi
  apt-get update -qq
  if [ ${#missing[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

fetch_source() {
  [ -f "$CACHE/src/.unpacked" ] && return
  log "fetching the kubernetes source package"
  rm -rf "$CACHE/src" && mkdir -p "$CACHE/src"
  (cd "$CACHE/src" && apt-get source -qq kubernetes >/dev/null)
  local dir
  dir=$(find "$CACHE/src" -maxdepth 1 -mindepth 1 -type d -name 'kubernetes-*' | head -1)
  mkdir -p "$CACHE/gopath/src/k8s.io"
  rm -rf "$CACHE/gopath/src/k8s.io/kubernetes"
  mv "$dir" "$CACHE/gopath/src/k8s.io/kubernetes"
  rm -f "$CACHE"/src/*.tar.* "$CACHE"/src/*.dsc
  touch "$CACHE/src/.unpacked"
}

build() {  # [COMMAND...]: the cmd/ binaries to build (default: the control plane's two)
  local cmds=("$@")
  [ ${#cmds[@]} -gt 0 ] || cmds=(kube-apiserver kube-controller-manager)
  local missing_bin=0 cmd
  for cmd in "${cmds[@]}"; do [ -x "$BIN/$cmd" ] || missing_bin=1; done
  if [ $missing_bin -eq 0 ]; then
    log "cached: $BIN"; return
  fi
  ensure_packages
  fetch_source
  local t0=$SECONDS
  export GOPATH="$CACHE/gopath" GO111MODULE=off GOFLAGS= CGO_ENABLED=0
  export GOMAXPROCS="${SLOTUNE_K8S_BUILD_PROCS:-2}" GOCACHE="$CACHE/gocache"
  local K="$GOPATH/src/k8s.io/kubernetes"
  cd "$K"
  # reflect2 1.0.1 (vendored) crashes on Go >= 1.18; Debian ships the fixed 1.0.2.
  if ! grep -qs "1.0.2" vendor/github.com/modern-go/reflect2/.slotune-replaced 2>/dev/null; then
    rm -rf vendor/github.com/modern-go/reflect2
    cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
    rm -rf vendor/github.com/modern-go/reflect2/*_test.go vendor/github.com/modern-go/reflect2/tests
    echo 1.0.2 > vendor/github.com/modern-go/reflect2/.slotune-replaced
  fi
  mkdir -p "$BIN" "$CACHE/tools"
  local openapi=pkg/generated/openapi/zz_generated.openapi.go
  if [ ! -f "$openapi" ] || [ "$(wc -c < "$openapi")" -lt 1000000 ]; then
    log "generating pkg/generated/openapi (openapi-gen from vendor/)"
    nice -n 10 "$GO" build -p 1 -o "$CACHE/tools/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
    # Every package tagged for openapi, as k8s.io/kubernetes/... import paths (vendor included).
    local dirs
    # (as build/root/Makefile.generated_files does; -R: vendor/k8s.io/* are symlinks to staging/)
    dirs=$(grep -Rl --include='*.go' '+k8s:openapi-gen=' pkg cmd vendor/k8s.io \
           | grep -v -e vendor/k8s.io/code-generator/ -e vendor/k8s.io/sample-apiserver/ \
           | xargs -n1 dirname | LC_ALL=C sort -u | sed 's#^#k8s.io/kubernetes/#' | paste -sd, -)
    nice -n 10 "$CACHE/tools/openapi-gen" --logtostderr -v 1 -i "$dirs" \
      -p k8s.io/kubernetes/pkg/generated/openapi -O zz_generated.openapi \
      -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt -r "$CACHE/tools/api-violations.txt" \
      --output-base "$GOPATH/src" 2> "$CACHE/tools/openapi-gen.log"
  fi
  local V=k8s.io/kubernetes/vendor/k8s.io/component-base/version
  local LDFLAGS="-s -w -X $V.gitVersion=v1.20.2 -X $V.gitMajor=1 -X $V.gitMinor=20 -X $V.gitTreeState=clean"
  for cmd in "${cmds[@]}"; do
    if [ "$cmd" != pause ] && [ ! -x "$BIN/$cmd" ]; then
      log "building $cmd"
      nice -n 10 "$GO" build -p "$GOMAXPROCS" -ldflags "$LDFLAGS" -o "$BIN/$cmd.tmp" "./cmd/$cmd"
      mv "$BIN/$cmd.tmp" "$BIN/$cmd"
    fi
  done
  # The pod sandbox's process (what registry.k8s.io/pause ships), for node.sh's pause image.
  if [[ " ${cmds[*]} " == *" pause "* ]] && [ ! -x "$BIN/pause" ]; then
    gcc -Os -static -DVERSION=v3.2-slotune -o "$BIN/pause" build/pause/linux/pause.c
  fi
  log "built in $((SECONDS - t0)) s: $BIN"
  # Only the binaries are needed from now on; the tree and the Go cache are ~1.8 GB.
  if [ -z "${SLOTUNE_K8S_KEEP_SRC:-}" ]; then
    cd "$CACHE" && rm -rf "$CACHE/gopath" "$CACHE/gocache" "$CACHE/src" "$CACHE/tools"
  fi
}

is_node() { [ "$(cat "$1/mode" 2>/dev/null)" = node ]; }  # DIR: made by node.sh up

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_http() {  # URL, seconds
  python3 - "$1" "$2" <<'PY'
import ssl, sys, time, urllib.request
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
deadline = time.time() + float(sys.argv[2])
while time.time() < deadline:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2, context=ctx).read(); sys.exit(0)
    except Exception:
        time.sleep(0.2)
sys.exit(1)
PY
}

up() {
  local D="${1:?usage: cluster.sh up DIR}"
  [ -x "$BIN/kube-apiserver" ] || build
  command -v etcd >/dev/null || ensure_packages nosrc
  mkdir -p "$D" && D=$(cd "$D" && pwd)
  local etcd_port peer_port api_port
  etcd_port=$(free_port); peer_port=$(free_port); api_port=$(free_port)
  # Self-signed serving cert (also the CA in the kubeconfig), service-account signing key.
  # node.sh's clusters: pods reach the apiserver at the Service IP or the node's bridge address.
  local san="IP:127.0.0.1,DNS:localhost"
  if is_node "$D"; then
    san="$san,IP:$NODE_IP,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
  fi
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=127.0.0.1" \
    -addext "subjectAltName=$san" \
    -keyout "$D/apiserver.key" -out "$D/apiserver.crt" 2>/dev/null
  openssl genrsa -out "$D/sa.key" 2048 2>/dev/null
  local admin_token op_token
  admin_token=$(openssl rand -hex 16); op_token=$(openssl rand -hex 16)
  printf '%s,admin,admin,system:masters\n%s,slotune-operator,slotune-operator,slotune\n' \
    "$admin_token" "$op_token" > "$D/tokens.csv"
  : > "$D/pids"
  etcd --data-dir "$D/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "default=http://127.0.0.1:$peer_port" >"$D/etcd.log" 2>&1 &
  echo $! >> "$D/pids"
  wait_http "http://127.0.0.1:$etcd_port/health" 30 || { log "etcd did not start; see $D/etcd.log"; down "$D"; exit 1; }
  printf '%s %s\n' "$etcd_port" "$api_port" > "$D/ports"
  start_apiserver "$D" || { down "$D"; exit 1; }
  write_kubeconfig "$D/kubeconfig" "$api_port" admin "$admin_token" "$D/apiserver.crt"
  write_kubeconfig "$D/operator.kubeconfig" "$api_port" slotune-operator "$op_token" "$D/apiserver.crt"
  if is_node "$D"; then
    # Every controller (Deployments, ReplicaSets, Jobs, Endpoints, service-account tokens, ...).
    "$BIN/kube-controller-manager" --kubeconfig "$D/kubeconfig" --leader-elect=false \
      --bind-address 127.0.0.1 --secure-port 0 --port 0 --use-service-account-credentials=true \
      --service-account-private-key-file "$D/sa.key" --root-ca-file "$D/apiserver.crt" \
      >"$D/controller-manager.log" 2>&1 &
    echo $! >> "$D/pids"
  elif [ -x "$BIN/kube-controller-manager" ]; then
    # Only the garbage collector: it deletes children whose owner is gone. Controllers that
    # would fight the tests over Deployment/Job status (no kubelet here) stay off.
    "$BIN/kube-controller-manager" --kubeconfig "$D/kubeconfig" --controllers garbagecollector \
      --leader-elect=false --bind-address 127.0.0.1 --secure-port 0 --port 0 \
      --use-service-account-credentials=false >"$D/controller-manager.log" 2>&1 &
    echo $! >> "$D/pids"
  fi
  if [ -n "${2:-}" ]; then
    # setsid + closed fds: the watchdog must not hold the caller's pipes open
    setsid bash "$0" watch "$D" "$2" </dev/null >/dev/null 2>&1 &
  fi
  echo "$D/kubeconfig"
}

start_apiserver() {  # DIR: start kube-apiserver on the ports in DIR/ports; record its pid
  local D=$1 etcd_port api_port
  read -r etcd_port api_port < "$D/ports"
  # Loopback only, the ServiceAccount admission plugin and the kubernetes Service's endpoints
  # off; on node.sh's node: the bridge address, real service accounts, the Service routed, and
  # the kubelet reached at its address for logs and exec (its name resolves nowhere).
  local net=(--bind-address 127.0.0.1 --advertise-address 127.0.0.1
    --disable-admission-plugins ServiceAccount --endpoint-reconciler-type none)
  is_node "$D" && net=(--bind-address 0.0.0.0 --advertise-address "$NODE_IP" --kubelet-preferred-address-types InternalIP)
  "$BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$etcd_port" "${net[@]}" --secure-port "$api_port" \
    --insecure-port 0 \
    --tls-cert-file "$D/apiserver.crt" --tls-private-key-file "$D/apiserver.key" \
    --token-auth-file "$D/tokens.csv" --authorization-mode RBAC \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$D/sa.key" --service-account-signing-key-file "$D/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16 --allow-privileged=false >>"$D/apiserver.log" 2>&1 &
  echo $! > "$D/apiserver.pid"
  echo $! >> "$D/pids"
  wait_http "https://127.0.0.1:$api_port/readyz" 90 || { log "kube-apiserver did not start; see $D/apiserver.log"; return 1; }
}

restart_apiserver() {  # DIR SECONDS: kill -9 kube-apiserver (a crash), wait, start it again
  local D="${1:?usage: cluster.sh restart-apiserver DIR SECONDS}" pid
  pid=$(cat "$D/apiserver.pid")
  kill -9 "$pid" 2>/dev/null || true
  for _ in $(seq 100); do  # gone, or a zombie nobody reaps (its port is free either way)
    kill -0 "$pid" 2>/dev/null && ! grep -qs '^[0-9]* ([^)]*) Z' "/proc/$pid/stat" || break
    sleep 0.1
  done
  sed -i "/^$pid\$/d" "$D/pids"
  sleep "${2:-5}"
  start_apiserver "$D"
}

watch() {  # DIR PID: stop the cluster in DIR once PID is gone
  while kill -0 "$2" 2>/dev/null && [ -f "$1/pids" ]; do sleep 2; done
  down "$1"
}

write_kubeconfig() {  # FILE PORT USER TOKEN CA
  cat > "$1" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:$2
    certificate-authority-data: $(base64 -w0 "$5")
users:
- name: $3
  user:
    token: $4
contexts:
- name: $3@local
  context: {cluster: local, user: $3, namespace: default}
current-context: $3@local
KC
}

down() {
  local D="${1:?usage: cluster.sh down DIR}"
  [ -f "$D/pids" ] || return 0
  local pid
  for pid in $(tac "$D/pids"); do kill "$pid" 2>/dev/null || true; done
  for pid in $(tac "$D/pids"); do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  rm -f "$D/pids"
}

main() {
  case "${1:-}" in
    build) build ;;
    up) up "${2:-}" "${3:-}" ;;
    watch) watch "$2" "$3" ;;
    down) down "${2:-}" ;;
    restart-apiserver) restart_apiserver "${2:-}" "${3:-5}" ;;
    *) echo "usage: $0 build | up DIR [PID] | down DIR | restart-apiserver DIR [SECONDS]" >&2; exit 2 ;;
  esac
}
# One line: bash has parsed everything before running, so editing this file cannot disturb a
# running watchdog.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; exit $?; fi
