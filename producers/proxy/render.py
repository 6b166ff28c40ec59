"""Conversation → prompt token ids with token-in-token-out (TITO), per rollout. The heart of the serving proxy.

Rendering is piecewise (``header + segment + ... + generation prompt``, each segment rendered behind a stub with the
model's own chat template and tokenized alone), which needs a prefix-stable template (else :class:`RenderError`).
An assistant segment equal to an answer the proxy returned earlier in the rollout is never re-encoded: it becomes
``generation prompt + generated ids + turn suffix``; repeated answer texts get their own ids by position. A request
that extends an earlier call renders only its new messages; otherwise the whole conversation is laid out again from
a per-rollout segment cache and delta-encoded against the longest common prefix. Pure: no Kafka, no aiohttp.
The rules in full (piecewise rendering, TITO, repeated answers, cost): docs/method.md#rendering-piece-by-piece.
Each call's conversation (tools, message keys, its answer) also gets a digest chain (:func:`digest_extend`), recorded
on its call event, so a restarted proxy matches follow-ups to calls it restored from events (:meth:`restore`).
Every request's assistant turns are checked against the answers the rollout got (:meth:`RolloutRenderer.provenance`):
one it never generated is forged, and its call is recorded as ``tampered``.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from policy.token_prefix import common_prefix_len
from producers.proxy.conversation import Conversation, Message, ToolCall
from producers.proxy.tool_parse import TOOL_START, parse_turn

FULL_RENDER = "full_render"
_STUB: list[dict[str, Any]] = [{"role": "user", "content": "."}]
_PROBE_BODY = "probe"  # an assistant body every template renders verbatim


class RenderError(ValueError):
    """The conversation cannot be rendered (bad role, non-prefix-stable template)."""


def _digest(prev: bytes, item: Any) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    return h.digest()


def digest_start(tools_key: str) -> bytes:
    """The digest chain of a conversation before its first message: its tool schemas (``Conversation.tools_key``)."""
    return _digest(b"conversation", tools_key)


def digest_extend(digest: bytes, keys: Iterable[Any]) -> bytes:
    """The chain extended by message keys (``Message.key``), one link each: equal chains, equal key sequences."""
    for key in keys:
        digest = _digest(digest, key)
    return digest


class _PrefixDigests:
    """Digest chains of a request's conversation prefixes, computed as far as asked (restored calls only)."""

    def __init__(self, keys: tuple[str, tuple[Any, ...]]) -> None:
        self.tools_key, self.messages = keys
        self.chain: list[bytes] = []

    def at(self, n: int) -> bytes:
        """The chain over the tools and the first ``n`` message keys."""
        if not self.chain:
            self.chain.append(digest_start(self.tools_key))
        while len(self.chain) <= n:
            self.chain.append(_digest(self.chain[-1], self.messages[len(self.chain) - 1]))
        return self.chain[n]


