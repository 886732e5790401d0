"""Tokenizers, preparation, the packed loader and its errors, on small files made in each test."""

import base64
import errno
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
import torch

import attention
import data
import files
import prepare
import tokenizer
from kernels import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[1]
BYTES = tokenizer.ByteTokenizer()
WORDS = ["the", "thing", "fox", "lazy", "dog", "data", "token", "model", "seed", "rank"]


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n)]


def write_ranks_file(path):
    """A tiny Llama 3 style ranks file: the 256 single bytes, then a few merges."""
    merges = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing"]
    tokens = [bytes([i]) for i in range(256)] + merges
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return path


def write_sentencepiece_model(path):
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences(500)),
        model_writer=model,
        vocab_size=320,  # 256 byte-fallback pieces + merges, so any text round-trips
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    return path


def write_dataset(path, tokens, mask=None, bos_id=256, eos_id=257):
    """A dataset directory written by hand, for loader tests that want exact token values."""
    path.mkdir()
    tokens = np.asarray(tokens, dtype=np.uint32)
    mask = np.ones(len(tokens), np.uint8) if mask is None else np.asarray(mask, np.uint8)
    tokens.tofile(path / "tokens.bin")
    mask.tofile(path / "loss_mask.bin")
    meta = {
        "format_version": prepare.FORMAT_VERSION,
        "tokenizer": "test",
        "vocab_size": 1 << 20,
        "bos_id": bos_id,
        "eos_id": eos_id,
        "n_tokens": len(tokens),
        "n_documents": 1,
    }
    (path / "meta.json").write_text(json.dumps(meta))
    return data.TokenDataset(path)


def arange_dataset(tmp_path, n_tokens=1001):
    """Token i has value i (BOS/EOS ids out of range), so sample k starts with k * seq_len."""
    return write_dataset(tmp_path / "arange", np.arange(n_tokens), bos_id=1 << 30, eos_id=1 << 30)


def read_steps(loader, steps):
    return [next(loader) for _ in range(steps)]


def first_tokens(batches):
    return [int(t) for b in batches for t in b.tokens[:, 0]]


# Tokenizers


def test_byte_tokenizer_round_trips_utf8():
    text = "héllo wörld 🙂\n"
    ids = BYTES.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert BYTES.decode([BYTES.bos_id, *ids, BYTES.eos_id]) == text
    assert (BYTES.vocab_size, BYTES.bos_id, BYTES.eos_id) == (258, 256, 257)
    assert tokenizer.load_tokenizer(None).name == "bytes"


def test_tiktoken_ranks_file_loads_with_llama3_specials(tmp_path):
    tok = tokenizer.load_tokenizer(write_ranks_file(tmp_path / "tokenizer.model"))
    assert isinstance(tok, tokenizer.TiktokenTokenizer)
    assert tok.name.startswith("tiktoken:") and len(tok.name) == len("tiktoken:") + 12
    n = 256 + 7
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (n + 256, n, n + 1)
    assert tok.encode("the")[0] == 258  # merged through "th" and "he"
    text = "the thing <|eot_id|> héllo 🙂"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert max(ids) < n, "special-token text in a document must stay ordinary text"


def test_sentencepiece_model_loads_and_round_trips(tmp_path):
    tok = tokenizer.load_tokenizer(write_sentencepiece_model(tmp_path / "tokenizer.model"))
    assert isinstance(tok, tokenizer.SentencePieceTokenizer)
    assert tok.name.startswith("sentencepiece:")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (320, 1, 2)
    text = "the lazy fox, trained! émoji 🙂"
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == text


def test_missing_tokenizer_file_names_the_path_and_how_to_fetch_a_hub_id(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="nope.model"):
        tokenizer.load_tokenizer(tmp_path / "nope.model")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=r"HuggingFaceTB/SmolLM2-135M-Instruct not found \(a local"
    ):
        tokenizer.load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match=r"huggingface-cli download ID --local-dir DIR`, then DIR"):
        prepare.show([write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])], 1, "Org/model")


def test_garbage_tokenizer_file_names_expected_formats(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"\x00\x01 this is not a tokenizer \xff" * 10)
    with pytest.raises(ValueError, match="tiktoken.*sentencepiece"):
        tokenizer.load_tokenizer(path)


def test_ranks_file_with_a_gap_is_rejected(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_text("YQ== 0\nYg== 2\n")
    with pytest.raises(ValueError, match="ranks must be 0..1"):
        tokenizer.load_tokenizer(path)


# Preparation


def test_prepare_writes_bos_doc_eos_back_to_back(tmp_path):
    (tmp_path / "a.txt").write_text("ab")
    (tmp_path / "b.py").write_text("x = 1\n")
    out = prepare.prepare([tmp_path / "a.txt", tmp_path / "b.py"], tmp_path / "ds", workers=1)
    ds = data.TokenDataset(out)
    expected = [256, *b"ab", 257, 256, *b"x = 1\n", 257]
    assert ds.tokens.tolist() == expected
    assert ds.loss_mask.tolist() == [0 if t == 256 else 1 for t in expected]
    assert ds.meta["n_documents"] == 2 and ds.meta["n_tokens"] == len(expected)
    assert ds.meta["tokenizer"] == "bytes" and ds.meta["vocab_size"] == 258
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds")], "temp dir left over"


def test_labels_skip_bos_and_positions_restart_at_each_document(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.txt").write_text("de")
    ds = data.TokenDataset(
        prepare.prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "ds")
    )
    # stream: BOS a b c EOS BOS d e EOS (9 tokens) -> one sample of seq_len 8
    batch = next(data.PackedLoader(ds, seq_len=8, micro_batch=1))
    bos, eos, a, b, c, d, e = 256, 257, *b"abcde"
    assert batch.tokens.dtype == torch.int64
    assert batch.tokens[0].tolist() == [bos, a, b, c, eos, bos, d, e]
    assert batch.labels[0].tolist() == [a, b, c, eos, -100, d, e, eos]
    assert batch.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]


