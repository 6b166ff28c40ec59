"""The sandbox worker's settings (env prefix ``CLAWSTREAM_SANDBOX_``): the worker, the proxy it registers rollouts
with, timeouts, the local and docker backends' isolation and limits, the workspace disk quota, the LLM judge."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MIN_WORKSPACE_BYTES = 1 << 20  # the smallest workspace disk quota: a harness's config files alone need some


class SandboxSettings(BaseSettings):
    """Sandbox worker and backend configuration (env prefix ``CLAWSTREAM_SANDBOX_``)."""

    model_config = SettingsConfigDict(env_prefix="CLAWSTREAM_SANDBOX_", frozen=True, extra="forbid")

    backend: Literal["local", "docker"] = Field(default="local", description="Where rollouts run.")
    concurrency: int = Field(default=4, ge=1, description="Rollouts one worker runs at once.")
    group_id: str = Field(default="clawstream-sandbox-workers", description="Consumer group of all sandbox workers.")
    worker_id: str | None = Field(default=None, description="Name in events; default host:pid.")
    proxy_url: str = Field(
        default="http://127.0.0.1:8101",
        description="The serving proxy's admin listener (its admin_host:admin_port), not the harness-facing port: "
        "rollouts get their base URL from the registration.",
    )
    proxy_admin_token: str = Field(default="", description="Bearer token of the proxy's admin API.")
    proxy_timeout_s: float = Field(default=90.0, description="Deadline of one admin call (seal waits for calls).")
    proxy_connect_retries: int = Field(
        default=60,
        ge=0,
        description="Admin calls refused at connect (the proxy restarting) are tried again this many times, 0.2 s "
        "apart doubling to 2 s (60: about 2 min), before the attempt fails as an infrastructure failure.",
    )
    proxy_lease_s: float = Field(
        default=30.0,
        gt=0,
        description="Lease of an attempt's proxy registration, renewed while it runs; a lapsed one marks a dead "
        "worker's attempt, which a re-run may revoke (keep it below the session timeout).",
    )
    held_retry_s: float = Field(
        default=2.0, gt=0, description="Period of asking the proxy again about a request another attempt holds."
    )
    suites: dict[str, str] = Field(
        default_factory=lambda: {"cpu_builtin": "builtin:cpu"},
        description="Suite name → spec (builtin:cpu | native:DIR | clawgym:DIR | pinchbench:DIR); JSON in env.",
    )
    install_harnesses: bool = Field(default=True, description="npm-install a missing real harness on first use.")
    harness_files: list[str] = Field(
        default_factory=list,
        description="Harness adapter files (TOML, docs/harnesses.md#bring-your-own-harness) added to the built-in "
        "ones and those in $CLAWSTREAM_HOME/harnesses/adapters (--harness-file FILE; JSON list in env).",
    )
    session_timeout_ms: int = Field(default=45000, description="Kafka session timeout (dead-worker detection).")
    publish_timeout_s: float = Field(default=60.0, description="Delivery deadline of one lifecycle/reward event.")
    # --- timeouts ---
    kill_grace_s: float = Field(default=2.0, description="SIGTERM → SIGKILL grace at the wall-clock timeout.")
    grader_timeout_s: float = Field(default=120.0, description="Longest grader run (then the attempt FAILED).")
    max_timeout_s: float = Field(default=3600.0, description="Cap on any task's wall-clock timeout.")
    task_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="Every task's wall-clock timeout instead of its own (a request may still ask for less): a real "
        "harness on a slow machine (opencode starts in ~40 s on 2 busy cores) outlives builtin:cpu's 60 s.",
    )
    # --- local backend ---
    isolation: Literal["bwrap", "none"] = Field(
        default="bwrap",
        description="Local backend: bwrap runs every command under bubblewrap (own mount/pid/net/user namespaces, "
        "the rollout's dirs the only writable ones, network only to the proxy); none: the host as the worker's user "
        "(trusted harnesses only; the worker's --unsafe-no-isolation). The worker refuses to start when bwrap fails.",
    )
    bwrap_path: str = Field(default="bwrap", description="The bubblewrap executable.")
    bwrap_uid: int = Field(default=1000, ge=1, description="uid and gid inside an isolated sandbox (mapped outside).")
    bwrap_proxy_port: int = Field(
        default=8100, ge=1024, description="Port on 127.0.0.1 inside an isolated sandbox that leads to the proxy."
    )
    relay_max_connections: int = Field(
        default=64,
        ge=1,
        description="Connections one isolated sandbox may hold open to the proxy through the worker's relay at once; "
        "more wait, unaccepted, until one ends (a harness holds a few: its calls, a side model's, subagents'), so one "
        "rollout cannot take the worker's file descriptors.",
    )
    relay_idle_timeout_s: float = Field(
        default=960.0,
        gt=0,
        description="A relayed connection that carried no byte either way for this long is closed; keep it above the "
        "proxy's engine_timeout_s (900 s), the longest a non-streaming call waits silently.",
    )
    bwrap_read_only: list[str] = Field(
        default_factory=list,
        description="Extra host paths an isolated sandbox sees read-only (beyond /usr, /etc, /lib*, the Python, venv, "
        "harness installs and clawstream's packages); JSON in env.",
    )
    root: Path | None = Field(default=None, description="Parent of sandbox dirs; default $TMPDIR/clawstream-sandboxes")
    path: str | None = Field(default=None, description="PATH in local sandboxes; default python, node dirs + /usr/bin")
    limit_cpu_s: int = Field(default=3600, description="RLIMIT_CPU per process (seconds; the wall clock bounds runs).")
    limit_address_space_mb: int = Field(
        default=0,
        description="RLIMIT_AS (0: unlimited). Node/V8 reserves tens of GB of virtual memory for its pointer cage "
        "and wasm, so an address-space cap below ~64 GB breaks Node harnesses.",
    )
    limit_data_mb: int = Field(
        default=8192,
        description="RLIMIT_DATA (0: unlimited): private writable memory, the memory cap that works with Node "
        "(PROT_NONE reservations do not count).",
    )
    limit_open_files: int = Field(default=4096, description="RLIMIT_NOFILE.")
    limit_processes: int = Field(
        default=4096,
        description="RLIMIT_NPROC (0: unlimited). Counts ALL processes of the user, not just the sandbox's, and is "
        "not enforced for root; use the docker backend's pids limit.",
    )
    limit_file_size_mb: int = Field(
        default=1024,
        description="RLIMIT_FSIZE: largest file a sandbox may write (both backends; never above max_workspace_bytes).",
    )
    max_workspace_bytes: int = Field(
        default=1 << 30,
        description="Workspace disk quota of one rollout (0: none): what its sandbox holds on disk (local: its whole "
        "directory, workspace, HOME, /tmp and the harness's output; docker: the container's writable layer). Measured "
        "during the harness's run and at its end; over it, the harness is stopped and the rollout graded with a "
        "reason starting `quota_exceeded:`. At least 1 MiB.",
    )
    disk_check_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="Period of measuring a running harness's sandbox against max_workspace_bytes: a harness may "
        "write past the quota for at most this long (and no single file past it: RLIMIT_FSIZE).",
    )
    sweep_interval_s: float = Field(default=60.0, description="Period of removing stale sandboxes of dead workers.")
    seen_dir: Path | None = Field(
        default=None,
        description="Where the worker keeps every request it read and its partitions' committed positions (RocksDB, "
        "~60 bytes a request on disk), to refuse a duplicate or a replayed request however long ago it ran; default "
        "$CLAWSTREAM_HOME/sandbox-seen/<group_id>; under it one folder per Kafka cluster id (offsets mean something on "
        "one cluster only), each with one slot-N database per running worker on the host).",
    )
    seen_cache_size: int = Field(
        default=10_000,
        ge=1,
        description="Requests of seen_dir also kept in memory (~250 bytes each); older ones are read from disk.",
    )

    @field_validator("max_workspace_bytes")
    @classmethod
    def _workspace_quota(cls, value: int) -> int:
        if value != 0 and value < MIN_WORKSPACE_BYTES:
            raise ValueError(
                f"max_workspace_bytes must be 0 (no quota) or at least {MIN_WORKSPACE_BYTES} bytes (1 MiB), got {value}"
            )
        return value

    # --- docker backend ---
    docker_image: str = Field(
        default="clawstream/harnesses:latest",
        description="Sandbox image: python3, node, the npm harnesses and clawstream (compose/Dockerfile.harnesses).",
    )
    docker_network: str = Field(
        default="clawstream-sandbox",
        description="Internal network of the rollout containers (created when missing, with no host address on its "
        "bridge); the proxy, or this worker's relay to it, is their only peer.",
    )
    docker_proxy_relay: bool = Field(
        default=True,
        description="Start a relay container that forwards to the proxy's harness-facing port on the host (worker and "
        "proxy on the host). Off when the proxy itself joins docker_network (compose): its public_url is then its "
        "name there.",
    )
    docker_relay_target_port: int = Field(
        default=8100,
        description="The proxy's harness-facing port on the host, where the relay forwards (never its admin port).",
    )
    docker_relay_port: int = Field(default=8100, description="Port the relay listens on inside docker_network.")
    docker_host_address: str | None = Field(
        default=None,
        description="Address at which the relay reaches the host's proxy; default: the gateway of Docker's default "
        "bridge network (the proxy must listen there or on 0.0.0.0).",
    )
    docker_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Extra labels on rollout and relay containers (JSON in env), e.g. compose's project and service "
        "labels, so `docker compose down --remove-orphans` removes what a killed worker left.",
    )
    docker_harness_home: str = Field(
        default="/opt/clawstream-home",
        description="CLAWSTREAM_HOME inside the sandbox image: its harnesses/ holds the npm harnesses.",
    )
    docker_cpus: float = Field(default=2.0, description="CPUs per container (nano_cpus).")
    docker_memory_mb: int = Field(default=4096, description="Memory limit per container.")
    docker_pids: int = Field(default=512, description="pids limit per container.")
    docker_python: str = Field(default="python3", description="Python inside the image.")
    docker_clawstream_root: str = Field(default="/opt/clawstream", description="clawstream's root in the image.")
    # --- LLM judge ---
    judge_url: str | None = Field(default=None, description="OpenAI-compatible base URL (…/v1) of an LLM judge.")
    judge_model: str = Field(default="judge", description="Model name sent to the judge.")
    judge_api_key: str = Field(default="", description="API key of the judge.")
