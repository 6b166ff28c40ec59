"""The built-in white-box agent loop (the paper's baseline harness): a short tool-use loop over an LLM API.

Runs *inside the sandbox* (stdlib only, so any image with Python 3 runs it)::

    AGENTLOOP_API_KEY=... python -m producers.harnesses.builtin_loop --dialect openai --base-url URL/v1 \
        --model policy "PROMPT"

Two dialects with deliberately different surfaces, so two heterogeneous harnesses can be mixed on a CPU:

* ``openai``: ``POST {base}/chat/completions``; tools ``read_file{path}``, ``write_file{path,content}``,
  ``list_files{path}``, ``run{command,timeout}``, ``finish{summary}``; system prompt :data:`OPENAI_SYSTEM`.
* ``anthropic``: ``POST {base}/v1/messages``; tools ``Read{file_path}``, ``Write{file_path,content}``,
  ``LS{path}``, ``Shell{command}``, ``Done{message}``; system prompt :data:`ANTHROPIC_SYSTEM`.

Paths are relative to ``--workspace`` (the cwd by default). The loop ends when the model calls the finish tool,
answers without a tool call, or after ``--max-turns`` calls. Exit 0 then; exit 3 when the API fails (HTTP error,
e.g. 401 after the rollout was sealed, or unreachable), with the reason on stderr. Non-streaming requests.

The HTTP transport is a parameter of :func:`run_openai` / :func:`run_anthropic` (``post``, a :data:`Post`; default
the urllib :func:`post`), so the warm start (``warmstart``) can drive this very loop against an in-process
stand-in of the serving proxy without patching the module.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

OPENAI_SYSTEM = (
    "You are a careful coding agent working in a workspace directory. Use the tools to read and "
    "write files. Call finish when the task is done."
)
ANTHROPIC_SYSTEM = (
    "You are Shell Agent. You solve file tasks step by step with your tools. Quote file names "
    "exactly. When everything is complete, call Done."
)
MAX_OUTPUT = 8000


def _prop(**fields: str) -> dict[str, Any]:
    return {"type": "object", "properties": {k: {"type": v} for k, v in fields.items()}, "required": list(fields)}


# name → (role of the tool, description, JSON schema, argument names in role order)
OPENAI_TOOLS = {
    "read_file": ("read", "Read a text file.", _prop(path="string"), ("path",)),
    "write_file": (
        "write",
        "Write a text file (creates or replaces it).",
        _prop(path="string", content="string"),
        ("path", "content"),
    ),
    "list_files": ("list", "List the files under a directory.", _prop(path="string"), ("path",)),
    "run": (
        "run",
        "Run a shell command; returns its output.",
        _prop(command="string", timeout="integer"),
        ("command", "timeout"),
    ),
    "finish": ("finish", "Finish the task.", _prop(summary="string"), ("summary",)),
}
ANTHROPIC_TOOLS = {
    "Read": ("read", "Reads a file from the workspace.", _prop(file_path="string"), ("file_path",)),
    "Write": (
        "write",
        "Writes a file in the workspace.",
        _prop(file_path="string", content="string"),
        ("file_path", "content"),
    ),
    "LS": ("list", "Lists a directory of the workspace.", _prop(path="string"), ("path",)),
    "Shell": ("run", "Executes a bash command in the workspace.", _prop(command="string"), ("command",)),
    "Done": ("finish", "Signals that the task is complete.", _prop(message="string"), ("message",)),
}


class ApiFailure(Exception):
    pass


class Tools:
    def __init__(self, workspace: Path, run_timeout: float = 30.0) -> None:
        self.ws = workspace
        self.run_timeout = run_timeout

    def _path(self, path: str) -> Path:
        return Path(path) if Path(path).is_absolute() else self.ws / path

    def call(self, role: str, args: list[Any]) -> str:
        try:
            if role == "read":
                return self._path(str(args[0])).read_text(errors="replace")[:MAX_OUTPUT]
            if role == "write":
                target = self._path(str(args[0]))
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text("" if args[1] is None else str(args[1]))
                return f"wrote {target.stat().st_size} bytes to {args[0]}"
            if role == "list":
                base = self._path(str(args[0] or "."))
                names = sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())
                return "\n".join(names[:500]) or "(empty)"
            if role == "run":
                timeout = float(args[1] or self.run_timeout) if len(args) > 1 else self.run_timeout
                proc = subprocess.run(
                    str(args[0]),
                    shell=True,
                    cwd=self.ws,
                    capture_output=True,
                    text=True,
                    timeout=min(timeout, self.run_timeout),
                    stdin=subprocess.DEVNULL,
                )
                return f"exit code {proc.returncode}\n{(proc.stdout + proc.stderr)[-MAX_OUTPUT:]}"
        except subprocess.TimeoutExpired:
            return "error: the command timed out"
        except (OSError, IndexError, ValueError) as exc:
            return f"error: {exc}"
        return f"error: unknown tool role {role}"


# (url, JSON body, headers, timeout in seconds) -> the decoded JSON answer; raises ApiFailure when the API fails.
Post = Callable[[str, dict[str, Any], dict[str, str], float], dict[str, Any]]


def post(url: str, body: dict[str, Any], headers: dict[str, str], timeout: float) -> dict[str, Any]:
    """The real transport: one JSON POST over urllib."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise ApiFailure(f"HTTP {exc.code} from {url}: {exc.read()[:300]!r}") from exc
    except (urllib.error.URLError, TimeoutError, ValueError) as exc:
        raise ApiFailure(f"{url}: {exc}") from exc