def test_positions_restart_where_a_sample_cuts_a_document(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefg")
    ds = data.TokenDataset(prepare.prepare([tmp_path / "a.txt"], tmp_path / "ds"))
    loader = data.PackedLoader(ds, seq_len=4, micro_batch=2, seed=0)
    batch = next(loader)
    assert batch.positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_jsonl_text_and_prompt_response_mask_the_prompt(tmp_path):
    lines = [{"text": "hi"}, {"prompt": "Q?", "response": "A."}]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    ds = data.TokenDataset(prepare.prepare([path], tmp_path / "ds"))
    bos, eos = 256, 257
    assert ds.tokens.tolist() == [bos, *b"hi", eos, bos, *b"Q?", *b"A.", eos]
    assert ds.loss_mask.tolist() == [0, 1, 1, 1, 0, 0, 0, 1, 1, 1]
    batch = next(data.PackedLoader(ds, seq_len=9, micro_batch=1))
    # The labels of the inputs "hi" EOS BOS Q ? A . are: i EOS ignored ignored ignored A . EOS
    assert batch.labels[0].tolist() == [*b"hi", eos, -100, -100, -100, *b"A.", eos]


# Conversations

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": " Hello! "},  # Llama 2 and 3 strip it, bytes keep it
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Ciao"},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def labelled(ds):
    return [int(t) for t, m in zip(ds.tokens, ds.loss_mask, strict=True) if m]


def test_llama3_chat_tokens_are_pinned_and_only_assistant_turns_are_labels(tmp_path):
    ranks = write_ranks_file(tmp_path / "tokenizer.model")  # 263 BPE ranks: byte b is id b
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    ds = data.TokenDataset(prepare.prepare([chat], tmp_path / "ds", tokenizer_path=ranks))
    # <|begin_of_text|>, <|start_header_id|>, <|end_header_id|>, <|eot_id|> of Llama 3
    # (128000, 128006, 128007, 128009 in Meta's tokenizer: 128000 ranks there, 263 here)
    bot, start, end, eot = 263, 263 + 6, 263 + 7, 263 + 9

    def header(role):
        return [start, *role.encode(), end, *b"\n\n"]

    expected = [
        *[bot, *header("system"), *b"Be brief.", eot],
        *[*header("user"), *b"Hi", eot, *header("assistant"), *b"Hello!", eot],
        *[*header("user"), *b"Bye", eot, *header("assistant"), *b"Ciao", eot],
    ]
    assert ds.tokens.tolist() == expected
    assert labelled(ds) == [*b"Hello!", eot, *b"Ciao", eot]
    assert ds.meta["sft"] and ds.is_sft and ds.meta["n_documents"] == 1
    tok = tokenizer.load_tokenizer(ranks)
    assert tok.decode(labelled(ds)) == "Hello!<|eot_id|>Ciao<|eot_id|>"
    batch = next(data.PackedLoader(ds, seq_len=len(expected) - 1, micro_batch=1))
    kept = batch.labels[0][batch.labels[0] != -100].tolist()
    assert kept == [*b"Hello!", eot, *b"Ciao", eot]


def test_special_token_text_in_a_message_stays_text(tmp_path):
    tok = tokenizer.load_tokenizer(write_ranks_file(tmp_path / "tokenizer.model"))
    messages = [{"role": "user", "content": "<|eot_id|>"}, {"role": "assistant", "content": "x"}]
    ids = [i for ids, _ in tok.render_chat(messages) for i in ids]
    assert ids.count(263 + 9) == 2, "only the two real ends of turns are <|eot_id|>"


def test_llama2_chat_format_with_system_prompt(tmp_path):
    sp = write_sentencepiece_model(tmp_path / "tokenizer.model")
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    ds = data.TokenDataset(prepare.prepare([chat], tmp_path / "ds", tokenizer_path=sp))
    tok = tokenizer.load_tokenizer(sp)
    bos, eos = tok.bos_id, tok.eos_id
    first = tok.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]")
    second = tok.encode("[INST] Bye [/INST]")
    hello, ciao = tok.encode("Hello!"), tok.encode("Ciao")
    assert ds.tokens.tolist() == [bos, *first, *hello, eos, *second, *ciao, eos]
    assert labelled(ds) == [*hello, eos, *ciao, eos]
    text = tok.decode(ds.tokens.tolist())
    assert (
        text == "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! [INST] Bye [/INST] Ciao"
    )


@pytest.mark.parametrize("tokenizer", ["bytes", "tiktoken", "sentencepiece"])
def test_built_in_chat_formats_refuse_a_field_they_cannot_render(tmp_path, tokenizer):
    """Not dropped: the model would learn answers without the reasoning that led to them. A
    null one (every message of a table exported as JSONL has every key) renders as nothing."""
    writers = {"tiktoken": write_ranks_file, "sentencepiece": write_sentencepiece_model}
    path = writers[tokenizer](tmp_path / "tokenizer.model") if tokenizer in writers else None
    answer = {"role": "assistant", "content": "4", "reasoning_content": None, "tool_calls": []}
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"messages": [CONVERSATION[1], answer]}])
    prepare.prepare([plain], tmp_path / "ds", tokenizer_path=path)
    answer["reasoning_content"] = "2 + 2 = 4"
    chat = write_jsonl(
        tmp_path / "chat.jsonl", [{"text": "ok"}, {"messages": [CONVERSATION[1], answer]}]
    )
    with pytest.raises(ValueError) as error:
        prepare.prepare([chat], tmp_path / "ds", tokenizer_path=path)
    assert re.fullmatch(
        r"\S*chat.jsonl line 2: messages\[1\].reasoning_content: (the bytes tokenizer's|Llama 3's|"
        r"Llama 2's) chat format renders a message's role and content only; remove the field, or "
        r"give a tokenizer whose chat template renders it",
        str(error.value),
    )


def test_byte_chat_format_ends_turns_with_eos(tmp_path):
    messages = CONVERSATION[1:3]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}, {"text": "ok"}])
    ds = data.TokenDataset(prepare.prepare([chat], tmp_path / "ds"))
    bos, eos = 256, 257
    conversation = [bos, *b"<|user|>\nHi", eos, *b"<|assistant|>\n Hello! ", eos]
    assert ds.tokens.tolist() == [*conversation, bos, *b"ok", eos]
    assert labelled(ds) == [*b" Hello! ", eos, *b"ok", eos]
    assert ds.is_sft


def test_text_data_is_not_sft_and_prompt_response_is(tmp_path):
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "hello"}])
    assert not data.TokenDataset(prepare.prepare([text], tmp_path / "a")).is_sft
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Q", "response": "A"}])
    assert data.TokenDataset(prepare.prepare([pairs], tmp_path / "b")).is_sft
    assert not write_dataset(tmp_path / "old", [256, 1, 257]).is_sft, "no field: text"


def exchange(i, length):
    return [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * length}]


def test_long_conversation_is_split_between_exchanges_with_the_system_prompt(tmp_path, capsys):
    system = {"role": "system", "content": "S"}
    # bytes: BOS "<|system|>\nS" EOS is 14 tokens; an exchange with an answer of n: 27 + n
    long = [system, *exchange(1, 6), *exchange(2, 6), *exchange(3, 6), *exchange(4, 200)]
    short = [system, *exchange(5, 6)]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": long}, {"messages": short}])
    seq_len = 14 + 2 * 33  # two short exchanges fit, a third does not
    argv = ["prepare", "--input", str(chat), "--output", str(tmp_path / "ds")]
    data.main([*argv, "--seq-len", str(seq_len)])
    ds = data.TokenDataset(tmp_path / "ds")
    texts = BYTES.decode(ds.tokens.tolist()).split("<|system|>\nS")
    assert texts[1:] == [
        "<|user|>\nq1<|assistant|>\naaaaaa<|user|>\nq2<|assistant|>\naaaaaa",
        "<|user|>\nq3<|assistant|>\naaaaaa",
        "<|user|>\nq4<|assistant|>\n" + "a" * 200,
        "<|user|>\nq5<|assistant|>\naaaaaa",
    ]
    assert ds.tokens.tolist().count(256) == 4 and ds.meta["n_documents"] == 4
    assert ds.meta["n_conversations_split"] == 1 and ds.meta["n_documents_from_splits"] == 3
    assert ds.meta["n_documents_longer_than_seq_len"] == 1
    out = capsys.readouterr().out
    assert f"1 conversations longer than --seq-len {seq_len} tokens were split" in out
    assert "into 3 documents" in out and "1 documents are still longer than 80" in out
    data.main(argv)
    out = capsys.readouterr().out
    assert "2 documents" in out and "not split" in out


@pytest.mark.parametrize(
    "messages, error",
    [
        ([], '"messages" must be a non-empty list'),
        ("hi", '"messages" must be a non-empty list'),
        ([{"role": "bot", "content": "x"}], r"messages\[0\]\.role is 'bot', expected one of"),
        ([{"role": "user"}], r"messages\[0\]\.content is missing, expected a string"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content is of type int"),
        ([{"role": "user", "content": "x"}], "messages has no assistant turn"),
        ([{"role": "assistant", "content": "x"}], r"messages\[0\]\.role .* expected 'user'"),
        (
            [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}],
            r"messages\[1\]\.role is 'system', expected 'assistant'",
        ),
        (
            [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}],
            r"messages\[1\]\.role is 'user', expected 'assistant'",
        ),
        (["x"], r"messages\[0\] must be an object"),
    ],
)
def test_bad_conversation_names_file_line_and_field(tmp_path, messages, error):
    good = {"messages": CONVERSATION}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, {"messages": messages}])
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: " + error):
        prepare.prepare([path], tmp_path / "ds")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"], "nothing left behind"


