"""Any causal LM: the same services on Qwen3, Qwen2.5 (ChatML) and Llama (Llama-3 template) random-weight directories.

Per architecture (``policy.architectures``, built once per session): the CPU inference worker serves the directory
as a real subprocess and its prefix cache serves a follow-up; the proxy's renderer lays out a multi-turn tool-calling
conversation token-in-token-out and the prefix property holds across the turn the engine generated, and the real
proxy app (in-memory publisher) serves two chat calls in front of the worker the same way; one learner step
on that conversation's tree reproduces the engine's logprobs and moves the weights; a weight swap (the weight store's
file, applied by the engine's weights target) makes the engine answer from the new weights. No Kafka, no hub.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web
from transformers import AutoTokenizer

from consumers.inference.engine import Engine
from consumers.inference.generation import GenerationResult, SamplingParams
from consumers.inference.server import load_policy
from consumers.inference.settings import InferenceWorkerSettings
from consumers.inference.weight_follower import EngineWeightsTarget
from learner.forward import packed_logprobs
from learner.hparams import Hyperparams
from learner.pack import pack_trees
from learner.precision import load_policy as load_trainable
from learner.step import ScoredTree, train_step
from policy.architectures import ARCHITECTURES, init_model
from policy.weight_store import save_weights
from producers.proxy.app import Proxy
from producers.proxy.conversation import Conversation, Message, ToolCall, function_tool
from producers.proxy.render import RenderError, RolloutRenderer, TemplateRenderer
from producers.proxy.settings import ProxySettings
from producers.proxy.tool_parse import parse_turn
from schemas.events import CallEvent, TreeSegment, WeightVersion
from tests.support.inference import Worker

pytestmark = pytest.mark.integration

# Engine (fp32, its own attention and KV cache) vs learner (fp32 SDPA over a packed tree): measured max |Δ| per
# token is ~1e-6 on these models; the bound leaves room for other CPUs' kernels, and a wrong token or position is
# off by far more (the logprobs of a 1024-token vocabulary are around -7).
LOGPROB_TOL = 1e-3
PLAIN = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
TOOLS = (
    function_tool("read", "read a file", {"type": "object", "properties": {"path": {"type": "string"}}}),
    function_tool("write", "write a file", {"type": "object", "properties": {"path": {"type": "string"}}}),
)
HISTORY = (
    Message("system", "You are a coding agent. Use the tools to inspect and change files."),
    Message("user", "Read notes.txt, then write a summary to summary.txt."),
    Message("assistant", "", tool_calls=(ToolCall("c1", "read", {"path": "notes.txt"}),)),
    Message("tool", "buy milk\ncall the bank"),
    Message("user", "Now write the summary."),
)


@dataclass
class Episode:
    """Two engine calls of one rollout and everything the checks need."""

    arch: str
    model_dir: Path
    tok: Any
    renderer: TemplateRenderer
    convs: list[Conversation] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    gens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    shared_prefix_len: int = 0


@pytest.fixture(scope="session", params=ARCHITECTURES)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arch") / request.param
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
    return init_model(out, request.param, vocab_size=1024, num_documents=500, progress=None, **sizes)


async def _complete(url: str, prompt: list[int], stop: int, seed: int) -> dict[str, Any]:
    body = {
        "model": "policy",
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": seed,
        "stop_token_ids": [stop],
        "logprobs": 1,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


@pytest.fixture(scope="session")
def worker(model_dir: Path) -> Iterator[Worker]:
    """The CPU inference worker serving ``model_dir`` (a subprocess, no Kafka), blocks of 16 tokens."""
    w = Worker(["--model", str(model_dir), "--no-weights"], env={"CLAWSTREAM_INFER_PREFIX_BLOCK_SIZE": "16"})
    yield w
    w.stop()


@pytest.fixture(scope="session")
def episode(model_dir: Path, worker: Worker) -> Episode:
    """Two calls of a tool-calling rollout, rendered by the proxy's renderer and served by the worker (first calls)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    ep = Episode(model_dir.name, model_dir, tok, TemplateRenderer(tok))
    rollout = RolloutRenderer(ep.renderer)
    conv = Conversation(HISTORY, TOOLS)
    for call in range(2):
        rendered = rollout.render(conv)
        if call == 1:
            ep.shared_prefix_len = rendered.shared_prefix_len
        reply = asyncio.run(_complete(worker.url or "", rendered.prompt_ids, ep.renderer.end_of_turn_id, 7 + call))
        choice = reply["choices"][0]
        ep.convs.append(conv)
        ep.prompts.append(rendered.prompt_ids)
        ep.gens.append(choice["token_ids"])
        ep.logprobs.append(choice["logprobs"]["token_logprobs"])
        ep.cached.append(reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
        # The answer as the harness sees it (special tokens kept: the reference render below must reproduce
        # the generated text byte for byte); the harness then runs the tool and asks again.
        answer = Message("assistant", _body_text(ep, choice["token_ids"]))
        rollout.record(f"call-{call}", call, rendered, choice["token_ids"], answer)
        conv = Conversation((*conv.messages, answer, Message("user", "Go on.")), TOOLS)
    return ep


def _body_text(ep: Episode, gen: list[int]) -> str:
    body = gen[:-1] if gen and gen[-1] == ep.renderer.end_of_turn_id else gen
    return ep.tok.decode(body, skip_special_tokens=False)


def _template_ids(ep: Episode, conv: Conversation, tokenize: bool = True) -> Any:
    return ep.tok.apply_chat_template(
        [m.to_template() for m in conv.messages],
        tools=list(conv.tools),
        add_generation_prompt=True,
        tokenize=tokenize,
        return_dict=False,
    )


def test_the_renderer_learns_each_family_s_turn_markers(episode: Episode) -> None:
    r, tok = episode.renderer, episode.tok
    expected = {
        "qwen3": ("<|im_start|>assistant\n", "<|im_end|>", "\n", ""),
        "qwen2.5": ("<|im_start|>assistant\n", "<|im_end|>", "\n", "<|im_start|>system\nYou are a helpful"),
        "llama": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", "", "<|begin_of_text|>"),
    }[episode.arch]
    assert r.generation_prompt == expected[0]
    assert tok.convert_ids_to_tokens(r.end_of_turn_id) == expected[1] == tok.eos_token
    assert tok.decode(r.after_end_of_turn_ids) == expected[2]
    assert r.implicit_header.startswith(expected[3]) and bool(r.implicit_header) == bool(expected[3])


def test_a_turn_that_stopped_at_the_end_of_turn_token_gets_the_rest_of_the_suffix(episode: Episode) -> None:
    # The engine's answers above hit max_tokens (random weights rarely sample the end-of-turn token); this is the
    # other branch: the generated ids end with it, so only the template's text after it follows.
    r, conv = episode.renderer, Conversation(HISTORY, TOOLS)
    rollout = RolloutRenderer(r)
    first = rollout.render(conv)
    gen = [*r.encode("All done."), r.end_of_turn_id]
    answer = Message("assistant", "All done.")
    rollout.record("stopped", 0, first, gen, answer)
    follow = Conversation((*conv.messages, answer, Message("user", "Thanks.")), TOOLS)
    second = rollout.render(follow)
    assert second.shared_prefix_len == len(first.prompt_ids) + len(gen)
    assert second.prompt_ids == list(_template_ids(episode, follow))


def test_a_template_that_is_not_prefix_stable_is_refused_naming_the_model(episode: Episode) -> None:
    tok = AutoTokenizer.from_pretrained(episode.model_dir)
    # A count of the messages up front: every new message rewrites the start of the conversation.
    tok.chat_template = "{{ messages | length }}" + tok.chat_template
    with pytest.raises(RenderError, match=f"{episode.model_dir}.*not prefix-stable"):
        TemplateRenderer(tok)
    # An assistant turn that does not end in an added token: nothing to stop generation at.
    tok.chat_template = episode.tok.chat_template.replace("<|im_end|>'", "END'").replace("<|eot_id|>'", "END'")
    with pytest.raises(RenderError, match=f"{episode.model_dir}.*end-of-turn"):
        TemplateRenderer(tok)


def test_the_proxy_parses_tool_calls_in_the_template_s_own_format(episode: Episode) -> None:
    r = episode.renderer
    assert r.tool_calls_bare_json == (episode.arch == "llama")  # Llama 3: bare JSON; Qwen, ChatML: <tool_call> tags
    calls = (ToolCall("a", "read", {"path": "notes.txt"}), ToolCall("b", "write", {"path": "s.txt", "text": "x\ny"}))
    answer = Message("assistant", "", tool_calls=calls)
    # What a model trained on its template's history would write: the body of a rendered tool-calling turn.
    body = episode.tok.decode(r.segment_ids([answer]), skip_special_tokens=False)
    body = body[len(r.generation_prompt) : len(body) - len(r.turn_suffix_text)]
    turn = parse_turn(body, bare_json=r.tool_calls_bare_json)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [(c.name, c.arguments) for c in calls]
    assert turn.text == "" and turn.flags == []


def test_piecewise_render_equals_the_template(episode: Episode) -> None:
    # The first call is laid out from nothing (header + segments + generation prompt): it must be exactly the
    # model's own template, tokenized whole (one <|begin_of_text|> for Llama, ChatML's default system turn aside).
    assert episode.prompts[0] == list(_template_ids(episode, episode.convs[0]))
    fresh = RolloutRenderer(episode.renderer).render(Conversation(HISTORY[1:2]))
    assert fresh.prompt_ids == list(_template_ids(episode, Conversation(HISTORY[1:2])))


def test_tito_prompt_extends_the_generated_turn_and_matches_the_template(episode: Episode) -> None:
    first, gen, second = episode.prompts[0], episode.gens[0], episode.prompts[1]
    # Token-in-token-out: the follow-up starts with the first prompt and the engine's own ids, untouched.
    assert episode.shared_prefix_len == len(first) + len(gen)
    assert second[: len(first) + len(gen)] == first + gen
    # ... and the ids after them (turn suffix, new messages, generation prompt) are the template's: decoded, the
    # whole prompt is the template's text of the conversation with the generated answer in it.
    text = episode.tok.decode(second, skip_special_tokens=False)
    assert text == _template_ids(episode, episode.convs[1], tokenize=False)
    # The prefix property of the template itself, without TITO: a full render of the follow-up (the answer
    # re-encoded from its text) starts with the first call's prompt token for token.
    full = RolloutRenderer(episode.renderer).render(episode.convs[1]).prompt_ids
    assert full[: len(first)] == first


def test_engine_prefix_cache_serves_the_follow_up(episode: Episode) -> None:
    block = 16
    print(f"[{episode.arch}] cached prompt tokens: {episode.cached} of {[len(p) for p in episode.prompts]}")
    assert episode.cached[0] == 0  # a fresh worker
    # Every full block of the first call's prompt + answer is cached when it retires; the follow-up shares them.
    assert episode.cached[1] >= (len(episode.prompts[0]) + len(episode.gens[0]) - 1) // block * block > 0


def _tree(ep: Episode) -> list[TreeSegment]:
    """The rollout's tree: first prompt, first answer (trainable), the follow-up's new tokens, second answer."""
    (p0, p1), (g0, g1), (l0, l1) = ep.prompts, ep.gens, ep.logprobs
    bridge = p1[len(p0) + len(g0) :]

    def seg(parent: int, tokens: list[int], logprobs: list[float] | None) -> TreeSegment:
        lp = np.asarray(logprobs or [], dtype="<f4")
        extra = PLAIN if logprobs is not None else {}
        return TreeSegment(parent, np.asarray(tokens, dtype="<i4"), logprobs is not None, lp, 0, None, **extra)

    return [seg(-1, p0, None), seg(0, g0, l0), seg(1, bridge, None), seg(2, g1, l1)]


def _trainable_logprobs(model: torch.nn.Module, segments: list[TreeSegment]) -> torch.Tensor:
    [row] = pack_trees([segments], 4096)
    with torch.no_grad():
        lp = packed_logprobs(model, row, only_trainable=True)
    return lp[row.loss_mask]


def test_learner_step_reproduces_engine_logprobs_then_swaps_into_the_engine(episode: Episode, tmp_path: Path) -> None:
    segments = _tree(episode)
    engine_lp = torch.tensor(episode.logprobs[0] + episode.logprobs[1])
    torch.manual_seed(0)
    model = load_trainable(episode.model_dir)
    before = _trainable_logprobs(model, segments)
    gap = float((before - engine_lp).abs().max())
    print(f"[{episode.arch}] learner vs engine logprobs: max |Δ| = {gap:.2e} over {len(engine_lp)} tokens")
    assert gap < LOGPROB_TOL

    old = {k: v.clone() for k, v in model.state_dict().items()}
    config = Hyperparams(lr=1e-2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    metrics = train_step(model, optimizer, [ScoredTree(segments, 1.0, 1.0, "matrix")], config)
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, old[k])]
    assert metrics["trainable_tokens"] == len(engine_lp) and metrics["grad_norm"] > 0
    assert len(moved) == len(old), sorted(set(old) - set(moved))  # every tensor got a gradient and moved
    after = _trainable_logprobs(model, segments)
    assert float(after.mean()) > float(before.mean())  # a positive advantage made the sampled answers likelier

    # The weight swap: the learner's new version, through the weight store, into an engine loaded as the worker
    # loads it (the follower's EngineWeightsTarget: verify the file, check the tensors, swap between steps).
    saved = save_weights(model, tmp_path / "store", "policy", 1)
    event = WeightVersion(
        policy_version=1,
        timestamp_ms=0,
        model_name="policy",
        step=1,
        uri=saved.uri,
        sha256=saved.sha256,
        size_bytes=saved.size_bytes,
    )
    served, served_tok, eos_ids = load_policy(InferenceWorkerSettings(model=episode.model_dir))
    assert episode.renderer.end_of_turn_id in eos_ids  # the worker stops there even without the proxy's stop id
    engine = Engine(served, eos_token_ids=eos_ids, pad_token_id=served_tok.pad_token_id or 0)
    engine.start()
    try:
        prompt = episode.prompts[1]
        stale = _generate(engine, prompt)
        target = EngineWeightsTarget(engine)
        target.apply(target.prepare(event), event)
        fresh = _generate(engine, prompt)
    finally:
        engine.stop()
    assert (stale.policy_version, fresh.policy_version) == (0, 1)
    initial = load_trainable(episode.model_dir)
    answered = {
        "old answer, old weights": (_answer_logprobs(initial, prompt, stale), stale),
        "new answer, new weights": (_answer_logprobs(model, prompt, fresh), fresh),
        "new answer, old weights": (_answer_logprobs(initial, prompt, fresh), fresh),
    }
    gaps = {k: float((lp - torch.tensor(r.outputs[0].logprobs)).abs().max()) for k, (lp, r) in answered.items()}
    print(f"[{episode.arch}] swap: {gaps}")
    assert gaps["old answer, old weights"] < LOGPROB_TOL and gaps["new answer, new weights"] < LOGPROB_TOL
    assert gaps["new answer, old weights"] > 10 * LOGPROB_TOL  # the answers come from the new weights


