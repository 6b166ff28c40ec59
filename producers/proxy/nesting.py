"""How deep JSON nests, measured without recursion: before anything that recurses once per level ever sees it.

``json.loads``, ``json.dumps``, ``repr`` and the chat template each recurse once per nesting level, so a value nested
near the interpreter's recursion limit (1000) passes one of them and raises ``RecursionError`` in the next, wherever
its stack already was. Client input (request bodies, tool-call arguments sent as JSON text, the model's own tool
calls, files a harness wrote) is measured here first and refused, or kept as text, past a fixed depth.

:func:`json_depth` reads JSON text in one linear pass and never parses it: escapes dropped (``\\\\`` pairs, then
``\\"``), every byte but quotes and brackets dropped, the brackets between an odd and the next even quote (inside a
string) ignored, the running sum of ``[{`` = +1 and ``]}`` = -1 maximised. For text that is not valid JSON it may
answer deeper than ``json.loads`` would get before its error, never less. Linear: a few ``bytes.replace`` and
``translate`` passes, then numpy. :func:`value_depth` measures a decoded value with an explicit stack;
:func:`loads_within` is ``json.loads`` behind the text check.

Pure: numpy and the standard library.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

SAFE_DEPTH = 256  # the deepest any setting may allow: far enough under the recursion limit for every walk after
ECHO_DEPTH = 8  # levels a request wraps around tool-call arguments a harness echoes (Anthropic's input: 6), rounded up

_OPEN, _CLOSE, _QUOTE = 1, 0xFF, 2  # int8: +1, -1, and a marker
_STEPS = bytes.maketrans(b'[{]}"', bytes([_OPEN, _OPEN, _CLOSE, _CLOSE, _QUOTE]))
_OTHER = bytes(b for b in range(256) if b not in b'[]{}"')


class TooDeep(ValueError):
    """JSON text nested deeper than allowed (a ``ValueError``: callers that keep unparseable text keep it too)."""


def json_depth(text: str | bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (0: a scalar, 1: ``[1]``), in one linear pass."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if b"[" not in raw and b"{" not in raw:
        return 0
    # An escape is a backslash and the byte after it, paired left to right: in a run of backslashes the pairs go
    # first, then a lone one left before a quote escapes it. No other escape holds a quote or a bracket. (Replaced by
    # as many bytes that are dropped next: bytes.replace is fastest at equal lengths.)
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"  ").replace(b'\\"', b"  ")
    raw = raw.translate(_STEPS, _OTHER)
    raw = raw.replace(b'""', b"")  # the strings holding no bracket (most): dropping a quote pair keeps the parity
    if not raw:
        return 0
    steps = np.frombuffer(raw, dtype=np.int8)
    if bytes([_QUOTE]) in raw:  # brackets inside strings: from an opening quote up to its closing one, not counted
        quotes = steps == _QUOTE
        inside = np.bitwise_xor.accumulate(quotes.view(np.uint8)).view(bool)
        steps = np.where(inside | quotes, np.int8(0), steps)
    return max(int(np.cumsum(steps, dtype=np.int32).max()), 0)


def value_depth(value: Any, cap: int = SAFE_DEPTH) -> int:
    """The nesting depth of a decoded value (dicts, lists, tuples), walked with an explicit stack; stops at the first
    level past ``cap`` and returns ``cap + 1``."""
    containers = (dict, list, tuple)
    if not isinstance(value, containers):
        return 0
    deepest, stack = 1, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > cap:
            return cap + 1
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, containers))
    return deepest


def loads_within(text: str | bytes, max_depth: int = SAFE_DEPTH) -> Any:
    """``json.loads`` of text nested at most ``max_depth`` deep; :class:`TooDeep` for deeper text."""
    depth = json_depth(text)
    if depth > max_depth:
        raise TooDeep(f"JSON nested {depth} levels deep (at most {max_depth})")
    return json.loads(text)