# Records in the shapes of hub datasets: ShareGPT, Alpaca; parquet and csv files

SHAREGPT = {  # CONVERSATION as ShareGPT writes it, with both of its spellings of the roles
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": " Hello! "},
        {"from": "user", "value": "Bye"},
        {"from": "assistant", "value": "Ciao"},
    ]
}
ALPACA = [
    {"instruction": "Add", "input": "1+1", "output": "2", "system": "Be brief."},
    {"instruction": "Hi", "output": "Hello", "input": ""},
]
ALPACA_MESSAGES = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add\n\n1+1"},
        {"role": "assistant", "content": "2"},
    ],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
]


def same_dataset(a, b):
    a, b = data.TokenDataset(a), data.TokenDataset(b)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.loss_mask.tolist() == b.loss_mask.tolist()


@pytest.mark.parametrize("kind", ["bytes", "tiktoken"])
def test_sharegpt_and_alpaca_records_are_the_same_conversations_as_messages(tmp_path, kind, capsys):
    ranks = write_ranks_file(tmp_path / "tokenizer.model") if kind == "tiktoken" else None
    shaped = write_jsonl(tmp_path / "shaped.jsonl", [SHAREGPT, *ALPACA])
    as_messages = [{"messages": m} for m in [CONVERSATION, *ALPACA_MESSAGES]]
    messages = write_jsonl(tmp_path / "messages.jsonl", as_messages)
    argv = ["prepare", "--input", str(shaped), "--output", str(tmp_path / "shaped"), "--workers"]
    data.main([*argv, "1", *(["--tokenizer", str(ranks)] if ranks else [])])
    same_dataset(tmp_path / "shaped", prepare.prepare([messages], tmp_path / "ds", ranks, 1))
    meta = data.TokenDataset(tmp_path / "shaped").meta
    assert meta["records_by_shape"] == {"ShareGPT": 1, "Alpaca": 2} and meta["sft"]
    out = capsys.readouterr().out  # the mapping said once, with what it maps
    assert out.count("1 ShareGPT record mapped to messages: ") == 1 and "gpt or assistant" in out
    assert out.count("2 Alpaca records mapped to messages: ") == 1 and "output -> assistant" in out
    data.main(["prepare", "--input", str(messages), "--output", str(tmp_path / "plain")])
    assert "mapped" not in capsys.readouterr().out


def test_a_text_beside_alpaca_or_prompt_response_fields_is_not_read(tmp_path):
    """tatsu-lab/alpaca's rows hold a "text" (the whole prompt formatted) beside instruction,
    input and output: read as Alpaca, only the output trained, as a prompt/response's response."""
    text = "Below is an instruction. ### Instruction: Hi ### Response: Hello"
    records = [{**ALPACA[1], "text": text}, {"prompt": "Q?", "response": "A.", "text": text}]
    both = prepare.prepare([write_jsonl(tmp_path / "both.jsonl", records)], tmp_path / "both")
    alone = [{"messages": ALPACA_MESSAGES[1]}, {"prompt": "Q?", "response": "A."}]
    same_dataset(both, prepare.prepare([write_jsonl(tmp_path / "a.jsonl", alone)], tmp_path / "a"))
    meta = data.TokenDataset(both).meta
    assert meta["records_by_shape"] == {"Alpaca": 1, "prompt/response": 1} and meta["sft"]


def test_trl_prompt_completion_records_train_the_completion_only(tmp_path):
    """TRL's shapes: strings as prompt/response; lists of messages one conversation, its prompt's
    answers not trained on (TRL's completion_only_loss), pieces left with none dropped."""
    pairs = [{"prompt": "Q?", "completion": "A."}]
    same_dataset(
        prepare.prepare([write_jsonl(tmp_path / "c.jsonl", pairs)], tmp_path / "c"),
        prepare.prepare([write_jsonl(tmp_path / "r.jsonl", [{"prompt": "Q?", "response": "A."}])],
                        tmp_path / "r"),
    )  # fmt: skip
    record = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    chat = write_jsonl(tmp_path / "chat.jsonl", [record])
    ds = data.TokenDataset(prepare.prepare([chat], tmp_path / "ds"))
    whole = data.TokenDataset(prepare.prepare([write_jsonl(
        tmp_path / "m.jsonl", [{"messages": CONVERSATION}])], tmp_path / "m"))  # fmt: skip
    assert ds.tokens.tolist() == whole.tokens.tolist()
    assert labelled(ds) == [*b"Ciao", 257] and labelled(whole) == [*b" Hello! ", 257, *b"Ciao", 257]
    assert ds.meta["records_by_shape"] == {"conversational prompt/completion": 1}
    # Split one exchange a piece: the piece of the prompt's answer alone trains nothing.
    long = {"prompt": [*exchange(1, 6), *exchange(2, 6), *exchange(3, 6)[:1]],
            "completion": exchange(3, 6)[1:]}  # fmt: skip
    split = prepare.prepare([write_jsonl(tmp_path / "l.jsonl", [long])], tmp_path / "l", seq_len=40)
    assert BYTES.decode(data.TokenDataset(split).tokens.tolist()).count("<|user|>") == 1


def test_a_json_array_file_is_read_as_its_records(tmp_path):
    """alpaca_data.json as tatsu-lab ships it: one JSON array, read whole as datasets reads it."""
    records = [*ALPACA, {"text": "a\ud800b"}]
    (tmp_path / "alpaca.json").write_text(json.dumps(records, indent=4))
    from_json = prepare.prepare([tmp_path / "alpaca.json"], tmp_path / "json")
    same_dataset(
        from_json, prepare.prepare([write_jsonl(tmp_path / "a.jsonl", records)], tmp_path / "l")
    )
    (tmp_path / "bad.json").write_text(json.dumps([ALPACA[0], {"body": "x"}]))
    with pytest.raises(ValueError, match=r"bad.json record 2: expected a record .* \['body'\]"):
        prepare.prepare([tmp_path / "bad.json"], tmp_path / "bad")


