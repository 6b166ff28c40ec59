"""Synthetic training text for the tiny model's tokenizer: agent-traffic-looking documents, generated from a seed.

English-ish prose about files and tasks, JSON tool calls with quoted names, file names, digits, code-ish snippets
and whole conversations rendered with the project's chat template, so the BPE merges cover what the proxy will
encode. Deterministic: all randomness comes from one seeded ``random.Random``. No downloads.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

from policy.chat_template import ADDED_TOKENS, render_chat

_NOUNS = (
    "file files folder directory workspace task tasks report line lines word words number numbers total value "
    "values name names list table column row rows entry entries record records log logs config result results "
    "summary answer output input data note notes item items key keys error errors test tests function script "
    "module project user users date dates price prices count size status message messages title header path "
    "paths command commands version order orders invoice budget score scores city cities email todo todos "
    "event events day week month year amount balance customer product products category label tag tags"
).split()
_VERBS = (
    "read write create delete rename move copy list count find search replace sort merge split append update "
    "check run open save print return compute extract parse summarize fix add remove insert filter group "
    "convert format compare verify load store clean"
).split()
_ADJS = (
    "first last new old empty large small hidden main final current next previous total missing sorted unique "
    "daily weekly monthly raw clean short long red blue green open closed active pending done"
).split()
_EXTS = "txt md json csv py js ts yaml yml toml log sh html css sql ini cfg xml".split()
_DIRS = "src tests docs data logs config scripts lib app build out notes reports tmp input output assets".split()
_PEOPLE = "alice bob carol dave erin frank grace heidi ivan judy mallory oscar peggy trent victor walter".split()
_FILLER = (
    "the a an of to in on for with from into by and or but then so if when that this these those it its is are "
    "was were be has have had do does not no all each every some any more less than as at per"
).split()

# (name, description, {param: (json type, description)}) -- names of the tools real harnesses expose, so their
# schemas and calls are cheap to tokenize.
_TOOLS: tuple[tuple[str, str, dict[str, tuple[str, str]]], ...] = (
    ("read_file", "Read a file from the workspace.", {"path": ("string", "Path of the file to read.")}),
    (
        "write_file",
        "Write content to a file, replacing it.",
        {"path": ("string", "Path of the file."), "content": ("string", "Text to write.")},
    ),
    ("list_dir", "List the entries of a directory.", {"path": ("string", "Directory to list.")}),
    ("run_command", "Run a shell command in the workspace.", {"command": ("string", "The command line.")}),
    (
        "edit_file",
        "Replace text in a file.",
        {
            "path": ("string", "Path of the file."),
            "old": ("string", "Text to find."),
            "new": ("string", "Replacement text."),
        },
    ),
    (
        "search_files",
        "Search files for a pattern.",
        {"pattern": ("string", "Regular expression."), "path": ("string", "Where to search.")},
    ),
    ("Read", "Reads a file from the local filesystem.", {"file_path": ("string", "The absolute path to read.")}),
    (
        "Write",
        "Writes a file to the local filesystem.",
        {"file_path": ("string", "The absolute path."), "content": ("string", "The content to write.")},
    ),
    (
        "Edit",
        "Performs exact string replacements in files.",
        {
            "file_path": ("string", "The absolute path."),
            "old_string": ("string", "The text to replace."),
            "new_string": ("string", "The replacement text."),
        },
    ),
    (
        "Bash",
        "Executes a bash command.",
        {"command": ("string", "The command to execute."), "description": ("string", "What it does.")},
    ),
    ("Glob", "Fast file pattern matching.", {"pattern": ("string", "The glob pattern.")}),
    (
        "Grep",
        "Search file contents with a regex.",
        {"pattern": ("string", "The regex."), "path": ("string", "Directory to search.")},
    ),
    ("exec", "Execute a shell command.", {"command": ("string", "Shell command to run.")}),
    ("read", "Read a file.", {"path": ("string", "File path.")}),
    ("write", "Write a file.", {"path": ("string", "File path."), "content": ("string", "File content.")}),
    ("shell", "Runs a shell command and returns its output.", {"command": ("array", "The command and arguments.")}),
    ("apply_patch", "Apply a patch to files.", {"input": ("string", "The patch text.")}),
    (
        "count_lines",
        "Count the lines of a file.",
        {"path": ("string", "Path of the file."), "max": ("integer", "Stop after this many lines.")},
    ),
)


def _tool_schema(tool: tuple[str, str, dict[str, tuple[str, str]]]) -> dict[str, Any]:
    name, description, params = tool
    properties: dict[str, Any] = {}
    for pname, (ptype, pdesc) in params.items():
        prop: dict[str, Any] = {"type": ptype, "description": pdesc}
        if ptype == "array":
            prop["items"] = {"type": "string"}
        properties[pname] = prop
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(params)},
        },
    }


class _CorpusWriter:
    """Deterministic generator of agent-traffic-looking text; all randomness comes from one seeded ``Random``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def word(self) -> str:
        return self.rng.choice(_NOUNS)

    def number(self) -> str:
        r = self.rng
        kind = r.randrange(7)
        if kind == 0:
            return str(r.randrange(10))
        if kind == 1:
            return str(r.randrange(1000))
        if kind == 2:
            return str(r.randrange(10**7))
        if kind == 3:
            return f"{r.uniform(0, 1000):.{r.randrange(1, 4)}f}"
        if kind == 4:
            return f"{r.randrange(1990, 2031)}-{r.randrange(1, 13):02d}-{r.randrange(1, 29):02d}"
        if kind == 5:
            return f"{r.randrange(24):02d}:{r.randrange(60):02d}:{r.randrange(60):02d}"
        return f"-{r.randrange(100)}"

    def identifier(self) -> str:
        r = self.rng
        parts = [r.choice(_ADJS + _VERBS), self.word()]
        if r.random() < 0.3:
            parts.append(str(r.randrange(10)))
        style = r.randrange(3)
        if style == 0:
            return "_".join(parts)
        if style == 1:
            return "-".join(parts)
        return parts[0] + "".join(p.capitalize() for p in parts[1:])

    def filename(self) -> str:
        r = self.rng
        name = self.identifier() if r.random() < 0.6 else self.word()
        base = f"{name}.{r.choice(_EXTS)}"
        depth = r.choice((0, 0, 1, 1, 2))
        prefix = "/".join(r.choice(_DIRS) for _ in range(depth))
        path = f"{prefix}/{base}" if prefix else base
        if r.random() < 0.15:
            path = r.choice(("/root/.openclaw/workspace/", "/workspace/", "./", "/tmp/", "~/")) + path
        return path

    def sentence(self) -> str:
        r = self.rng
        templates = (
            "{V} the {a} {n} in `{f}` and {v} the {n2}.",
            '{V} "{f}" and write the {n} to "{f2}".',
            "The {n} in {f} has {d} {n2}.",
            "Please {v} every {n} that is {a}, then {v2} the {n2} into {f}.",
            "I {vd} {f} and found {d} {n2}.",
            "There are {d} {n} in the {a} {n2}; the {n3} is {d2}.",
            "{V} all {a} {n} from {f} and save them as {f2}.",
            "Done. The {n} is {d}.",
            "Let me {v} the {n} first.",
            "The task asks to {v} the {n} of `{f}`.",
            "Create a file named {q}{f}{q} containing {q}{w}{q}.",
            "Count the {n} in {q}{f}{q} and report the {a} {n2}.",
            "Error: {n} not found: {f}",
            "{P} wants the {a} {n} by {date}.",
            "Now I will {v} {f} with the {n}.",
        )
        tmpl = r.choice(templates)
        verb = r.choice(_VERBS)
        text = tmpl.format(
            V=verb.capitalize(),
            v=r.choice(_VERBS),
            v2=r.choice(_VERBS),
            vd=r.choice(("read", "checked", "opened", "parsed", "listed")),
            a=r.choice(_ADJS),
            n=self.word(),
            n2=self.word(),
            n3=self.word(),
            f=self.filename(),
            f2=self.filename(),
            d=self.number(),
            d2=self.number(),
            q=r.choice(('"', '"', "'", "`")),
            w=self.word(),
            P=r.choice(_PEOPLE).capitalize(),
            date=f"{r.randrange(2020, 2031)}-{r.randrange(1, 13):02d}-{r.randrange(1, 29):02d}",
        )
        if r.random() < 0.3:
            text += " " + " ".join(r.choice(_FILLER + _NOUNS) for _ in range(r.randrange(3, 10))) + "."
        return text

    def paragraph(self) -> str:
        return " ".join(self.sentence() for _ in range(self.rng.randrange(1, 5)))

    def arguments(self, params: dict[str, tuple[str, str]]) -> dict[str, Any]:
        args: dict[str, Any] = {}
        for pname, (ptype, _) in params.items():
            if ptype == "integer":
                args[pname] = self.rng.randrange(100)
            elif ptype == "array":
                args[pname] = ["bash", "-lc", self.shell()]
            elif "path" in pname:
                args[pname] = self.filename()
            elif pname in ("command",):
                args[pname] = self.shell()
            elif pname == "pattern":
                args[pname] = self.rng.choice(("*.py", "**/*.md", "TODO", r"def \w+", self.word(), "*.json"))
            else:
                args[pname] = self.file_content() if self.rng.random() < 0.5 else self.sentence()
        return args

    def shell(self) -> str:
        r = self.rng
        f = self.filename()
        options = (
            f"cat {f}",
            f"ls -la {r.choice(_DIRS)}",
            f"wc -l {f}",
            f"grep -n {self.word()} {f}",
            f"python3 {self.filename()}",
            f"head -n {r.randrange(1, 50)} {f}",
            f"mkdir -p {r.choice(_DIRS)}/{self.word()}",
            f"echo '{self.word()}' > {f}",
            f"sort {f} | uniq -c | sort -rn",
            f"find . -name '*.{r.choice(_EXTS)}'",
            f"cp {f} {self.filename()}",
            "pytest -q",
            f"sed -i 's/{self.word()}/{self.word()}/g' {f}",
        )
        return r.choice(options)

    def file_content(self) -> str:
        r = self.rng
        kind = r.randrange(6)
        if kind == 0:
            return "\n".join(self.sentence() for _ in range(r.randrange(1, 6)))
        if kind == 1:
            header = ",".join(r.sample(_NOUNS, 3))
            rows = [",".join((r.choice(_PEOPLE), self.number(), self.word())) for _ in range(r.randrange(1, 6))]
            return "\n".join([header, *rows])
        if kind == 2:
            obj = {self.word(): self.number() for _ in range(r.randrange(1, 4))}
            obj[self.word()] = [self.word() for _ in range(r.randrange(0, 4))]
            return json.dumps(obj, indent=r.choice((None, 2)))
        if kind == 3:
            return "\n".join(f"- {self.sentence()}" for _ in range(r.randrange(1, 5)))
        if kind == 4:
            return self.code()
        return "\n".join(f"{r.choice(_DIRS)}/{self.filename().rsplit('/', 1)[-1]}" for _ in range(r.randrange(1, 6)))

    def code(self) -> str:
        r = self.rng
        fn, var, n = self.identifier().replace("-", "_"), self.word(), self.number()
        snippets = (
            f"def {fn}({var}):\n    return len({var})\n",
            f"def {fn}(path: str) -> int:\n    with open(path) as f:\n        return sum(1 for _ in f)\n",
            f"for {var} in {self.word()}s:\n    if {var} > {n}:\n        print({var})\n",
            f"import json\n\ndata = json.load(open('{self.filename()}'))\nprint(data['{self.word()}'])\n",
            f"{var} = [{', '.join(self.number() for _ in range(r.randrange(1, 5)))}]\n",
            f"const {var} = require('./{self.word()}');\nmodule.exports = {{ {fn} }};\n",
            f"#!/bin/bash\nset -e\n{self.shell()}\n",
            f"class {fn.capitalize()}:\n    def __init__(self, {var}):\n        self.{var} = {var}\n",
            f"--- a/{self.filename()}\n+++ b/{self.filename()}\n@@ -1,2 +1,2 @@\n"
            f"-{self.sentence()}\n+{self.sentence()}\n",
            f'if __name__ == "__main__":\n    {fn}({n})\n',
            f"SELECT {self.word()}, COUNT(*) FROM {self.word()}s WHERE {self.word()} > {n} GROUP BY 1;\n",
        )
        return r.choice(snippets)

    def tool_call(self, tool: tuple[str, str, dict[str, tuple[str, str]]]) -> dict[str, Any]:
        return {"type": "function", "function": {"name": tool[0], "arguments": self.arguments(tool[2])}}

    def tool_result(self) -> str:
        r = self.rng
        kind = r.randrange(5)
        if kind == 0:
            return self.file_content()
        if kind == 1:
            return r.choice(("ok", "OK", "done", "File written.", "Success", "(no output)", "exit code 0"))
        if kind == 2:
            reason = r.choice(("No such file or directory", "permission denied", "timeout"))
            return f"Error: {reason}: {self.filename()}"
        if kind == 3:
            return self.number()
        return json.dumps({"ok": r.random() < 0.8, "result": self.sentence()})

    def conversation(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        r = self.rng
        tools = [_tool_schema(t) for t in r.sample(_TOOLS, r.randrange(1, 6))] if r.random() < 0.8 else None
        tool_defs = [t for t in _TOOLS if tools and any(s["function"]["name"] == t[0] for s in tools)]
        messages: list[dict[str, Any]] = []
        if r.random() < 0.7:
            messages.append({"role": "system", "content": r.choice(_SYSTEM_PROMPTS)})
        messages.append({"role": "user", "content": self.paragraph()})
        for _ in range(r.randrange(0, 4) if tool_defs else 0):
            calls = [self.tool_call(r.choice(tool_defs)) for _ in range(r.randrange(1, 3))]
            message: dict[str, Any] = {"role": "assistant", "content": self.sentence() if r.random() < 0.4 else ""}
            message["tool_calls"] = calls
            if r.random() < 0.2:
                message["reasoning_content"] = self.paragraph()
            messages.append(message)
            messages.extend({"role": "tool", "content": self.tool_result()} for _ in calls)
        messages.append({"role": "assistant", "content": self.paragraph()})
        if r.random() < 0.2:
            messages.append({"role": "user", "content": self.sentence()})
        return messages, tools

    def document(self) -> str:
        """One training document; chat markup is produced by the real template."""
        r = self.rng
        kind = r.random()
        if kind < 0.45:
            messages, tools = self.conversation()
            return render_chat(messages, tools, add_generation_prompt=messages[-1]["role"] == "user")
        if kind < 0.60:
            return self.paragraph()
        if kind < 0.75:
            tool = r.choice(_TOOLS)
            call = {"name": tool[0], "arguments": self.arguments(tool[2])}
            return json.dumps(call, separators=r.choice(((", ", ": "), (",", ":"))), ensure_ascii=False)
        if kind < 0.90:
            return self.code()
        return self.file_content()


_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a coding agent working in a sandboxed workspace. Use the tools to inspect and change files.",
    "You are Claude Code, an interactive CLI tool that helps users with software engineering tasks.",
    "You are a personal assistant running inside OpenClaw. Your workspace is /root/.openclaw/workspace.",
    "You are Codex, a coding agent. Be concise. Use the shell tool to run commands.",
    "Answer with the exact value only.",
)

_ADDED_TOKEN_RE = re.compile("|".join(re.escape(t) for t in ADDED_TOKENS))


def iter_corpus(seed: int, num_documents: int) -> Iterator[str]:
    """Yield the tokenizer's training text: ``num_documents`` documents, each cut at the added tokens.

    Added tokens are split out of the text before pre-tokenization at encode time, so the BPE trainer must not
    see them either (it would waste merges on spelling ``<|im_start|>`` out of bytes).
    """
    writer = _CorpusWriter(seed)
    for _ in range(num_documents):
        for piece in _ADDED_TOKEN_RE.split(writer.document()):
            if piece:
                yield piece


# --- build ------------------------------------------------------------------------------------------------------
