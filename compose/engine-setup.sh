#!/usr/bin/env bash
# Docker Engine + Compose v2 + an offline base image for clawstream's containers (`make docker`; .ci/run calls it).
#
# Idempotent; every step is skipped when its result is already there:
#   1. the engine: Debian's docker.io (apt) when no `dockerd` is installed;
#   2. dockerd started in the background (log: $CLAWSTREAM_HOME/logs/dockerd.log) when `docker info` does not answer;
#   3. Compose v2: Debian has only the retired v1, so v2 is built once from the Go module proxy (~13 min on 2 cores)
#      into $CLAWSTREAM_HOME/bin/docker-compose-$COMPOSE_VERSION and installed as the CLI plugin
#      ~/.docker/cli-plugins/docker-compose;
#   4. the base image: when no registry answers (`docker pull` fails), a minimal Debian bookworm root filesystem is
#      made with debootstrap from this machine's own apt mirror and imported as $LOCAL_BASE (never tagged with a
#      public image's name). The Dockerfiles in compose/ take `ARG BASE_IMAGE`, defaulting to the public image; the
#      build script passes the local one when the public one cannot be pulled.
# Needs root for steps 1, 2 and 4 (apt, dockerd, debootstrap); prints what it does and how long it took.
set -euo pipefail

COMPOSE_VERSION="${COMPOSE_VERSION:-v2.40.3}"
PUBLIC_BASE="${PUBLIC_BASE:-python:3.11-slim-bookworm}"
LOCAL_BASE="${LOCAL_BASE:-clawstream/debian:bookworm}"
HOME_DIR="${CLAWSTREAM_HOME:-$HOME/.cache/clawstream}"
mkdir -p "$HOME_DIR/bin" "$HOME_DIR/logs"
t0=$(date +%s)
say() { echo "[engine-setup +$(( $(date +%s) - t0 ))s] $*"; }
# set -e alone exits without a word (CI once printed only "make: Error 2"): name the line and the command.
trap 'echo "engine-setup: line $LINENO failed (exit $?): $BASH_COMMAND" >&2' ERR

# 1. engine
if ! command -v dockerd >/dev/null 2>&1; then
  say "installing Docker Engine (Debian docker.io) with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
fi

# 2. daemon
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log $HOME_DIR/logs/dockerd.log)"
  nohup dockerd >"$HOME_DIR/logs/dockerd.log" 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not answer within 30 s; see $HOME_DIR/logs/dockerd.log" >&2; exit 1; }
fi
say "engine $(docker info --format '{{.ServerVersion}}') ready"

# 3. Compose v2 (CLAWSTREAM_SETUP_COMPOSE=0 skips it: .ci/run builds it last, behind the first tests)
if [ "${CLAWSTREAM_SETUP_COMPOSE:-1}" != 0 ]; then
  plugin="$HOME/.docker/cli-plugins/docker-compose"
  cached="$HOME_DIR/bin/docker-compose-$COMPOSE_VERSION"
  if ! docker compose version >/dev/null 2>&1; then
    if [ ! -x "$cached" ]; then
      command -v go >/dev/null 2>&1 || { echo "building Compose v2 needs Go (https://go.dev/dl)" >&2; exit 1; }
      say "building Compose $COMPOSE_VERSION from the Go module proxy once (~13 min on 2 cores) → $cached"
      work=$(mktemp -d)
      ( cd "$work" && go mod init composebuild >/dev/null 2>&1 \
        && go get "github.com/docker/compose/v2/cmd@$COMPOSE_VERSION" >/dev/null 2>&1 \
        && go build -trimpath -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" \
             -o "$cached.partial" github.com/docker/compose/v2/cmd )
      mv "$cached.partial" "$cached"
      rm -rf "$work"
    fi
    mkdir -p "$(dirname "$plugin")"
    ln -sf "$cached" "$plugin"
  fi
  say "$(docker compose version)"
fi

# 4. base image
if ! docker image inspect "$PUBLIC_BASE" >/dev/null 2>&1 && ! docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
  if timeout 20 docker pull -q "$PUBLIC_BASE" >/dev/null 2>&1; then
    say "pulled $PUBLIC_BASE"
  else
    command -v debootstrap >/dev/null 2>&1 || {
      apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
    # The machine's own Debian mirror (deb822 or one-line sources), never a hard-coded host.
    # Only the files that exist: a deb822-only machine has no /etc/apt/sources.list, and grep's exit 2 for the
    # missing file failed the whole pipeline under pipefail (the CI failure of stop 25).
    sources=()
    for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list /etc/apt/sources.list; do
      [ -f "$f" ] && sources+=("$f")
    done
    mirror=""
    if [ ${#sources[@]} -gt 0 ]; then
      urls=$(cat "${sources[@]}" | grep -E '^(URIs:|deb )' | grep -v security | grep -oE 'https?://[^ ]+' || true)
      # A Debian mirror over a third-party repository (nodesource, cloud SDKs) listed before it.
      mirror=$(grep -m1 debian <<<"$urls" || head -1 <<<"$urls" || true)
    fi
    [ -n "$mirror" ] || { echo "no Debian mirror found in /etc/apt/sources*" >&2; exit 1; }
    say "no registry: bootstrapping Debian bookworm from $mirror into $LOCAL_BASE (~2.5 min)"
    rootfs=$(mktemp -d)
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$HOME_DIR/logs/debootstrap.log" 2>&1 \
      || { echo "debootstrap failed; see $HOME_DIR/logs/debootstrap.log" >&2; exit 1; }
    # The container's apt reads the same mirror as the host.
    echo "deb $mirror bookworm main" >"$rootfs/etc/apt/sources.list"
    tar -C "$rootfs" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$LOCAL_BASE" >/dev/null
    rm -rf "$rootfs"
  fi
fi
say "done"