@pytest.mark.parametrize(
    "record, error",
    [
        ({"conversations": []}, r'"conversations" must be a non-empty list of \{"from"'),
        ({"conversations": [{"from": "bot", "value": "x"}]}, r"conversations\[0\] must be .*"),
        ({"conversations": [{"from": "human"}]}, r'conversations\[0\] .* a string "value"'),
        (
            {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]},
            r"conversations\[1\]\.role is 'user', expected 'assistant'",
        ),
        ({"instruction": "x", "output": 3}, "expected a record .*Alpaca"),
        ({"instruction": "x"}, "expected a record .*Alpaca"),
        ({"question": "q", "answer": "a"}, r"expected a record .*; its keys are \['answer', 'q"),
        ({"prompt": "q", "completion": None}, r"expected .*; its keys are \['prompt'\]$"),
        (["q", "a"], r"expected a record .*; got \['q', 'a'\]$"),
        (
            {"prompt": CONVERSATION[1:3], "completion": []},
            "completion has no assistant turn, so nothing to train on",
        ),
        (
            {"prompt": CONVERSATION[1:2], "completion": CONVERSATION[3:4]},
            r"prompt \+ completion\[1\]\.role is 'user', expected 'assistant'",
        ),
    ],
)
def test_bad_sharegpt_or_alpaca_record_names_file_line_and_shapes(tmp_path, record, error):
    path = write_jsonl(tmp_path / "bad.jsonl", [SHAREGPT, record])
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: " + error):
        prepare.prepare([path], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_parquet_rows_are_read_as_jsonl_records_in_batches(tmp_path, monkeypatch):
    import pyarrow
    import pyarrow.parquet

    records = [
        {"text": "hi"},
        {"prompt": "Q?", "response": "A."},
        {"messages": CONVERSATION},
        SHAREGPT,
        *ALPACA,
    ]
    jsonl = write_jsonl(tmp_path / "records.jsonl", records)
    # Every column in every row, null where absent (from_pylist would take the first's keys only)
    table = pyarrow.Table.from_struct_array(pyarrow.array(records))
    pyarrow.parquet.write_table(table, tmp_path / "records.parquet", row_group_size=2)
    batches = []
    real = pyarrow.parquet.ParquetFile.iter_batches
    monkeypatch.setattr(prepare, "PARQUET_BATCH_ROWS", 2)
    monkeypatch.setattr(  # a batch of rows at a time, not the whole file
        pyarrow.parquet.ParquetFile,
        "iter_batches",
        lambda self, **kw: (batches.append(b.num_rows) or b for b in real(self, **kw)),
    )
    parquet = prepare.prepare([tmp_path / "records.parquet"], tmp_path / "parquet", workers=1)
    same_dataset(parquet, prepare.prepare([jsonl], tmp_path / "jsonl", workers=1))
    assert batches == [2, 2, 2]
    table = pyarrow.Table.from_pylist([{"text": "ok"}, {"text": "ok"}, {"body": "x"}])
    pyarrow.parquet.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet row 3: expected a record .* \"text\""):
        prepare.prepare([tmp_path / "bad.parquet"], tmp_path / "bad")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"input .*junk.parquet: not a parquet file pyarrow"):
        prepare.prepare([tmp_path / "junk.parquet"], tmp_path / "bad")


def test_parquet_without_pyarrow_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "a.txt").write_text("read after the check")
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"t.parquet: parquet is read with pyarrow: pip install"):
        prepare.prepare([tmp_path / "a.txt", tmp_path / "t.parquet"], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_csv_is_refused_without_a_text_column_and_read_with_one(tmp_path):
    rows = 'id,body\n1,"a, quoted\nline"\n2,' + "x" * 200_000 + "\n"  # past csv's field limit
    (tmp_path / "t.csv").write_text(rows)
    with pytest.raises(ValueError, match=r"t.csv: a .csv file is read only with --text-column"):
        prepare.prepare([tmp_path / "t.csv"], tmp_path / "ds")
    with pytest.raises(ValueError, match=r"t.csv: no column 'text' .* \['id', 'body'\]"):
        prepare.prepare([tmp_path / "t.csv"], tmp_path / "ds", text_column="text")
    from_csv = prepare.prepare([tmp_path / "t.csv"], tmp_path / "csv", text_column="body")
    # --text-column names a JSONL record's text key too
    jsonl = write_jsonl(
        tmp_path / "t.jsonl", [{"body": "a, quoted\nline"}, {"body": "x" * 200_000}]
    )
    same_dataset(from_csv, prepare.prepare([jsonl], tmp_path / "jsonl", text_column="body"))
    (tmp_path / "bad.csv").write_bytes(b"body\nok\n\xff\n")
    with pytest.raises(ValueError, match=r"bad.csv: not UTF-8"):
        prepare.prepare([tmp_path / "bad.csv"], tmp_path / "ds", text_column="body")


def test_show_marks_exactly_the_trained_tokens_and_writes_nothing(tmp_path, capsys):
    records = [SHAREGPT, {"prompt": "Q?", "response": "A."}, {"text": "not shown"}]
    chat = write_jsonl(tmp_path / "chat.jsonl", records)
    data.main(["prepare", "--input", str(chat), "--show", "2"])
    assert [p.name for p in tmp_path.iterdir()] == ["chat.jsonl"]
    conversation = (
        "<bos><|system|>\nBe brief.<eos><|user|>\nHi<eos><|assistant|>\n⟦ Hello! <eos>⟧"
        "<|user|>\nBye<eos><|assistant|>\n⟦Ciao<eos>⟧"
    )
    assert capsys.readouterr().out == (
        "trained tokens are between ⟦ and ⟧\n"
        f"--- {chat} line 1: 89 tokens, 14 trained\n{conversation}\n"
        f"--- {chat} line 2: 6 tokens, 3 trained\n<bos>Q?⟦A.<eos>⟧\n"
        f"1 ShareGPT record mapped to messages: {prepare.MAPPINGS['ShareGPT']}\n"
    )
    ds = data.TokenDataset(prepare.prepare([chat], tmp_path / "ds"))
    assert int(ds.loss_mask[:89].sum()) == 14 and int(ds.loss_mask[89:95].sum()) == 3
    colored = prepare.show([chat], 1, color=True)
    assert "⟦" not in colored and "\x1b[32mCiao<eos>\x1b[0m" in colored


def test_show_names_a_tokenizers_special_tokens_in_the_trained_spans(tmp_path):
    ranks = write_ranks_file(tmp_path / "tokenizer.model")
    chat = write_jsonl(tmp_path / "chat.jsonl", [SHAREGPT, {"prompt": "Q?", "response": "A."}])
    shown = prepare.show([chat], 2, ranks)
    spans = ["Hello!<|eot_id|>", "Ciao<|eot_id|>", "A.<|end_of_text|>"]
    assert re.findall("⟦(.*?)⟧", shown.split("\n", 1)[1], re.DOTALL) == spans


def test_jsonl_line_without_text_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"prompt": "no response"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2.*prompt"):
        prepare.prepare([path], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_jsonl_line_nested_too_deep_names_file_and_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "ok"}\n' + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(ValueError, match=r"deep.jsonl line 2: JSON nested too deep to read"):
        prepare.prepare([path], tmp_path / "ds")


def test_missing_input_and_empty_input_are_errors(tmp_path):
    with pytest.raises(ValueError, match="missing.txt"):
        prepare.prepare([tmp_path / "missing.txt"], tmp_path / "ds")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="no documents"):
        prepare.prepare([tmp_path / "empty.txt"], tmp_path / "ds")


def test_a_directory_of_record_files_reads_those_alone_and_names_the_rest(tmp_path, capsys):
    """A hub dataset as downloaded: its card and dataset_infos.json are no documents. A
    directory of text files (a .json among them) reads them all, as text."""
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    write_jsonl(hub / "data" / "train.jsonl", [SHAREGPT])
    (hub / "README.md").write_text("---\nlicense: mit\n---\n# A card")
    (hub / "dataset_infos.json").write_text('{"default": {}}')
    (hub / ".gitattributes").write_text("*.jsonl filter=lfs")
    data.main(["prepare", "--input", str(hub), "--output", str(tmp_path / "ds")])
    same_dataset(tmp_path / "ds", prepare.prepare([hub / "data"], tmp_path / "alone"))
    names = f"{hub / 'README.md'}, {hub / 'dataset_infos.json'}"
    out = capsys.readouterr().out
    assert "2 files of hub metadata beside the record files not read: " in out
    assert out.count(names) == 1 and ".gitattributes" not in out
    assert prepare.show([hub], 1).endswith(names)
    (hub / "data" / "train.jsonl").unlink()
    texts = data.TokenDataset(prepare.prepare([hub], tmp_path / "texts"))
    assert texts.meta["n_documents"] == 2 and texts.meta["inputs_passed_over"] == {}


