"""Instruction data (no ranks): conversations rendered by the tokenizer's chat template give the
ids transformers' apply_chat_template gives, with the loss on the assistant's tokens only;
prompt/completion pairs learn the completion and EOS; rows are cut, padded and left out as
documented; the example cache is reused and rebuilt when damaged; bad data and templates are one
line naming the row or file, and a template cannot reach Python's internals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_sets import CHATML, chatml_tokenizer, conversation, write_chats, write_pairs
from tokenizers import Tokenizer

from medley.data.bpe import EOS
from medley.data.chat import encode_conversation, load_chat_template
from medley.data.examples import IGNORE
from medley.data.load import DataOptions, load_source
from medley.errors import MedleyInputError

SEQ = 128


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


def _options(tokenizer: Path, cache: Path, **more: object) -> DataOptions:
    return DataOptions(tokenizer=str(tokenizer), cache_dir=cache, **more)


def _learned(tokenizer: Path, ids: list[int], mask: list[int]) -> str:
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)


def test_conversation_ids_are_transformers_and_only_the_assistant_is_learned(chatml: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(chatml)
    template = load_chat_template(chatml, None)
    tokenizer = Tokenizer.from_file(str(chatml / "tokenizer.json"))
    for i in range(4):
        ids, mask = encode_conversation(conversation(i), template=template, tokenizer=tokenizer, where="row")
        assert ids.tolist() == hf.apply_chat_template(conversation(i), tokenize=True)["input_ids"]
        turns = [m["content"] for m in conversation(i) if m["role"] == "assistant"]
        # Each assistant turn's text and its end-of-turn marker, nothing of the prompt.
        assert _learned(chatml, ids.tolist(), mask.tolist()).replace(" ", "") == \
            "".join(f"{t}<|im_end|>\n" for t in turns).replace(" ", "")


def test_rows_mask_prompts_and_padding_and_the_loss_counts_learned_targets(chatml: Path,
                                                                           tmp_path: Path) -> None:
    data = write_chats(tmp_path / "chat.jsonl", 12)
    source = load_source(str(data), seq_len=200, options=_options(chatml, tmp_path / "cache"), vocab_size=256)
    assert source.examples is not None and source.examples.count == 12
    rows = source.global_rows(step=0, seed=1, sequences=3, seq_len=200)
    assert rows.tokens.shape == (3, 201) and rows.targets.shape == (3, 200)
    eos = Tokenizer.from_file(str(chatml / "tokenizer.json")).token_to_id(EOS)
    for r in range(3):
        learned = rows.targets[r] != IGNORE
        assert torch.equal(rows.targets[r][learned], rows.tokens[r, 1:][learned])
        length = int((rows.tokens[r] != eos).sum())  # padded with EOS on the right, never learned
        assert (rows.tokens[r, length:] == eos).all() and not learned[length - 1:].any()
    assert rows.loss_tokens == int((rows.targets != IGNORE).sum()) > 0
    assert "12 conversations, 0 cut" in source.notes[0]


def test_long_examples_are_cut_and_those_with_nothing_learned_left_out(chatml: Path, tmp_path: Path) -> None:
    long_prompt = [{"role": "user", "content": " ".join(["Knead the dough."] * 40)},
                   {"role": "assistant", "content": "Bake it."}]
    rows = [{"messages": conversation(i)} for i in range(4)] + [{"messages": long_prompt}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = load_source(str(data), seq_len=96, options=_options(chatml, tmp_path / "cache"), vocab_size=256)
    assert source.examples is not None and source.examples.order.tolist() == [0, 1, 2, 3]
    assert "5 conversations, 5 cut to 97 tokens, 1 left out" in source.notes[0]


def test_prompt_completion_pairs_learn_the_completion_and_eos(chatml: Path, tmp_path: Path) -> None:
    data = write_pairs(tmp_path / "pairs.jsonl", 6)
    source = load_source(str(data), seq_len=SEQ, options=_options(chatml, tmp_path / "cache"), vocab_size=256)
    assert source.examples is not None
    tok = Tokenizer.from_file(str(chatml / "tokenizer.json"))
    row = json.loads(data.read_text().splitlines()[int(source.examples.order[0])])
    tokens, targets = source.examples.rows([0])
    prompt = tok.encode(row["prompt"], add_special_tokens=False).ids
    completion = tok.encode(row["completion"], add_special_tokens=False).ids + [tok.token_to_id(EOS)]
    assert tokens[0, :len(prompt) + len(completion)].tolist() == prompt + completion
    learned = targets[0][targets[0] != IGNORE].tolist()
    assert learned == completion
    assert "prompt/completion pairs" in source.notes[0] and "completion tokens only" in source.notes[0]


def test_the_kind_follows_the_first_row_or_the_flag(chatml: Path, tmp_path: Path) -> None:
    data = write_chats(tmp_path / "chat.jsonl", 4)
    with pytest.raises(MedleyInputError, match="chat.jsonl:1: has a non-text field 'messages'"):
        load_source(str(data), seq_len=SEQ, options=_options(chatml, tmp_path / "c", kind="text",
                                                             text_field="messages"), vocab_size=256)
    auto = load_source(str(data), seq_len=SEQ, options=_options(chatml, tmp_path / "c"), vocab_size=256)
    assert auto.examples is not None and auto.fingerprint.startswith("chat:")
    with pytest.raises(MedleyInputError, match="--data-format 'chats' must be one of auto, text, chat"):
        load_source(str(data), seq_len=SEQ, options=_options(chatml, tmp_path / "c", kind="chats"))
    with pytest.raises(MedleyInputError, match=r"chat\.jsonl:1: needs 'prompt' and 'completion'"):
        load_source(str(data), seq_len=SEQ, options=_options(chatml, tmp_path / "c", kind="completion"),
                    vocab_size=256)


def test_the_cache_is_reused_and_a_damaged_one_rebuilt(chatml: Path, tmp_path: Path) -> None:
    data = write_chats(tmp_path / "chat.jsonl", 6)
    options = _options(chatml, tmp_path / "cache")
    first = load_source(str(data), seq_len=SEQ, options=options, vocab_size=256)
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 5 and not any(name.endswith(".tmp") for name in files)
    ids = next((tmp_path / "cache").glob("*.ids"))
    stamp = ids.stat().st_mtime_ns
    again = load_source(str(data), seq_len=SEQ, options=options, vocab_size=256)
    assert ids.stat().st_mtime_ns == stamp and again.fingerprint == first.fingerprint
    want = first.examples.rows([0, 1])[0]  # a copy: the cache is mapped, and edited in place below
    raw = bytearray(ids.read_bytes())
    raw[0] ^= 1
    ids.write_bytes(bytes(raw))
    rebuilt = load_source(str(data), seq_len=SEQ, options=options, vocab_size=256)
    assert rebuilt.fingerprint == first.fingerprint
    assert torch.equal(rebuilt.examples.rows([0, 1])[0], want)


@pytest.mark.parametrize(("row", "message"), [
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "no assistant message"),
    ({"messages": [{"role": "chef", "content": "Hi"}]}, "message 0 must be"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
     "message 0 must be"),
    ({"prompt": "a", "completion": 3}, "'prompt' and 'completion' must both be text"),
])
def test_a_bad_row_is_one_line_naming_it(chatml: Path, tmp_path: Path, row: dict, message: str) -> None:
    data = tmp_path / "bad.jsonl"
    good = {"messages": conversation(0)} if "messages" in row else {"prompt": "a", "completion": "b"}
    data.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(MedleyInputError, match=rf"bad\.jsonl:2: {message}"):
        load_source(str(data), seq_len=SEQ, options=_options(chatml, tmp_path / "cache"), vocab_size=256)


def _tokenizer_with(tmp_path: Path, chatml: Path, template: str | None) -> Path:
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((chatml / "tokenizer.json").read_bytes())
    config = {"eos_token": EOS} if template is None else {"eos_token": EOS, "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(("template", "message"), [
    (None, "has none .* pass --chat-template FILE"),
    ("{% for m in messages %}", "not a Jinja template"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "the chat template .* failed"),
    ("{{ raise_exception('no system messages') }}", "failed \\(no system messages\\)"),
    # Rewrites earlier turns: the last assistant turn alone is shown.
    ("{{ messages[-1]['content'] }}", "does not render the start of a conversation"),
])
def test_bad_templates_are_one_line(chatml: Path, tmp_path: Path, template: str | None, message: str) -> None:
    tokenizer = _tokenizer_with(tmp_path, chatml, template)
    data = write_chats(tmp_path / "chat.jsonl", 3)
    with pytest.raises(MedleyInputError, match=message):
        load_source(str(data), seq_len=SEQ, options=_options(tokenizer, tmp_path / "cache"), vocab_size=256)


def test_chat_template_file_and_jinja_file_beside_the_tokenizer(chatml: Path, tmp_path: Path) -> None:
    tokenizer = _tokenizer_with(tmp_path, chatml, None)
    (tmp_path / "t.jinja").write_text(CHATML)
    given = load_chat_template(tokenizer, str(tmp_path / "t.jinja"))
    (tokenizer / "chat_template.jinja").write_text(CHATML)
    beside = load_chat_template(tokenizer, None)
    assert given.template == beside.template == CHATML and beside.source.endswith("chat_template.jinja")
    assert given.special == {"eos_token": EOS}


def test_chat_data_needs_a_tokenizer(tmp_path: Path) -> None:
    data = write_chats(tmp_path / "chat.jsonl", 3)
    with pytest.raises(MedleyInputError, match="chat data needs a tokenizer; pass --tokenizer"):
        load_source(str(data), seq_len=SEQ)