def _answer_logprobs(model: torch.nn.Module, prompt: list[int], result: GenerationResult) -> torch.Tensor:
    out = result.outputs[0]
    tree = [
        TreeSegment(-1, np.asarray(prompt, "<i4"), False, np.zeros(0, "<f4"), 0),
        TreeSegment(0, np.asarray(out.token_ids, "<i4"), True, np.asarray(out.logprobs, "<f4"), 0, None, **PLAIN),
    ]
    return _trainable_logprobs(model, tree)


def _generate(engine: Engine, prompt: list[int]) -> GenerationResult:
    done = threading.Event()
    box: list[Any] = []

    def callback(outcome: Any) -> None:
        box.append(outcome)
        done.set()

    engine.submit([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=3), callback)
    assert done.wait(60)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


class _Collected:
    """A publisher that keeps the proxy's records in memory (the call events this test reads back)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, bytes | None]] = []

    async def publish(self, topic: str, key: str, value: bytes | None, timeout: float) -> None:
        self.records.append((topic, key, value))

    def close(self) -> None:
        pass


async def _proxy_episode(model_dir: Path, engine_url: str) -> tuple[list[CallEvent], list[dict[str, Any]]]:
    """Two OpenAI chat calls of one rollout through the real proxy app (tokenizer loaded from ``model_dir``)."""
    settings = ProxySettings(model=model_dir, engine_url=engine_url, port=0, admin_port=0, admin_token="admin")
    publisher = _Collected()
    proxy = Proxy(settings, publisher, "calls")
    runner, admin = web.AppRunner(proxy.app()), web.AppRunner(proxy.admin_app())
    await runner.setup()
    await admin.setup()
    # Its own system prompt: no block of the episode's prompts is shared, whichever test runs first on the worker.
    history = (Message("system", "You are a careful agent."), *HISTORY[1:])
    messages: list[dict[str, Any]] = [m.to_template() for m in history]
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        await web.TCPSite(admin, "127.0.0.1", 0).start()
        url, admin_url = (f"http://127.0.0.1:{r.addresses[0][1]}" for r in (runner, admin))
        async with aiohttp.ClientSession() as http:
            body = {"rollout_id": "arch", "max_tokens": 12, "temperature": 1.0, "seed": 5}
            async with http.post(
                f"{admin_url}/admin/rollouts", json=body, headers={"Authorization": "Bearer admin"}
            ) as r:
                assert r.status == 201, await r.text()
                secret = (await r.json())["secret"]
            for _ in range(2):
                request = {"model": "policy", "messages": messages, "tools": [dict(t) for t in TOOLS]}
                headers = {"Authorization": f"Bearer {secret}"}
                async with http.post(f"{url}/r/arch/v1/chat/completions", json=request, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    reply = await r.json()
                messages = [*messages, reply["choices"][0]["message"], {"role": "user", "content": "Go on."}]
    finally:
        await runner.cleanup()
        await admin.cleanup()
    calls = [CallEvent.from_bytes(v) for topic, _k, v in publisher.records if topic == "calls" and v is not None]
    return sorted(calls, key=lambda e: e.seq), messages


def test_the_proxy_app_serves_the_family_token_in_token_out(model_dir: Path, worker: Worker) -> None:
    """The real proxy (dialect parsing, rendering, engine call with the template's stop token, answer parsing, call
    events) in front of the worker: the follow-up extends the first call's prompt + generated ids (TITO)."""
    calls, messages = asyncio.run(_proxy_episode(model_dir, worker.url or ""))
    assert [c.seq for c in calls] == [0, 1], calls
    first, second = calls
    prompt0 = first.new_tokens.tolist()
    gen0 = first.generated_tokens.tolist()
    assert second.parent_call_id == first.call_id and second.shared_prefix_len == len(prompt0) + len(gen0)
    prompt1 = (prompt0 + gen0)[: second.shared_prefix_len] + second.new_tokens.tolist()
    assert second.prompt_len == len(prompt1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    r = TemplateRenderer(tok)
    # What the template writes for the conversation with the engine's own turn in it (specials kept, as generated):
    # the proxy's prompt decodes to exactly that text, so its generation prompt and turn suffix are the family's.
    body = gen0[:-1] if gen0 and gen0[-1] == r.end_of_turn_id else gen0
    own = [*messages[: len(HISTORY)], {"role": "assistant", "content": tok.decode(body, skip_special_tokens=False)}]
    expected = tok.apply_chat_template(
        [*own, {"role": "user", "content": "Go on."}],
        tools=[dict(t) for t in TOOLS],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert tok.decode(prompt1, skip_special_tokens=False) == expected
    assert first.finish_reason in ("stop", "length") and len(gen0) <= 12