def test_a_hub_folder_of_a_json_array_reads_its_records(tmp_path):
    """yahma/alpaca-cleaned as downloaded (its card, one .json array) reads as the file named
    alone."""
    hub = tmp_path / "alpaca-cleaned"
    hub.mkdir()
    (hub / "alpaca_data_cleaned.json").write_text(json.dumps(ALPACA))
    (hub / "README.md").write_text("---\nlicense: cc-by-4.0\n---\n# A card")
    (hub / "LICENSE").write_text("CC BY 4.0")
    ds = data.TokenDataset(prepare.prepare([hub], tmp_path / "hub"))
    same_dataset(ds.path, prepare.prepare([hub / "alpaca_data_cleaned.json"], tmp_path / "alone"))
    passed_over = [str(hub / "LICENSE"), str(hub / "README.md")]
    kept = {"hub metadata": {"n": 2, "first": passed_over}}
    assert ds.meta["sft"] and ds.meta["inputs_passed_over"] == kept
    (hub / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # a card's picture is metadata too
    ds = data.TokenDataset(prepare.prepare([hub], tmp_path / "with_logo"))
    assert ds.meta["inputs_passed_over"]["hub metadata"]["first"][-1] == str(hub / "logo.png")


def test_a_docs_tree_with_a_json_array_reads_every_file_as_text(tmp_path):
    """Pages beside a sidebar.json array are no hub card and its data: all texts, as before."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "intro.md").write_text("# Intro")
    (docs / "sidebar.json").write_text('[{"label": "Intro", "id": "intro"}]')
    ds = data.TokenDataset(prepare.prepare([docs], tmp_path / "docs_ds"))
    assert ds.meta["n_documents"] == 2 and ds.meta["inputs_passed_over"] == {}


def test_a_code_tree_with_fixture_records_reads_every_file(tmp_path):
    """A fixture .jsonl among code: read as records, the rest as texts (the .json files too,
    an array of records as well: a tree's fixture may be of no record shape), none passed over."""
    tree = tmp_path / "tree"
    (tree / "tests" / "fixtures").mkdir(parents=True)
    for name in ("a.py", "b.py", "README.md"):
        (tree / name).write_text(f"# {name}")
    (tree / "package.json").write_text('{"name": "tree"}')
    write_jsonl(tree / "tests" / "fixtures" / "sample.jsonl", [{"text": "one"}])
    (tree / "tests" / "fixtures" / "more.json").write_text('[{"text": "two"}, {"text": "3"}]')
    ds = data.TokenDataset(prepare.prepare([tree], tmp_path / "tree_ds"))
    assert ds.meta["n_documents"] == 6 and ds.meta["inputs_passed_over"] == {}
    texts = BYTES.decode([t for t in ds.tokens.tolist() if t < 256])
    assert texts == '# README.md# a.py# b.py{"name": "tree"}[{"text": "two"}, {"text": "3"}]one'


def test_inputs_that_would_train_on_file_syntax_are_refused(tmp_path):
    """A .json file named alone that is no JSON array, a prepared dataset and a binary file
    are not read as text; an upper-case .JSONL is read as JSON lines."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "d.json").write_text('{"text": "hello"}\n{"text": "world"}\n')
    with pytest.raises(ValueError, match=r"d.json: not a JSON array .* rename it .jsonl if it"):
        prepare.prepare([folder / "d.json"], tmp_path / "ds")
    (folder / "d.json").write_text('{"text": "hello"}')
    with pytest.raises(ValueError, match=r"d.json: a .json file is read as a JSON array of rec"):
        prepare.prepare([folder / "d.json"], tmp_path / "ds")
    (folder / "d.json").unlink()  # in a directory, a text as any other (a code tree's)
    (folder / "d.txt").write_bytes(b"text\0more")
    with pytest.raises(ValueError, match=r"d.txt holds NUL bytes \(at offset 4\)"):
        prepare.prepare([folder], tmp_path / "ds")
    with pytest.raises(ValueError, match=r"no files in the inputs \['.*empty'\]"):
        (tmp_path / "empty").mkdir()
        prepare.prepare([tmp_path / "empty"], tmp_path / "ds")
    upper = write_jsonl(tmp_path / "upper.JSONL", [{"text": "plain words"}])
    prepared = prepare.prepare([upper], tmp_path / "ds")
    assert (
        tokenizer.ByteTokenizer().decode(data.TokenDataset(prepared).tokens[1:-1]) == "plain words"
    )
    with pytest.raises(ValueError, match=r"input .*ds is a prepared dataset"):
        prepare.prepare([prepared], tmp_path / "ds2")
    assert not (tmp_path / "ds2").exists()


def test_lone_surrogates_in_json_lines_become_the_replacement_character(tmp_path):
    """JSON may escape a lone surrogate, which no tokenizer encodes: U+FFFD for every one."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "a\\ud800b"}\n{"text": "a\\ud83d\\ude00b"}\n')
    ds = data.TokenDataset(prepare.prepare([path], tmp_path / "ds", workers=1))
    assert BYTES.decode(ds.tokens.tolist()) == "a\ufffdb" + "a\U0001f600b"


def test_tiktoken_file_without_every_single_byte_is_refused(tmp_path):
    ranks = tmp_path / "few.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {i}\n" for i, b in
                             enumerate(b"abc ")))  # fmt: skip
    with pytest.raises(ValueError, match=r"no rank for 252 of the 256 single bytes"):
        tokenizer.load_tokenizer(ranks)


def test_output_is_identical_with_one_and_two_workers(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(24):  # ~2.4 MB: several chunks of about 1 MB for the pool
        (corpus / f"{i:02d}.txt").write_text("\n".join(sentences(1200, seed=i)))
    conversation = [*exchange(1, 40), *exchange(2, 40)]  # split at seq_len 64 into two
    sft = write_jsonl(
        tmp_path / "sft.jsonl",
        [{"prompt": "the", "response": "thing"}, {"messages": conversation}],
    )
    ranks = write_ranks_file(tmp_path / "tokenizer.model")
    one = prepare.prepare([corpus, sft], tmp_path / "one", ranks, workers=1, seq_len=64)
    two = prepare.prepare([corpus, sft], tmp_path / "two", ranks, workers=2, seq_len=64)
    for name in ("tokens.bin", "loss_mask.bin", "meta.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert json.loads((one / "meta.json").read_text())["n_documents"] == 27


def test_prepare_replaces_an_existing_dataset(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    prepare.prepare([tmp_path / "a.txt"], tmp_path / "ds")
    (tmp_path / "a.txt").write_text("second!")
    ds = data.TokenDataset(prepare.prepare([tmp_path / "a.txt"], tmp_path / "ds"))
    assert BYTES.decode(ds.tokens.tolist()) == "second!"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "ds"]


def test_prepare_never_deletes_what_it_did_not_write(tmp_path, capsys):
    """The output directory holding the input (or any file of the user's) is refused from the
    command line with one line, and every file stays; an earlier dataset is replaced."""
    mydata = tmp_path / "mydata"
    mydata.mkdir()
    (mydata / "corpus.jsonl").write_text('{"text": "hello"}\n')
    argv = ["prepare", "--input", str(mydata / "corpus.jsonl"), "--output", str(mydata)]
    with pytest.raises(SystemExit) as exit:
        data.main(argv)
    assert exit.value.code != 0
    assert "inside the output directory" in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(ValueError, match="mydata holds corpus.jsonl, which no dataset writes"):
        prepare.prepare([tmp_path / "a.txt"], mydata)
    prepare.prepare([tmp_path / "a.txt"], tmp_path / "ds")
    (tmp_path / "ds" / "notes.txt").write_text("the user's")  # a dataset with a file added
    with pytest.raises(ValueError, match="ds holds notes.txt"):
        prepare.prepare([tmp_path / "a.txt"], tmp_path / "ds")
    assert (mydata / "corpus.jsonl").read_text() == '{"text": "hello"}\n'
    assert (tmp_path / "ds" / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "ds", "mydata"]


def test_replacing_a_dataset_keeps_a_link_to_it_and_survives_leftovers(tmp_path, monkeypatch):
    """A link to a dataset stays a link (the dataset it points to is replaced), "." is a
    directory like any other, a leftover of an interrupted replacement is not in the way, and
    a replacement that fails leaves the earlier dataset where it was."""
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    target = prepare.prepare([tmp_path / "a.txt"], tmp_path / "target")
    (tmp_path / "link").symlink_to(target)
    (tmp_path / ".link.old").mkdir()  # left by an earlier version's interrupted replacement
    (tmp_path / ".link.old" / "x").write_text("")
    prepare.prepare([tmp_path / "b.txt"], tmp_path / "link")
    assert (tmp_path / "link").is_symlink()
    assert BYTES.decode(data.TokenDataset(target).tokens.tolist()) == "second"
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    prepare.prepare([tmp_path / "a.txt"], ".")
    assert BYTES.decode(data.TokenDataset(here).tokens.tolist()) == "first"
    real_replace = os.replace

    def interrupted(src, dst):
        if ".tmp-" in str(src):  # the new dataset's move into place
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare([tmp_path / "a.txt"], target)
    assert BYTES.decode(data.TokenDataset(target).tokens.tolist()) == "second"
    hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".target")]
    assert hidden == [], hidden


