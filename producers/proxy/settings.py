"""The serving proxy's settings (env prefix ``CLAWSTREAM_PROXY_``): its two listeners, the engines, limits, quotas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from policy import DEFAULT_MODEL_NAME
from producers.proxy.conversation import CallKindRules
from producers.proxy.nesting import SAFE_DEPTH
from producers.proxy.router import POLICIES


class ProxySettings(BaseSettings):
    """Serving-proxy configuration (env prefix ``CLAWSTREAM_PROXY_``)."""

    # validate_by_name: keyword arguments use the field names; the aliases only name the environment variables.
    model_config = SettingsConfigDict(
        env_prefix="CLAWSTREAM_PROXY_", frozen=True, extra="forbid", validate_by_name=True
    )

    model: Path = Field(description="Model directory whose tokenizer + chat template render prompts.")
    engine_url: str = Field(
        default="http://127.0.0.1:8000",
        description="Inference engine base URL (vLLM API); several engines: comma-separated (or a list), a pool "
        "behind the cache-affine router (docs/scaling.md). The CLI's --engine-url may be given once per engine.",
    )
    engine_routing: str = Field(
        default="affinity",
        description="How a pool's calls are spread: affinity (a rollout stays on its engine; first calls go to the "
        "longest cached prefix), round_robin or least_loaded (producers.proxy.router.POLICIES).",
    )
    engine_imbalance: float = Field(
        default=0.5,
        ge=0,
        description="An engine is overloaded when its calls in flight would pass (1 + imbalance) x the pool's mean "
        "+ engine_slack; its new rollouts and its rollouts' next calls then go to another engine.",
    )
    engine_slack: int = Field(default=2, ge=0, description="Calls in flight an engine may have above the bound.")
    engine_block_size: int = Field(
        default=32,
        gt=0,
        description="Tokens per prefix-cache block in the router's view of each engine's cache (the CPU engine: 32; "
        "vLLM: its --block-size, default 16).",
    )
    engine_failover_retries: int = Field(
        default=3,
        ge=0,
        description="In a pool: times a call is sent again to an engine that is away before that engine is marked "
        "dead and the call goes to another (3: ~1.4 s of backoff). The last live engine gets engine_retries.",
    )
    engine_probe_s: float = Field(
        default=5.0,
        gt=0,
        description="How often a pool's dead engines are probed (GET /health); one that answers 200 is routed to "
        "again, its cache assumed empty.",
    )
    engine_model: str = Field(
        default=DEFAULT_MODEL_NAME,
        # CLAWSTREAM_PROXY_SERVED_MODEL_NAME: the variable's earlier name, still read.
        validation_alias=AliasChoices("CLAWSTREAM_PROXY_ENGINE_MODEL", "CLAWSTREAM_PROXY_SERVED_MODEL_NAME"),
        description="'model' sent to the engine: its served model name (the engine's --served-model-name, "
        "default the same).",
    )
    host: str = Field(default="127.0.0.1", description="Interface to listen on.")
    port: int = Field(default=8100, description="Port of the harness-facing API (0: any free port).")
    admin_host: str = Field(
        default="127.0.0.1",
        description="Interface of the admin listener (admin API, /metrics, /healthz): one rollouts cannot reach "
        "(compose: the proxy's name on the internal control network).",
    )
    admin_port: int = Field(default=8101, description="Port of the admin listener (0: any free port).")
    public_url: str | None = Field(default=None, description="Base URL harnesses reach; default http://host:port.")
    admin_token: str | None = Field(default=None, description="Bearer token of the admin API; unset: random, logged.")
    max_request_bytes: int = Field(
        default=8 * 1024 * 1024,
        description="Larger request bodies get 413. 8 MiB holds a 40k-token conversation with its tools many times "
        "over (a 39k-token Claude Code call is ~0.3 MB); images are replaced by placeholders anyway.",
    )
    max_json_depth: int = Field(
        default=64,
        ge=16,
        le=SAFE_DEPTH,
        description="Deepest JSON nesting a request may hold, in its body and in each tool call's arguments sent as "
        "JSON text: deeper is a 400 in the caller's dialect, measured before the body is parsed. Shipped harnesses "
        "nest ~10 deep (their tool schemas); a tool call the model writes deeper than max_json_depth - 8 is served "
        f"as text, so no harness echoes back one this refuses. At most {SAFE_DEPTH}: parsing, the chat template and "
        "the grader's transcript recurse once per level.",
    )
    max_messages: int = Field(
        default=4096,
        ge=1,
        description="Most messages one request may hold (its messages or input items, and the conversation they "
        "make): more is a 400 in the caller's dialect before anything is rendered. Claude Code sends 100-odd after a "
        "long task; a body of 280k tiny messages took 22 s to render.",
    )
    max_json_values: int = Field(
        default=131_072,
        ge=1024,
        description="Most JSON values (objects, arrays, strings, numbers, literals) one request body may hold: "
        "more is a 400 in the caller's dialect, decided in a separate process before the proxy decodes it. Decoding "
        "holds the interpreter lock for a time proportional to this count (~0.1 s per 300k), so it bounds how long "
        "one body can make every other rollout wait. A 40k-token Claude Code call holds ~10k.",
    )
    precheck_bytes: int = Field(
        default=256 * 1024,
        ge=0,
        description="Bodies of this many bytes or more are decoded and checked against every request limit in a "
        "separate process first (precheck_processes); smaller ones, at most precheck_bytes / 2 values and a few "
        "milliseconds to decode, are decoded in the proxy directly.",
    )
    precheck_processes: int = Field(
        default=2, ge=1, description="Processes that decode and check large bodies (started with the proxy)."
    )
    max_prompt_tokens: int | None = Field(
        default=None,
        description="Longest prompt sent to the engine (then 400 in the caller's dialect); default the tokenizer's "
        "model_max_length (the model's context).",
    )
    max_calls_per_rollout: int = Field(
        default=256,
        ge=0,
        description="Model calls one rollout may make (0: unlimited); the next is refused with 400 in the caller's "
        "dialect and the rollout seals with status quota_exceeded (graded as usual).",
    )
    max_prompt_tokens_per_rollout: int = Field(
        default=20_000_000,
        ge=0,
        description="Prompt tokens one rollout may send, summed over its calls (0: unlimited); a call that would "
        "pass it is refused like max_calls_per_rollout. 20M: hundreds of 40k-token Claude Code calls.",
    )
    default_ttl_s: float = Field(default=6 * 3600, description="Lifetime of a rollout's secret unless registered.")
    default_max_tokens: int = Field(default=4096, description="Generation cap when the rollout sets none.")
    engine_timeout_s: float = Field(
        default=900.0, gt=0, description="Longest wait for one engine answer, retries included (then 502)."
    )
    engine_retries: int = Field(
        default=90,
        ge=0,
        description="Times one call is sent again while the engine is away (refused, reset, disconnected mid-call, "
        "503 while loading), after a backoff doubling from 0.2 s to 2 s: 90 wait ~3 min, an engine restart with "
        "room to spare; within engine_timeout_s. Then 502 and the rollout is flagged infra_failure. 0: no retry.",
    )
    keepalive_s: float = Field(default=5.0, description="SSE keep-alive period while the engine works.")
    publish_timeout_s: float = Field(default=30.0, description="Kafka delivery deadline per call (then 503).")
    seal_wait_s: float = Field(default=60.0, description="How long a seal waits for calls still in flight.")
    side_model_pattern: str = Field(default=CallKindRules.side_model_pattern, description="Regex: SIDE models.")
    compaction_pattern: str = Field(default=CallKindRules.compaction_pattern, description="Regex: COMPACTION.")
    short_system_chars: int = Field(default=4000, description="Tool-less calls with a shorter system prompt: SIDE.")
    persist_registrations: bool = Field(
        default=True,
        description="Write every rollout registration (the secret's sha256, never the secret) to the compacted "
        "topic clawstream.proxy.registrations, and restore them before the port opens, so a proxy restarted on the "
        "same address serves the rest of its in-flight rollouts. Off: a restart forgets them (the sandbox worker "
        "re-runs them as infrastructure failures).",
    )
    replica_id: str = Field(
        default="",
        description="This proxy's name among replicas that share one public_url behind a load balancer "
        "(docs/scaling.md#proxy-replicas): any replica then serves any call of any rollout, taking its state over "
        "from the registrations topic and the rollout's call events. Empty: a single proxy. Needs "
        "persist_registrations.",
    )
    replica_wait_s: float = Field(
        default=10.0,
        gt=0,
        description="With replica_id: how long a call waits for this replica to read the registrations topic up to "
        "its end before it is answered 503 (Kafka unavailable).",
    )

    @field_validator("engine_url", mode="before")
    @classmethod
    def _join_engine_urls(cls, value: Any) -> Any:
        # A list (the CLI's repeated --engine-url, a test's pool) is kept as the one comma-separated string.
        if isinstance(value, list | tuple):
            return ",".join(str(v).strip() for v in value)
        return value

    @field_validator("engine_url")
    @classmethod
    def _engine_urls_valid(cls, value: str) -> str:
        urls = [u.strip() for u in value.split(",")]
        if not value.strip() or any(not u for u in urls):
            raise ValueError(f"{value!r} holds an empty URL; give one http(s)://host:port per engine, comma-separated")
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"{bad[0]!r} is not an http(s):// URL; give each engine as http://host:port")
        dup = sorted({u for u in urls if urls.count(u) > 1})
        if dup:
            raise ValueError(f"{dup[0]!r} is given twice; list each engine once")
        return ",".join(urls)

    @field_validator("engine_routing")
    @classmethod
    def _known_routing(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown routing {value!r}; use one of {', '.join(POLICIES)}")
        return value

    @property
    def engine_urls(self) -> list[str]:
        """The pool: one URL per engine, in the order given (ties in routing break by it)."""
        return self.engine_url.split(",")

    @model_validator(mode="after")
    def _two_listeners(self) -> ProxySettings:
        if self.admin_port and self.admin_port == self.port and self.admin_host == self.host:
            raise ValueError(f"admin_port {self.admin_port} is the harness-facing port: the admin API needs its own")
        return self

    @model_validator(mode="after")
    def _small_bodies_within_max_json_values(self) -> ProxySettings:
        if self.precheck_bytes > 2 * self.max_json_values:
            raise ValueError(
                f"precheck_bytes {self.precheck_bytes}: a body under it is decoded in the proxy unchecked for "
                f"max_json_values and may hold precheck_bytes / 2 values; set precheck_bytes to at most "
                f"2 x max_json_values ({2 * self.max_json_values}) or raise max_json_values"
            )
        return self

    @model_validator(mode="after")
    def _replicas_share_registrations(self) -> ProxySettings:
        if self.replica_id and not all(c.isalnum() or c in "-_." for c in self.replica_id):
            raise ValueError(f"replica_id {self.replica_id!r}: use letters, digits, '-', '_', '.'")
        if self.replica_id and not self.persist_registrations:
            raise ValueError(
                f"replica_id {self.replica_id!r} needs persist_registrations=true: replicas share rollouts through "
                "the registrations topic (set CLAWSTREAM_PROXY_PERSIST_REGISTRATIONS=true or drop the replica_id)"
            )
        return self
