#!/usr/bin/env bash
# Build clawstream's container images locally (`make images`):
#   compose/build-images.sh [runtime|harnesses|trainer|kafka|haproxy|registry ...]
#
#   clawstream/runtime:latest    the project without torch: proxy, streams, sandbox worker, scheduler, dashboard, CLI
#   clawstream/harnesses:latest  the sandbox image (runtime + Node.js + the five npm harnesses); the sandbox worker too
#   clawstream/trainer:latest    runtime + the `ml` extra (torch, transformers): CPU inference engine and learner
#   clawstream/kafka:latest      Apache Kafka 4.x (KRaft, one node) from the Maven jars of compose/kafka-local/pom.xml
#   clawstream/haproxy:latest    Debian's HAProxy: the balancer of the compose `scale` profile's proxy replicas
#   clawstream/registry:latest   Apicurio Registry (Confluent API) on the kafka image's JRE: the `registry` profile
#
# No names: the first five, in this order (runtime first: harnesses and trainer reuse its cached base/venv/dependency
# layers). `registry` only when named: its application is the one `clawstream registry up` runs, built once on this
# host with Maven (clawstream/local_registry: a few minutes the first time, then cached under $CLAWSTREAM_HOME), and
# that cached directory is its build context; its base is clawstream/kafka:$TAG (built first when both are named).
# Each Dockerfile takes `ARG BASE_IMAGE`, defaulting to the public image a user elsewhere pulls; when that image is
# neither present nor pullable (no registry reachable), the locally bootstrapped $LOCAL_BASE (`make docker`,
# compose/engine-setup.sh) is passed instead. Set CLAWSTREAM_BASE_IMAGE to force a base for every image.
# Builds use the host network (`--network host`: apt, PyPI, npm and Maven Central) and Docker's layer cache: a second
# run with nothing changed rebuilds nothing. Prints each image's size and build time.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
LOCAL_BASE="${LOCAL_BASE:-clawstream/debian:bookworm}"
TAG="${CLAWSTREAM_IMAGE_TAG:-latest}"
ORDER=(runtime harnesses trainer kafka haproxy registry)
DEFAULT=(runtime harnesses trainer kafka haproxy)

public_base() {
  case "$1" in
    kafka|haproxy) echo "debian:bookworm-slim" ;;
    *) echo "python:3.11-slim-bookworm" ;;
  esac
}

declare -A resolved=()
base_for() {  # the image to pass as BASE_IMAGE for image $1
  if [ "$1" = registry ]; then
    if ! docker image inspect "clawstream/kafka:$TAG" >/dev/null 2>&1; then
      echo "[images] registry is built on clawstream/kafka:$TAG, which is missing: build it too (kafka registry)" >&2
      exit 1
    fi
    echo "clawstream/kafka:$TAG"; return
  fi
  if [ -n "${CLAWSTREAM_BASE_IMAGE:-}" ]; then echo "$CLAWSTREAM_BASE_IMAGE"; return; fi
  local pub; pub="$(public_base "$1")"
  if [ -z "${resolved[$pub]:-}" ]; then
    if docker image inspect "$pub" >/dev/null 2>&1 || timeout 30 docker pull -q "$pub" >/dev/null 2>&1; then
      resolved[$pub]="$pub"
    elif docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
      echo "[images] $pub cannot be pulled (no registry reachable): building on the local $LOCAL_BASE" >&2
      resolved[$pub]="$LOCAL_BASE"
    else
      echo "[images] neither $pub (no registry reachable) nor the local $LOCAL_BASE is available;" \
           "create the local base with \`make docker\` (compose/engine-setup.sh)" >&2
      exit 1
    fi
  fi
  echo "${resolved[$pub]}"
}

registry_app_dir() {  # the cached registry build (its app/ directory inside), provisioned by Maven when missing
  local py="$root/.venv/bin/python"
  [ -x "$py" ] || py=python3
  (cd "$root" && "$py" -c 'from clawstream.local_registry.server import provision; print(provision().parents[1])')
}

if ! docker info >/dev/null 2>&1; then
  echo "[images] no Docker engine answers (\`docker info\` fails); start one with \`make docker\`" >&2
  exit 1
fi
# CAs added to this host's trust store (e.g. a TLS-inspecting egress proxy's): passed into the builds so that pip, npm
# and Maven inside them trust the same certificates the host does. Empty on a machine without local CAs.
CA_DIR="${CLAWSTREAM_EXTRA_CA_DIR:-/usr/local/share/ca-certificates}"
extra_ca=""
if compgen -G "$CA_DIR/*.crt" >/dev/null; then extra_ca="$(cat "$CA_DIR"/*.crt)"; fi
# Without the buildx plugin the classic builder is used (it honours --network host and caches per instruction).
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0

wanted=("$@")
[ ${#wanted[@]} -gt 0 ] || wanted=("${DEFAULT[@]}")
for name in "${wanted[@]}"; do
  case " ${ORDER[*]} " in *" $name "*) ;; *) echo "[images] unknown image '$name': one of ${ORDER[*]}" >&2; exit 2 ;; esac
done

summary=()
for name in "${ORDER[@]}"; do
  case " ${wanted[*]} " in *" $name "*) ;; *) continue ;; esac
  image="clawstream/$name:$TAG"
  base="$(base_for "$name")"
  echo "[images] building $image (BASE_IMAGE=$base)"
  before="$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)"
  t0=$(date +%s)
  context="$root"
  if [ "$name" = registry ]; then context="$(registry_app_dir)"; fi
  docker build --force-rm --network host -f "$here/Dockerfile.$name" -t "$image" --build-arg "BASE_IMAGE=$base" \
    --build-arg "EXTRA_CA_CERTS=$extra_ca" "$context"
  secs=$(( $(date +%s) - t0 ))
  # The previous build of this tag, now untagged: removed unless a container still uses it (its layers stay cached).
  if [ -n "$before" ] && [ "$before" != "$(docker image inspect -f '{{.Id}}' "$image")" ]; then
    docker image rm "$before" >/dev/null 2>&1 || true
  fi
  bytes=$(docker image inspect -f '{{.Size}}' "$image")
  line="$(printf '%-28s %8.0f MB  built in %5d s' "$image" "$(( bytes / 1000000 ))" "$secs")"
  echo "[images] $line"
  summary+=("$line")
done
echo "[images] done:"
printf '  %s\n' "${summary[@]}"
