"""Tests for policy/tiny_model.py: the tiny Qwen3 model, its byte-level BPE tokenizer and its chat template.

The default-configuration model is built once per module (that build is also the build-time check); the
determinism test builds twice more. Run: ``HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/unit/test_model_init.py``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from policy import tiny_model as model_init  # noqa: E402
from policy.architectures import MAX_POSITIONS, ModelInitError, is_current  # noqa: E402
from policy.chat_template import (  # noqa: E402
    ADDED_TOKENS,
    ASSISTANT_TURN_SUFFIX,
    GENERATION_PROMPT,
    IM_END,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    assistant_turn_suffix_ids,
    render_chat,
)
from policy.tiny_model import init_tiny_model  # noqa: E402

BUILD_BUDGET_S = 60.0


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("tiny") / "model"
    t0 = time.perf_counter()
    init_tiny_model(out, seed=0, progress=None)
    return out, time.perf_counter() - t0


@pytest.fixture(scope="module")
def model_dir(built: tuple[Path, float]) -> Path:
    return built[0]


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def ids_of(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kw: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from tokenize=True unless return_dict=False.
    return tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False, **kw)


def text_of(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kw: Any) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, **kw)


TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}},
]

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": 'Copy "notes.txt" to "backup.txt".'},
    {
        "role": "assistant",
        "content": "I will read both files.",
        "tool_calls": [
            # dict arguments (HF style) are rendered with tojson ...
            {"type": "function", "function": {"name": "read_file", "arguments": {"path": "notes.txt"}}},
            # ... string arguments (OpenAI wire style) verbatim.
            {"type": "function", "function": {"name": "read_file", "arguments": '{"path": "backup.txt"}'}},
        ],
    },
    {"role": "tool", "content": "hello\nworld"},
    {"role": "tool", "content": "Error: no such file: backup.txt"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "write_file", "arguments": {"path": "backup.txt"}}]},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "Copied 2 lines.", "reasoning_content": "The copy worked."},
]

EXPECTED = """<|im_start|>system
You are a coding agent.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}
{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Copy "notes.txt" to "backup.txt".<|im_end|>
<|im_start|>assistant
I will read both files.
<tool_call>
{"name": "read_file", "arguments": {"path": "notes.txt"}}
</tool_call>
<tool_call>
{"name": "read_file", "arguments": {"path": "backup.txt"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
hello
world
</tool_response>
<tool_response>
Error: no such file: backup.txt
</tool_response><|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "write_file", "arguments": {"path": "backup.txt"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
ok
</tool_response><|im_end|>
<|im_start|>assistant
<think>
The copy worked.
</think>

Copied 2 lines.<|im_end|>
"""


# --- build ------------------------------------------------------------------------------------------------------


def test_default_build_is_fast_and_complete(built: tuple[Path, float]) -> None:
    out, seconds = built
    print(f"default build took {seconds:.1f}s")
    assert seconds < BUILD_BUDGET_S
    expected = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    for name in expected:
        assert (out / name).is_file(), name
    info = json.loads((out / "clawstream_model.json").read_text())
    assert info["assistant_turn_suffix"] == ASSISTANT_TURN_SUFFIX
    assert info["generation_prompt"] == GENERATION_PROMPT
    assert is_current(out) and not is_current(out, "llama")


def test_default_build_is_the_shipped_warm_starts_base(model_dir: Path) -> None:
    """The shipped warm start was trained from this build: its record, tokenizer and config are byte for byte the
    same, and the weights are the base its sft_summary.json records (a change here would orphan the checkpoint)."""
    shipped = Path(__file__).resolve().parents[2] / "models" / "warmstart"
    if not (shipped / "sft_summary.json").is_file():
        pytest.skip("no shipped warm start in this checkout")
    from warmstart.sft import weights_sha256

    for name in ("clawstream_model.json", "tokenizer.json", "config.json"):
        assert (model_dir / name).read_bytes() == (shipped / name).read_bytes(), name
    stages = json.loads((shipped / "sft_summary.json").read_text())["stages"]
    assert weights_sha256(model_dir) == stages[0]["base_sha256"]


def test_config_is_small_qwen3(model_dir: Path, model: Any, tok: Any) -> None:
    cfg = model.config
    assert cfg.model_type == "qwen3"
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert cfg.tie_word_embeddings is True
    assert cfg.vocab_size == len(tok) == 2048
    assert cfg.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 10_000_000, n_params
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids(IM_END)
    assert gen["top_k"] == 0 and gen["top_p"] == 1.0 and gen["temperature"] == 1.0


def test_context_covers_the_longest_harness_prompts(model: Any, tok: Any) -> None:
    """Real harness prompts reach ~40k tokens with this tokenizer: model and tokenizer both allow 128k (≥ 64k)."""
    assert model.config.max_position_embeddings == tok.model_max_length == MAX_POSITIONS == 131072


def test_bad_shapes_raise(tmp_path: Path) -> None:
    with pytest.raises(ModelInitError):
        init_tiny_model(tmp_path, hidden_size=100, num_heads=3, progress=None)
    with pytest.raises(ModelInitError):
        init_tiny_model(tmp_path, vocab_size=100, progress=None)


# --- tokenizer --------------------------------------------------------------------------------------------------


def test_tokenizer_loads_with_eos_and_pad(tok: Any) -> None:
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None


@pytest.mark.parametrize("token", ADDED_TOKENS)
def test_added_token_is_one_id(tok: Any, token: str) -> None:
    ids = tok.encode(token, add_special_tokens=False)
    assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == token
    # Also when glued to text on both sides (added tokens are split out before pre-tokenization).
    assert ids[0] in tok.encode(f'x{token}"y', add_special_tokens=False)


def test_added_tokens_take_the_last_ids_like_qwen3(tok: Any) -> None:
    ids = [tok.convert_tokens_to_ids(t) for t in ADDED_TOKENS]
    assert ids == list(range(len(tok) - len(ADDED_TOKENS), len(tok)))


def test_only_chat_control_tokens_are_skipped_on_decode(tok: Any) -> None:
    text = "<tool_call>\n{}\n</tool_call><think>a</think><tool_response>b</tool_response><|im_end|><|endoftext|>"
    decoded = tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True)
    for token in MARKUP_TOKENS:
        assert token in decoded
    for token in SPECIAL_TOKENS:
        assert token not in decoded


ROUND_TRIP = [
    "",
    "plain ascii text",
    '{"name": "read_file", "arguments": {"path": "src/main.py", "max": 10}}',
    "def f(x):\n\treturn x ** 2  # square\r\n\n\n    pass\n",
    "Grüße, 世界! 🚀🧪 naïve café — “quotes” ‘single’ … ﬁ",
    "e\u0301 vs \u00e9 (not NFC-normalised), zero\u200bwidth, rtl \u05e9\u05dc\u05d5\u05dd",
    "\x00\x01\x7f control \u0085 chars and  \u3000 odd spaces\u2028",
    "  leading and trailing spaces   \n\n",
    "1234567890 3.14159 -42 2024-05-17T12:00:00Z 0xDEADBEEF",
    "$ ls -la | grep '*.py' && echo \"done\" > /tmp/out.txt; cat <<EOF\nEOF",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 beyond the BMP: 𠜎𠜱𠝹",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_byte_level_round_trip(tok: Any, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # Token by token too: what a streaming detokenizer would join.
    joined = b"".join(_token_bytes(tok, i) for i in ids)
    assert joined.decode("utf-8") == text


def _token_bytes(tok: Any, token_id: int) -> bytes:
    inverse = {ch: i for i, ch in enumerate(_bytes_to_unicode())}
    return bytes(inverse[ch] for ch in tok.convert_ids_to_tokens(token_id))


def _bytes_to_unicode() -> list[str]:
    # GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def test_merges_cover_agent_traffic(tok: Any) -> None:
    # The corpus should make common agent strings cheap; a byte-per-token tokenizer would need ~60 here.
    text = '<tool_call>\n{"name": "read_file", "arguments": {"path": "notes.txt"}}\n</tool_call>'
    assert len(tok.encode(text, add_special_tokens=False)) <= 25


# --- chat template ----------------------------------------------------------------------------------------------


def test_template_renders_exact_markup(tok: Any) -> None:
    assert text_of(tok, CONVERSATION, TOOLS) == EXPECTED
    # The module's tokenizer-free renderer gives the same text.
    assert render_chat(CONVERSATION, TOOLS) == EXPECTED


def test_generation_prompt(tok: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    prompt = text_of(tok, messages, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert text_of(tok, messages) == "<|im_start|>user\nhi<|im_end|>\n"
    no_think = text_of(tok, messages, add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_no_system_turn_without_system_or_tools(tok: Any) -> None:
    assert text_of(tok, [{"role": "user", "content": "x"}]).startswith("<|im_start|>user\n")
    with_tools = text_of(tok, [{"role": "user", "content": "x"}], TOOLS)
    assert with_tools.startswith("<|im_start|>system\n# Tools\n\n")


def test_list_content_parts_render_as_text(tok: Any) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert text_of(tok, parts) == "<|im_start|>user\nab<|im_end|>\n"


def test_unknown_role_raises(tok: Any) -> None:
    with pytest.raises(Exception, match="Unknown message role"):
        text_of(tok, [{"role": "narrator", "content": "x"}])


def _assistant_indices(messages: list[dict[str, Any]]) -> list[int]:
    return [k for k, m in enumerate(messages) if m["role"] == "assistant"]


def test_prefix_stable_at_every_assistant_turn(tok: Any) -> None:
    full_text = text_of(tok, CONVERSATION, TOOLS)
    full_ids = ids_of(tok, CONVERSATION, TOOLS)
    suffix = assistant_turn_suffix_ids(tok)
    assert suffix == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("Ċ")]
    for k in _assistant_indices(CONVERSATION):
        prompt_text = text_of(tok, CONVERSATION[:k], TOOLS, add_generation_prompt=True)
        prompt_ids = ids_of(tok, CONVERSATION[:k], TOOLS, add_generation_prompt=True)
        turn_text = text_of(tok, CONVERSATION[: k + 1], TOOLS)
        turn_ids = ids_of(tok, CONVERSATION[: k + 1], TOOLS)
        assert turn_text.startswith(prompt_text) and full_text.startswith(prompt_text)
        assert turn_ids[: len(prompt_ids)] == prompt_ids and full_ids[: len(prompt_ids)] == prompt_ids
        # What TITO does: prompt ids + the assistant's own ids + the template's suffix + the rest encoded as text.
        body = turn_text[len(prompt_text) : -len(ASSISTANT_TURN_SUFFIX)]
        body_ids = tok.encode(body, add_special_tokens=False)
        rest_ids = tok.encode(full_text[len(turn_text) :], add_special_tokens=False)
        assert turn_ids == prompt_ids + body_ids + suffix
        assert full_ids == prompt_ids + body_ids + suffix + rest_ids


def test_prefix_stable_at_user_turns(tok: Any) -> None:
    messages = CONVERSATION + [{"role": "user", "content": "Thanks. Now delete it."}]
    before = ids_of(tok, messages[:-1], TOOLS)
    after = ids_of(tok, messages, TOOLS)
    assert after[: len(before)] == before


def test_consecutive_tool_messages_are_grouped_so_not_prefix_stable(tok: Any) -> None:
    # Documented exception: the first tool result closes its user turn, the second reopens the same turn.
    one = text_of(tok, CONVERSATION[:4], TOOLS)
    two = text_of(tok, CONVERSATION[:5], TOOLS)
    assert one.endswith("</tool_response><|im_end|>\n")
    assert not two.startswith(one)
    assert two.startswith(one[: -len("<|im_end|>\n")])


def test_leading_newline_in_assistant_body_breaks_token_prefix_only(tok: Any) -> None:
    # Documented exception: "\n" ending the generation prompt merges with a body that starts with a line break.
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\n\nAnswer"}]
    prompt_text = text_of(tok, messages[:1], add_generation_prompt=True)
    assert text_of(tok, messages).startswith(prompt_text)
    prompt_ids = ids_of(tok, messages[:1], add_generation_prompt=True)
    assert ids_of(tok, messages)[: len(prompt_ids)] != prompt_ids
    # A body starting with a space or a letter is fine.
    for content in (" Answer", "Answer", "<think>\nx\n</think>\n\nA", "  x"):
        messages[1]["content"] = content
        assert ids_of(tok, messages)[: len(prompt_ids)] == prompt_ids, content


def test_reasoning_of_earlier_turns_is_kept(tok: Any) -> None:
    # Qwen3 drops it before the last user query, which would break prefix stability; this template keeps it.
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "r"},
        {"role": "user", "content": "c"},
    ]
    assert "<think>\nr\n</think>\n\nb<|im_end|>" in text_of(tok, messages)


def test_assistant_tokens_mask_covers_generated_tokens(tok: Any) -> None:
    out = tok.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    spans: list[list[int]] = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            spans.append([])
        if m:
            spans[-1].append(ids[i])
    assert len(spans) == len(_assistant_indices(CONVERSATION))
    for span in spans:
        assert span[-1] == tok.convert_tokens_to_ids(IM_END)
    assert tok.decode(spans[-1]) == "<think>\nThe copy worked.\n</think>\n\nCopied 2 lines.<|im_end|>"


# --- model ------------------------------------------------------------------------------------------------------


def test_forward_logits_are_finite(model: Any, tok: Any) -> None:
    ids = torch.tensor([ids_of(tok, CONVERSATION, TOOLS)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_greedy_generate_runs(model: Any, tok: Any) -> None:
    ids = torch.tensor([ids_of(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, top_k=None, top_p=None)
    assert out.shape == (1, ids.shape[1] + 6)
    assert out[0, : ids.shape[1]].tolist() == ids[0].tolist()
    with torch.no_grad():
        again = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, top_k=None, top_p=None)
    assert torch.equal(out, again)


# --- determinism ------------------------------------------------------------------------------------------------


def test_same_seed_same_files_other_seed_other_weights(model_dir: Path, tmp_path: Path) -> None:
    again = init_tiny_model(tmp_path / "again", seed=0, progress=None)
    assert (again / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert (again / "clawstream_model.json").read_bytes() == (model_dir / "clawstream_model.json").read_bytes()
    a, b = load_file(model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    # Through the CLI entry point, with another seed.
    assert model_init.main(["--out", str(tmp_path / "other"), "--seed", "1"]) == 0
    c = load_file(tmp_path / "other" / "model.safetensors")
    assert c.keys() == a.keys()
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