def _args(tool: tuple, given: dict[str, Any]) -> list[Any]:
    return [given.get(name) for name in tool[3]]


def run_openai(args: argparse.Namespace, tools: Tools, key: str, post: Post = post) -> str:
    url = args.base_url.rstrip("/") + "/chat/completions"
    schema = [
        {"type": "function", "function": {"name": n, "description": t[1], "parameters": t[2]}}
        for n, t in OPENAI_TOOLS.items()
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": OPENAI_SYSTEM},
        {"role": "user", "content": args.prompt},
    ]
    for _ in range(args.max_turns):
        body = {"model": args.model, "messages": messages, "tools": schema, "max_tokens": args.max_tokens}
        msg = post(url, body, {"Authorization": f"Bearer {key}"}, args.http_timeout)["choices"][0]["message"]
        calls = msg.get("tool_calls") or []
        turn = {"role": "assistant", "content": msg.get("content")}
        messages.append({**turn, "tool_calls": calls} if calls else turn)
        if not calls:
            return "answered without a tool call"
        for call in calls:
            name = call["function"]["name"]
            try:
                given = json.loads(call["function"].get("arguments") or "{}")
            except ValueError:
                given = {}
            tool = OPENAI_TOOLS.get(name)
            if tool is not None and tool[0] == "finish":
                return "finished"
            result = tools.call(tool[0], _args(tool, given)) if tool else f"error: no tool named {name}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return "max turns"


def run_anthropic(args: argparse.Namespace, tools: Tools, key: str, post: Post = post) -> str:
    url = args.base_url.rstrip("/") + "/v1/messages"
    schema = [{"name": n, "description": t[1], "input_schema": t[2]} for n, t in ANTHROPIC_TOOLS.items()]
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": args.prompt}]}]
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    for _ in range(args.max_turns):
        body = {
            "model": args.model,
            "max_tokens": args.max_tokens,
            "system": ANTHROPIC_SYSTEM,
            "messages": messages,
            "tools": schema,
        }
        content = post(url, body, headers, args.http_timeout)["content"]
        messages.append({"role": "assistant", "content": content})
        uses = [b for b in content if b.get("type") == "tool_use"]
        if not uses:
            return "answered without a tool call"
        results = []
        for use in uses:
            tool = ANTHROPIC_TOOLS.get(use["name"])
            if tool is not None and tool[0] == "finish":
                return "finished"
            result = tools.call(tool[0], _args(tool, use.get("input") or {})) if tool else f"no tool {use['name']}"
            results.append({"type": "tool_result", "tool_use_id": use["id"], "content": result})
        messages.append({"role": "user", "content": results})
    return "max turns"


def main(argv: list[str] | None = None) -> int:
    prog = "python -m producers.harnesses.builtin_loop"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("prompt")
    parser.add_argument("--dialect", choices=("openai", "anthropic"), default="openai")
    parser.add_argument("--base-url", required=True, help="openai: .../v1; anthropic: the base without /v1")
    parser.add_argument("--model", default="policy")
    parser.add_argument("--workspace", type=Path, default=Path.cwd())
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--http-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    key = os.environ.get("AGENTLOOP_API_KEY", "")
    tools = Tools(args.workspace)
    try:
        why = (run_openai if args.dialect == "openai" else run_anthropic)(args, tools, key)
    except ApiFailure as exc:
        print(f"agentloop: API failure: {exc}", file=sys.stderr)
        return 3
    print(json.dumps({"result": why}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