class TemplateRenderer:
    """Renders segments with a tokenizer's chat template; stateless apart from what it learns of the template.

    What differs between model families is read off the template itself, by rendering probe conversations and
    taking differences: the implicit header (text before the first turn when there is no system message, e.g. a
    Llama ``<|begin_of_text|>`` or a default system turn), the generation prompt, and the turn suffix after an
    assistant body, whose first token is the end-of-turn token generation stops at (``<|im_end|>`` + ``\\n`` for
    Qwen and ChatML, ``<|eot_id|>`` for Llama 3). A template for which this fails raises :class:`RenderError`.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.source = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        self._stub_text = self._render(_STUB)
        twice = self._render(_STUB + _STUB)
        if not twice.startswith(self._stub_text):
            raise self._unstable("a second message changes the first")
        # The stub's own turn, as any later user turn renders; what comes before it in a one-message render is the
        # implicit header (empty for Qwen3: byte-identical to the earlier constant-based rendering).
        self._stub_turn = twice[len(self._stub_text) :]
        if not self._stub_turn or not self._stub_text.endswith(self._stub_turn):
            raise self._unstable("the first user turn renders differently from a later one")
        self.implicit_header = self._stub_text[: len(self._stub_text) - len(self._stub_turn)]
        gen = self._render(_STUB, add_generation_prompt=True)
        if not gen.startswith(self._stub_text):
            raise self._unstable("the generation prompt changes earlier text")
        self.generation_prompt = gen[len(self._stub_text) :]
        self.generation_prompt_ids = self.encode(self.generation_prompt)
        turn = self._render(_STUB + [{"role": "assistant", "content": _PROBE_BODY}])
        opened = self._stub_text + self.generation_prompt + _PROBE_BODY
        if not turn.startswith(opened):
            raise self._unstable("an assistant turn does not start with the generation prompt and its body verbatim")
        self.turn_suffix_text = turn[len(opened) :]
        suffix_ids = self.encode(self.turn_suffix_text)
        added = set(tokenizer.get_added_vocab().values()) if hasattr(tokenizer, "get_added_vocab") else set()
        if not suffix_ids or suffix_ids[0] not in added:
            raise RenderError(
                f"the chat template of {self.source} ends an assistant turn with {self.turn_suffix_text!r}, which does "
                "not start with an added (special) token: no end-of-turn token to stop generation at "
                "(docs/models.md#what-the-chat-template-must-satisfy)"
            )
        # Generation stops at this token (the proxy sends it as the stop token); what follows it is template text.
        self.end_of_turn_id: int = suffix_ids[0]
        self.im_end_id: int = self.end_of_turn_id  # the name older callers use (warmstart, tests)
        self.after_end_of_turn_ids: list[int] = suffix_ids[1:]
        self.tool_calls_bare_json = self._bare_json_tool_calls()

    def _bare_json_tool_calls(self) -> bool:
        """Whether the template writes an assistant's tool call as a bare JSON object (Llama 3) rather than in
        ``<tool_call>`` tags (Qwen, ChatML): how the proxy must parse the model's answers (``tool_parse``)."""
        probe = Message("assistant", "", tool_calls=(ToolCall("probe", "probe_fn", {"k": "v"}),))
        text = self._render(_STUB + [probe.to_template()])[len(self._stub_text) :]
        body = text[len(self.generation_prompt) : len(text) - len(self.turn_suffix_text)]
        if TOOL_START in body or not text.startswith(self.generation_prompt):
            return False
        parsed = parse_turn(body, bare_json=True).tool_calls
        return [(c.name, c.arguments) for c in parsed] == [("probe_fn", {"k": "v"})]

    def _unstable(self, what: str) -> RenderError:
        return RenderError(
            f"the chat template of {self.source} is not prefix-stable ({what}); "
            "see docs/models.md#what-the-chat-template-must-satisfy"
        )

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kw: Any) -> str:
        try:
            return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False, **kw)
        except Exception as exc:  # jinja raises TemplateError for unknown roles and the like
            raise RenderError(f"chat template failed: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:
            # The same ids as ``tok.encode``, but through the Rust tokenizer's batch call, which releases the GIL while
            # it works (``encode`` holds it: 4.8 s for a 4 MiB message, the proxy's event loop frozen meanwhile).
            ids: list[int] = backend.encode_batch([text], add_special_tokens=False)[0].ids
            return ids
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def header_ids(self, conv: Conversation) -> list[int]:
        if _starts_with_system(conv):
            return self.encode(self._render([conv.messages[0].to_template()], list(conv.tools)))
        if not conv.tools:
            return self.encode(self.implicit_header) if self.implicit_header else []
        # Templates refuse an empty conversation: render the tools behind the stub and cut the stub's turn off.
        text = self._render(_STUB, list(conv.tools))
        if not text.endswith(self._stub_turn):
            raise self._unstable("tools change the first message")
        return self.encode(text[: len(text) - len(self._stub_turn)])

    def segment_ids(self, segment: list[Message]) -> list[int]:
        text = self._render(_STUB + [m.to_template() for m in segment])
        if not text.startswith(self._stub_text):
            raise self._unstable("a message changes earlier text")
        return self.encode(text[len(self._stub_text) :])

    def turn_suffix(self, generated: list[int]) -> list[int]:
        """Ids the template puts after a generated body: the end-of-turn token unless generation ended with it
        (``stop``), then the template's text after it (``\\n`` for Qwen, nothing for Llama 3)."""
        if generated and generated[-1] == self.end_of_turn_id:
            return list(self.after_end_of_turn_ids)
        return [self.end_of_turn_id, *self.after_end_of_turn_ids]


def _starts_with_system(conv: Conversation) -> bool:
    return bool(conv.messages) and conv.messages[0].role == "system"


def segments(messages: tuple[Message, ...], start: int) -> list[list[Message]]:
    """Group messages[start:] into render segments: single messages, consecutive tool messages together."""
    out: list[list[Message]] = []
    for msg in messages[start:]:
        if msg.role == "tool" and out and out[-1][-1].role == "tool":
            out[-1].append(msg)
        else:
            out.append([msg])
    return out


@dataclass
class CallRecord:
    """What the rollout remembers of a served call (prompt + generated ids, and how to recognise its answer)."""

    call_id: str
    seq: int
    prompt_ids: list[int]
    generated_ids: list[int]
    answer_key: tuple[Any, ...]
    # (tools key, message keys + answer key): the conversation a follow-up request extends. Kept for the last
    # ``match_window`` calls only (None for older ones), which bounds the memory to a few contexts per rollout.
    conversation: tuple[str, tuple[Any, ...]] | None = None
    # That conversation's length and digest chain (:func:`digest_extend`): what a call restored from its call event
    # (``conversation`` None) is matched by.
    messages: int = 0
    digest: bytes = b""
    reasoning: str = ""  # the answer's reasoning as the proxy parsed it (the transcript shows this, not the echo)


@dataclass
class RenderResult:
    prompt_ids: list[int]
    parent_call_id: str | None
    shared_prefix_len: int
    flags: list[str] = field(default_factory=list)
    rendered_tokens: int = 0  # ids produced by the template + tokenizer for this call (the CPU-cost driver)
    conversation: tuple[str, tuple[Any, ...]] | None = None  # (tools key, message keys) of the request
    digest: bytes = b""  # the request's digest chain (tools + message keys)
    # Indices of the request's assistant turns this rollout never generated (:meth:`RolloutRenderer.provenance`),
    # and the proxy's own reasoning for each of the others (index -> reasoning).
    forged: tuple[int, ...] = ()
    reasoning: dict[int, str] = field(default_factory=dict)

    @property
    def new_tokens(self) -> list[int]:
        return self.prompt_ids[self.shared_prefix_len :]

    def answered(self, answer_key: tuple[Any, ...]) -> tuple[int, bytes]:
        """(messages, digest) of the conversation a follow-up extends: this request's plus the answer it got."""
        messages = len(self.conversation[1]) if self.conversation is not None else 0
        return messages + 1, digest_extend(self.digest, [answer_key])


class RolloutRenderer:
    """Per-rollout TITO state. Not thread-safe: the proxy renders one call of a rollout at a time."""

    def __init__(self, renderer: TemplateRenderer, segment_cache_size: int = 4096, match_window: int = 8) -> None:
        self.r = renderer
        self.records: list[CallRecord] = []
        self._match_window = match_window
        # answer key -> the answers with that key, in the order they were generated (see "Repeated answers")
        self._answers: dict[tuple[Any, ...], list[CallRecord]] = {}
        self._cache: OrderedDict[bytes, list[int]] = OrderedDict()
        self._cache_size = segment_cache_size

    def _answer_ids(
        self, keys: tuple[Any, ...], index: int, where: dict[tuple[Any, ...], list[int]]
    ) -> list[int] | None:
        """Generated ids of the answer the assistant message ``keys[index]`` echoes (None: not a known answer).

        With several answers of that key, the k-th message with the key gets the k-th answer when the counts agree
        (module docstring: "Repeated answers"); ``where`` caches the key's message positions for this render.
        """
        key = keys[index]
        recs = self._answers.get(key)
        if not recs:
            return None
        if len(recs) > 1:
            positions = where.get(key)
            if positions is None:  # only for repeated answers: the common case costs one dict lookup
                positions = where[key] = [i for i, k in enumerate(keys) if k == key]
            if len(positions) == len(recs):
                return recs[positions.index(index)].generated_ids
        return recs[-1].generated_ids

    def _segment(self, seg: list[Message], counter: list[int]) -> list[int]:
        key = _digest(b"seg", [m.key() for m in seg] + [[m.reasoning for m in seg]])
        ids = self._cache.get(key)
        if ids is None:
            ids = self.r.segment_ids(seg)
            counter[0] += len(ids)
            self._cache[key] = ids
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return ids

    def _render_from(self, conv: Conversation, keys: tuple[Any, ...], start: int, counter: list[int]) -> list[int]:
        """Ids of ``conv.messages[start:]`` (``keys``: the message keys) + the generation prompt."""
        out: list[int] = []
        where: dict[tuple[Any, ...], list[int]] = {}
        index = start
        for seg in segments(conv.messages, start):
            gen = self._answer_ids(keys, index, where) if len(seg) == 1 and seg[0].role == "assistant" else None
            if gen is not None:  # TITO: the proxy's own turn maps back to its generated ids
                out += self.r.generation_prompt_ids + gen + self.r.turn_suffix(gen)
            else:
                out += self._segment(seg, counter)
            index += len(seg)
        out += self.r.generation_prompt_ids
        return out

    def render(self, conv: Conversation) -> RenderResult:
        """Prompt ids for ``conv``, its delta encoding against the best earlier call of this rollout, and its
        assistant turns' provenance (:meth:`provenance`)."""
        if not conv.messages:
            raise RenderError("the conversation has no messages")
        keys = (conv.tools_key(), tuple(m.key() for m in conv.messages))
        result = self._layout(conv, keys)
        result.forged, result.reasoning = self.provenance(conv, keys[1])
        return result

    def provenance(self, conv: Conversation, keys: tuple[Any, ...]) -> tuple[tuple[int, ...], dict[int, str]]:
        """Which assistant turns of ``conv`` (``keys``: its message keys) this rollout never generated, and the
        reasoning the proxy generated for each of the others.

        A turn is its own when its key (text stripped, tool calls by name and canonical arguments: what honest
        harnesses keep of an answer) is an answer's key, the k-th turn with a key needing k answers with it. A
        turn with neither text nor tool calls, or one a harness writes itself (``Message.carries_nothing``), is
        never forged (its reasoning is dropped all the same)."""
        forged: list[int] = []
        reasoning: dict[int, str] = {}
        seen: dict[tuple[Any, ...], int] = {}
        for i, msg in enumerate(conv.messages):
            if msg.role != "assistant":
                continue
            key = keys[i]
            k = seen[key] = seen.get(key, -1) + 1
            recs = self._answers.get(key, ())
            if k < len(recs):
                reasoning[i] = recs[k].reasoning
            elif not msg.carries_nothing():
                forged.append(i)
            else:
                reasoning[i] = ""
        return tuple(forged), reasoning

    def _layout(self, conv: Conversation, keys: tuple[str, tuple[Any, ...]]) -> RenderResult:
        """Prompt ids for ``conv`` and its delta encoding (``keys``: its tools key and message keys)."""
        counter = [0]
        best_j, parent = 0, None
        prefixes = _PrefixDigests(keys)
        for rec in reversed(self.records[-self._match_window :]):
            if rec.conversation is None:  # restored from its call event: matched by its digest chain instead
                j = rec.messages
                if rec.digest and best_j < j <= len(keys[1]) and prefixes.at(j) == rec.digest:
                    best_j, parent = j, rec
                continue
            if rec.conversation[0] != keys[0]:
                continue
            j = len(rec.conversation[1])
            if best_j < j <= len(keys[1]) and keys[1][:j] == rec.conversation[1]:  # memcmp of the strings
                best_j, parent = j, rec
        if parent is not None:
            shared = parent.prompt_ids + parent.generated_ids
            new = self._render_from(conv, keys[1], best_j, counter)
            prompt = shared + self.r.turn_suffix(parent.generated_ids) + new
            digest = digest_extend(parent.digest, keys[1][best_j:])  # hashes the new messages only
            return RenderResult(prompt, parent.call_id, len(shared), [], counter[0], keys, digest)
        # No earlier call is a prefix of this conversation: lay it out again, with TITO for known answers.
        start = 1 if _starts_with_system(conv) else 0
        header = self.r.header_ids(conv)
        counter[0] += len(header)
        prompt = header + self._render_from(conv, keys[1], start, counter)
        flags = [FULL_RENDER] if self.records else []
        best, best_len = None, 0
        for rec in self.records:
            full = rec.prompt_ids + rec.generated_ids
            n = common_prefix_len(full, prompt)
            if n > best_len or (n == best_len and n > 0):  # ties: the later call
                best, best_len = rec, n
        digest = prefixes.at(len(keys[1]))
        return RenderResult(prompt, best.call_id if best else None, best_len, flags, counter[0], keys, digest)

    def record(
        self,
        call_id: str,
        seq: int,
        result: RenderResult,
        generated_ids: list[int],
        answer: Message,
    ) -> CallRecord:
        """Remember a served call so later requests that carry its answer map back to ``generated_ids``."""
        rec = CallRecord(
            call_id=call_id,
            seq=seq,
            prompt_ids=result.prompt_ids,
            generated_ids=list(generated_ids),
            answer_key=answer.key(),
            reasoning=answer.reasoning,
        )
        if result.conversation is not None:
            rec.conversation = (result.conversation[0], (*result.conversation[1], rec.answer_key))
        rec.messages, rec.digest = result.answered(rec.answer_key)
        return self._append(rec)

    def restore(
        self,
        call_id: str,
        seq: int,
        prompt_ids: list[int],
        generated_ids: list[int],
        answer_key: tuple[Any, ...],
        messages: int,
        digest: bytes,
        reasoning: str = "",
    ) -> CallRecord:
        """Remember a call served before a restart, from its call event: as :meth:`record` did, except that its
        conversation is known by its length and digest chain only (the event does not carry the messages)."""
        rec = CallRecord(
            call_id, seq, list(prompt_ids), list(generated_ids), answer_key, None, messages, digest, reasoning
        )
        return self._append(rec)

    def _append(self, rec: CallRecord) -> CallRecord:
        self.records.append(rec)
        if len(self.records) > self._match_window:
            self.records[-self._match_window - 1].conversation = None
            self.records[-self._match_window - 1].digest = b""
        self._answers.setdefault(rec.answer_key, []).append(rec)
        return rec