def test_a_killed_prepares_directory_is_told_and_kept(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    left = tmp_path / ".d[s].tmp-k1lled_8"  # what SIGKILL leaves; [s]: no glob pattern
    left.mkdir()
    (tmp_path / ".d[s].old-12345678").mkdir()
    (tmp_path / ".d[s].tmp-2.tmp-abcd1234").mkdir()  # an output named "d[s].tmp-2"'s
    (tmp_path / ".other.tmp-12345678").mkdir()
    prepare.prepare([tmp_path / "a.txt"], tmp_path / "d[s]")
    err = capsys.readouterr().err
    left = f"{tmp_path / '.d[s].old-12345678'}, {left}"
    assert f"note: {left}: unfinished dataset directories (their writer was killed" in err
    assert ".other" not in err and "tmp-2" not in err and (tmp_path / ".d[s].tmp-k1lled_8").is_dir()
    prepare.prepare([tmp_path / "a.txt"], tmp_path / "fresh")
    assert "note:" not in capsys.readouterr().err


def test_command_line_prepare(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    before = signal.getsignal(signal.SIGTERM)
    data.main(["prepare", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "ds")])
    out = capsys.readouterr().out
    assert "1 document, 7 tokens" in out and "SFT" not in out and "conversations" not in out
    assert signal.getsignal(signal.SIGTERM) == before


def test_summary_of_mixed_data_names_the_documents_trained_whole(tmp_path, capsys):
    records = [{"text": "a"}, {"text": "b"}, {"messages": CONVERSATION}]
    mixed = write_jsonl(tmp_path / "mixed.jsonl", records)
    data.main(["prepare", "--input", str(mixed), "--output", str(tmp_path / "ds")])
    out = capsys.readouterr().out
    assert (
        "SFT data: loss only on responses and assistant turns; 2 documents with no prompt (text) "
        "trained on whole\nconversations were not split"
    ) in out
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Q", "response": "A"}])
    data.main(["prepare", "--input", str(pairs), "--output", str(tmp_path / "ds")])
    out = capsys.readouterr().out
    assert out.rstrip().endswith("assistant turns") and "conversations" not in out


def test_command_line_takes_no_abbreviations(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(SystemExit) as exit_info:  # --out is no --output
        data.main(["prepare", "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "b")])
    assert exit_info.value.code == 2 and not (tmp_path / "b").exists()


def test_prepare_stopped_by_sigterm_leaves_nothing_and_says_so(tmp_path):
    """SIGTERM (or Ctrl-C) mid-way: one line, exit 130, no half-written directory beside it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(400):
        (corpus / f"{i}.txt").write_text("words " * 20_000)
    out = tmp_path / "ds"
    cmd = [sys.executable, str(Path(data.__file__)), "prepare", "--workers", "1"]
    proc = subprocess.Popen(
        [*cmd, "--input", str(corpus), "--output", str(out)], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    # Once the dataset's first bytes are written: the stop lands mid-way through the inputs.
    while not any(p.stat().st_size for p in tmp_path.glob(".ds.tmp-*/tokens.bin")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == f"data.py: stopped; {out} is as it was", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_a_pool_worker_ends_on_sigterm_whatever_it_was_forked_with(monkeypatch):
    """Pool.terminate ends the workers by SIGTERM: one forked from `main`, where SIGTERM raises
    KeyboardInterrupt, would not end, and terminate would wait for it for ever."""
    monkeypatch.setattr(prepare, "_worker_tokenizer", None)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        prepare._init_worker((None, None))
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # the parent stops them
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_default_corpus_is_prepared_once_and_reused(tmp_path):
    path = prepare.default_corpus(tmp_path, max_bytes=200_000)
    ds = data.TokenDataset(path)
    assert (
        ds.meta["tokenizer"] == "bytes" and 0 < ds.n_tokens <= 200_000 + 2 * ds.meta["n_documents"]
    )
    mtime = (path / "tokens.bin").stat().st_mtime_ns
    assert prepare.default_corpus(tmp_path, max_bytes=200_000) == path
    assert (path / "tokens.bin").stat().st_mtime_ns == mtime
    ds.check(
        vocab_size=258,
        seq_len=128,
    )


# Loader order


def test_same_seed_gives_same_batches_and_another_seed_differs(tmp_path):
    ds = arange_dataset(tmp_path)
    a = first_tokens(read_steps(data.PackedLoader(ds, 10, 4, seed=1), 5))
    b = first_tokens(read_steps(data.PackedLoader(ds, 10, 4, seed=1), 5))
    c = first_tokens(read_steps(data.PackedLoader(ds, 10, 4, seed=2), 5))
    assert a == b and a != c


def test_sample_rows_are_contiguous_windows_with_shifted_labels(tmp_path):
    ds = arange_dataset(tmp_path)
    batch = next(data.PackedLoader(ds, seq_len=10, micro_batch=3, seed=0))
    for tokens, labels in zip(batch.tokens.tolist(), batch.labels.tolist(), strict=True):
        assert tokens[0] % 10 == 0
        assert tokens == list(range(tokens[0], tokens[0] + 10))
        assert labels == [t + 1 for t in tokens]


def test_each_epoch_reads_every_sample_once_in_a_new_order(tmp_path):
    ds = arange_dataset(tmp_path)  # 1001 tokens, seq_len 10 -> 100 samples
    loader = data.PackedLoader(ds, seq_len=10, micro_batch=4, seed=0)
    seen = first_tokens(read_steps(loader, 50))  # 200 samples: exactly two epochs
    assert sorted(seen[:100]) == sorted(seen[100:]) == list(range(0, 1000, 10))
    assert seen[:100] != seen[100:]
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["cursor"] == 0


def test_ranks_read_disjoint_samples(tmp_path):
    ds = arange_dataset(tmp_path)
    ranks = [data.PackedLoader(ds, 10, 5, rank=r, world_size=2, seed=3) for r in range(2)]
    seen = [first_tokens(read_steps(loader, 10)) for loader in ranks]  # one epoch in all
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(0, 1000, 10))


def test_two_ranks_together_read_what_one_rank_with_twice_the_batch_reads(tmp_path):
    ds = arange_dataset(tmp_path)
    ranks = [data.PackedLoader(ds, 10, 3, rank=r, world_size=2, seed=5) for r in range(2)]
    single = data.PackedLoader(ds, 10, 6, seed=5)
    for _ in range(40):  # crosses epoch boundaries mid-step (100 samples, 6 per step)
        together = torch.cat([next(ranks[0]).tokens, next(ranks[1]).tokens])
        assert torch.equal(together, next(single).tokens)


def test_context_parallel_ranks_read_their_halves_of_the_same_rows(tmp_path):
    # Documents (BOS = 0) start at tokens 0, 7, 14, ...: some cross the halves of a row, and
    # some halves hold no start past their first token while their row does.
    tokens = np.arange(1, 1001)
    tokens[::7] = 0
    ds = write_dataset(tmp_path / "docs", tokens, bos_id=0)
    whole = data.PackedLoader(ds, 12, 1, rank=1, world_size=2, seed=4)
    halves = [
        data.PackedLoader(ds, 12, 1, rank=1, world_size=2, seed=4, context_rank=c,
                          context_parallel=2)
        for c in range(2)
    ]  # fmt: skip
    half_alone_differs = 0
    for _ in range(40):
        row, parts = next(whole), [next(loader) for loader in halves]
        for name in ("tokens", "labels", "positions"):
            joined = torch.cat([getattr(part, name) for part in parts], dim=1)
            assert torch.equal(joined, getattr(row, name)), name
        # Of the whole rows, so that the ranks sharing them pick the same attention kernels.
        assert parts[0].document_starts == parts[1].document_starts == row.document_starts
        assert row.document_starts == attention.document_starts(row.positions)
        half_alone_differs += any(
            attention.document_starts(part.positions) != row.document_starts for part in parts
        )
    assert half_alone_differs > 0


def test_labels_ahead_counts_the_next_batches_labels_and_leaves_the_cursor(tmp_path):
    # 103 samples of 9: steps of 2 ranks x 4 micro-batches x 3 rows run across epochs.
    rng = np.random.default_rng(0)
    mask = rng.integers(0, 8, 928, dtype=np.uint8)  # every bit set somewhere, LABEL on half
    ds = write_dataset(tmp_path / "masked", np.arange(928), mask)
    for columns in ({}, {"context_rank": 1, "context_parallel": 3}):
        loader = data.PackedLoader(ds, 9, 3, rank=1, world_size=2, seed=2, **columns)
        for _ in range(12):
            state = loader.state_dict()
            counted = loader.labels_ahead(4)
            assert loader.state_dict() == state
            labels = torch.cat([next(loader).labels for _ in range(4)])
            assert counted == (labels != IGNORE_INDEX).sum().item() > 0
        assert loader.epoch > 0


def test_in_order_gives_each_group_an_equal_contiguous_share_once(tmp_path):
    """100 samples of 10, the first 23 asked, 3 groups of micro-batches of 4: samples 0-6,
    7-13 and 14-20 in stored order (21 and 22, past a multiple of 3, left out), as 4 + 3
    rows; the training order's cursor untouched."""
    ds = arange_dataset(tmp_path)  # token i is i: a row starts at its sample's index x 10
    shares = []
    for rank in range(3):
        loader = data.PackedLoader(ds, 10, 4, rank=rank, world_size=3, seed=1)
        batches = list(loader.in_order(23))
        assert [b.tokens.shape[0] for b in batches] == [4, 3]
        shares.append([row[0] // 10 for b in batches for row in b.tokens.tolist()])
        assert (loader.epoch, loader.cursor) == (0, 0)
        assert first_tokens([next(loader)]) == first_tokens(
            [next(data.PackedLoader(ds, 10, 4, rank=rank, world_size=3, seed=1))]
        )
    assert shares == [list(range(0, 7)), list(range(7, 14)), list(range(14, 21))]
    everything = data.PackedLoader(ds, 10, 8).in_order()
    assert sum(b.tokens.shape[0] for b in everything) == 100


def test_resume_from_state_dict_gives_the_same_next_batches(tmp_path):
    ds = arange_dataset(tmp_path)
    reference = read_steps(data.PackedLoader(ds, 10, 4, seed=7), 40)
    stopped = data.PackedLoader(ds, 10, 4, seed=7)
    read_steps(stopped, 30)
    state = json.loads(json.dumps(stopped.state_dict()))  # as a checkpoint would store it
    resumed = data.PackedLoader(ds, 10, 4, seed=0)
    resumed.load_state_dict(state)
    for expected, got in zip(reference[30:], read_steps(resumed, 10), strict=True):
        for name in ("tokens", "labels", "positions"):
            assert torch.equal(getattr(expected, name), getattr(got, name))


def test_resume_on_another_world_size_continues_the_global_order(tmp_path):
    ds = arange_dataset(tmp_path)
    reference = first_tokens(read_steps(data.PackedLoader(ds, 10, 4, seed=9), 30))
    single = data.PackedLoader(ds, 10, 4, seed=9)
    read_steps(single, 20)
    ranks = [data.PackedLoader(ds, 10, 2, rank=r, world_size=2, seed=9) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(single.state_dict())
    resumed = []
    for _ in range(10):
        resumed += first_tokens([next(ranks[0])]) + first_tokens([next(ranks[1])])
    assert resumed == reference[80:]


def test_resume_with_another_seq_len_is_refused(tmp_path):
    ds = arange_dataset(tmp_path)
    state = data.PackedLoader(ds, 10, 4).state_dict()
    with pytest.raises(ValueError, match="same dataset and seq_len"):
        data.PackedLoader(ds, 20, 4).load_state_dict(state)


# Bad datasets


def test_missing_meta_json_says_how_to_prepare(tmp_path):
    """An empty directory may be prepare's output; one holding files is its input, or a model."""
    with pytest.raises(ValueError, match=r"meta.json.*data.py prepare --input FILES --output /"):
        data.TokenDataset(tmp_path)
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(
        ValueError, match=r"prepare --input \S+ --output NEW_DIR`, then pass NEW_DIR\)$"
    ):
        data.TokenDataset(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"--output DIR`; a checkpoint is --hf-checkpoint's\)$"):
        data.TokenDataset(tmp_path)


def test_a_checkpoints_tokenizer_without_data_is_refused_before_the_default_corpus(
    tmp_path, monkeypatch
):
    """The default corpus is bytes: it is never prepared only to be refused."""
    write_ranks_file((tmp_path / "ckpt").mkdir() or tmp_path / "ckpt" / "tokenizer.model")
    monkeypatch.setattr(data, "default_corpus", lambda *a: pytest.fail("prepared"))
    for tok, checkpoint in [(None, tmp_path / "ckpt"), (tmp_path / "ckpt", None)]:
        with pytest.raises(ValueError, match=r"no --data: the default corpus is byte-tokenized"):
            data.open_data(None, tok and str(tok), checkpoint and str(checkpoint), 300, 8, True)


def test_missing_token_file_is_named(tmp_path):
    arange_dataset(tmp_path)
    (tmp_path / "arange" / "tokens.bin").unlink()
    with pytest.raises(ValueError, match="tokens.bin"):
        data.TokenDataset(tmp_path / "arange")


def test_truncated_token_file_names_both_sizes(tmp_path):
    arange_dataset(tmp_path, n_tokens=1001)
    path = tmp_path / "arange" / "tokens.bin"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"tokens.bin is 1,000 bytes, expected 4,004"):
        data.TokenDataset(tmp_path / "arange")


def test_token_id_beyond_the_vocab_is_named(tmp_path):
    ds = arange_dataset(tmp_path)
    with pytest.raises(ValueError, match=r"token id 1,000 .* vocab_size 500"):
        ds.check(
            vocab_size=500,
            seq_len=10,
        )
    ds.check(
        vocab_size=1001,
        seq_len=10,
    )


def test_too_few_tokens_for_one_sample(tmp_path):
    ds = write_dataset(tmp_path / "small", [256, 1, 2, 257])
    with pytest.raises(ValueError, match=r"4 tokens, one sample of seq_len 8 needs 9"):
        ds.check(
            vocab_size=258,
            seq_len=8,
        )
    with pytest.raises(ValueError, match="needs 9"):
        data.PackedLoader(ds, seq_len=8, micro_batch=1)


def test_empty_dataset(tmp_path):
    ds = write_dataset(tmp_path / "empty", [])
    with pytest.raises(ValueError, match="has 0 tokens"):
        ds.check(
            vocab_size=258,
            seq_len=8,
        )


def test_every_problem_of_a_dataset_is_reported_together(tmp_path):
    ds = arange_dataset(tmp_path)
    with pytest.raises(ValueError, match=r"one sample of seq_len 2048 needs 2,049.*token id 1,000"):
        ds.check(vocab_size=258, seq_len=2048)


def test_all_masked_dataset_is_refused(tmp_path):
    ds = write_dataset(tmp_path / "masked", [256, 1, 2, 3, 257] * 10, mask=[0] * 50)
    with pytest.raises(ValueError, match="loss_mask.bin is all 0: no token is a label"):
        ds.check(
            vocab_size=258,
            seq_len=8,
        )


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda meta: meta.pop("n_tokens"), "meta.json: no field 'n_tokens' (expected type int)"),
        (lambda meta: meta.update(bos_id="256"), "meta.json: bos_id is '256', expected type int"),
    ],
)
def test_meta_json_field_missing_or_mistyped_is_named(tmp_path, edit, message):
    arange_dataset(tmp_path)
    meta_path = tmp_path / "arange" / "meta.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=re.escape(message)):
        data.TokenDataset(tmp_path / "arange")


def test_meta_json_that_is_not_json_is_named(tmp_path):
    arange_dataset(tmp_path)
    (tmp_path / "arange" / "meta.json").write_text('{"format_version": 1,')
    with pytest.raises(ValueError, match="meta.json is not valid JSON"):
        data.TokenDataset(tmp_path / "arange")


def test_json_nested_past_the_readers_depth_is_named(tmp_path):
    """json recurses once per level: a file nested 100k deep is refused in one line, not a
    RecursionError (config.json, the safetensors index and meta.json are all read here)."""
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(files.UsageError, match="deep.json: JSON nested too deep to read"):
        files.read_json(tmp_path / "deep.json")


def test_prepared_dataset_has_ordinary_modes(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    ds = prepare.prepare([tmp_path / "a.txt"], tmp_path / "ds")
    umask = os.umask(0)
    os.umask(umask)
    assert ds.stat().st_mode & 0o777 == 0o777 & ~umask  # mkdtemp alone gives 0700


@pytest.mark.parametrize(
    "case", ["missing input", "bad JSONL line", "record of no shape, shown", "csv without column"]
)
def test_command_line_errors_are_one_line_naming_file_and_line(tmp_path, case):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "ok"}\nnot json\n')
    (tmp_path / "shape.jsonl").write_text('{"text": "ok"}\n{"question": "?"}\n')
    (tmp_path / "t.csv").write_text("body\nok\n")
    given, message, where = {
        "missing input": ("missing.txt", "data.py error: input ", "missing.txt not found"),
        "bad JSONL line": ("bad.jsonl", "data.py error: ", "bad.jsonl line 3:"),
        "record of no shape, shown": ("shape.jsonl", "data.py error: ", "shape.jsonl line 2:"),
        "csv without column": ("t.csv", "data.py error: input ", "read only with --text-column"),
    }[case]
    output = ["--show", "2"] if "shown" in case else ["--output", str(tmp_path / "ds")]
    result = subprocess.run(
        [sys.executable, str(REPO / "data.py"), "prepare", "--input", str(tmp_path / given),
         *output, "--workers", "1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 1
    error_lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(error_lines) == 1 and error_lines[0].startswith(message), result.stderr
    assert where in error_lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "ds").exists()


TEXTS = ["the thing, the lazy fox!\n\n  héllo 🙂 12345", "  leading spaces\tand tabs", "the"]


@pytest.mark.parametrize("kind", ["bytes", "tiktoken"])
def test_hf_tokenizer_files_encode_as_ours_with_bos(tmp_path, kind):
    """The files an export carries load in transformers' AutoTokenizer and give our ids
    (after BOS, as training saw each document); decoding gives the text back."""
    transformers = pytest.importorskip("transformers")
    tok = BYTES
    if kind == "tiktoken":
        tok = tokenizer.load_tokenizer(write_ranks_file(tmp_path / "tokenizer.model"))
    out = tmp_path / "hf"
    out.mkdir()
    for name, contents in tok.hf_files().items():
        (out / name).write_bytes(contents)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert (theirs.bos_token_id, theirs.eos_token_id) == (tok.bos_id, tok.eos_id)
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ids == [tok.bos_id, *tok.encode(text)], text
        assert theirs.decode(ids, skip_special_tokens=True) == text


def test_a_second_output_refuses_a_file_the_first_did_not_write(tmp_path):
    """A user's file added to an export, though named as an export's may be, is never
    replaced: the marker lists what the export wrote."""
    export = files.OutputDir("export", "marker.json", ("*.json",))
    with export.writing(tmp_path / "out") as out:
        (out / "config.json").write_text("{}")
    (tmp_path / "out" / "my_eval_results.json").write_text("the user's")
    with pytest.raises(files.UsageError, match="out holds my_eval_results.json, which no export"):
        export.check(tmp_path / "out")
    assert (tmp_path / "out" / "my_eval_results.json").read_text() == "the user's"


def test_a_json_file_is_never_written_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    (tmp_path / ".tmp-plan.json").symlink_to(victim)
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        files.write_json(tmp_path / "plan.json", {})
    assert victim.read_text() == "the user's"


def test_a_full_disk_is_one_line_and_leaves_no_partial_output(tmp_path):
    """An export's or a dataset's write on a full filesystem: one line naming what could not
    be written, and nothing left of it."""
    export = files.OutputDir("export", "marker.json", ("*.json",))
    with (
        pytest.raises(files.UsageError, match=f"no space left to write the export {tmp_path}/out "),
        export.writing(tmp_path / "out") as out,
    ):
        (out / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")
    with (
        pytest.raises(files.UsageError, match=f"no space left to write the dataset {tmp_path}/ds "),
        prepare.DatasetWriter(tmp_path / "ds") as writer,
    ):
        writer._tokens_file.close()
        writer._tokens_file = open("/dev/full", "wb")  # noqa: SIM115 (closed by the writer)
        writer.add(np.zeros(100_000, np.uint32), np.ones(100_000, np.uint8))
    assert list(tmp_path.iterdir()) == []


def test_a_datasets_identity_is_what_it_holds_not_where_or_how_it_was_prepared(tmp_path):
    """What a resume compares: a moved dataset, or the same inputs prepared again from another
    path (meta.json's chat_template and passed-over files name paths), keeps it."""
    first = write_dataset(tmp_path / "first", [1, 2, 3] * 10)
    again = write_dataset(tmp_path / "again", [1, 2, 3] * 10)
    meta = json.loads((again.path / "meta.json").read_text())
    extra = {
        "chat_template": "/elsewhere/tok",
        "inputs_passed_over": {"hub metadata": ["README.md"]},
        "sft": True,
    }
    (again.path / "meta.json").write_text(json.dumps({**extra, **meta}))
    assert data.TokenDataset(again.path).identity() == first.identity()
    other = write_dataset(tmp_path / "other", [1, 2, 3] * 11)
    assert other.identity() != first.identity()
