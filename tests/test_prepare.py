"""prepare's reading of folders shaped like downloaded hub datasets: their splits, their JSON
Lines .json files and repository files, prepared datasets within them; and --eval-data's check
that something is held out. The rest of prepare's tests are in test_data.py."""

import json
import shutil
from pathlib import Path

import pytest

import data
import prepare


def conversations(split: str, n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"{split} {i}"},
                {"role": "assistant", "content": "a"},
            ]
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def listed(*paths: Path) -> dict:
    """A note's files as meta.json keeps them (prepare._kept_notes): the count and the first."""
    return {"n": len(paths), "first": [str(p) for p in paths[: prepare.NAMED]]}


def hub_folder(folder: Path, names: dict[str, int]) -> Path:
    """A hub dataset as downloaded: its card, and each name of `names` with that many records."""
    for name, n in names.items():
        write_jsonl(folder / name, conversations(Path(name).stem, n))
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# A card")
    return folder


@pytest.mark.parametrize(
    "name, split",
    [
        ("train.jsonl", "train"),
        ("data/train-00000-of-00002.parquet", "train"),
        ("training_set.csv", "train"),
        ("my-test.json", "test"),
        ("data/eval_00001.jsonl", "test"),
        ("evaluation.jsonl", "test"),
        ("dev.jsonl", "validation"),
        ("valid 2.jsonl", "validation"),
        ("data/val/0.parquet", "validation"),
        ("test/train.jsonl", "test"),  # a directory's name before the file's, as datasets
        ("trainer.jsonl", None),
        ("contest.jsonl", None),
        ("devices/data.jsonl", None),
        ("data.jsonl", None),
    ],
)
def test_a_files_split_is_the_word_its_path_names_as_datasets_reads_it(tmp_path, name, split):
    assert prepare._split(tmp_path / name, tmp_path) == split


def test_a_hub_folder_with_splits_reads_its_train_split_and_names_the_others(tmp_path, capsys):
    """test and validation data are no training data: passed over, named, with how to prepare
    one of them; files naming no split are passed over as datasets.load_dataset does."""
    names = {"data/train.jsonl": 4, "data/test.jsonl": 3, "data/validation.jsonl": 2}
    hub = hub_folder(tmp_path / "hub", names)
    data.main(["prepare", "--input", str(hub), "--output", str(tmp_path / "ds"), "--workers", "1"])
    out = capsys.readouterr().out
    ds = data.TokenDataset(tmp_path / "ds")
    assert ds.meta["n_documents"] == 4
    assert ds.meta["inputs_passed_over"] == {
        "hub metadata": listed(hub / "README.md"),
        "test split": listed(hub / "data" / "test.jsonl"),
        "validation split": listed(hub / "data" / "validation.jsonl"),
    }
    assert (
        "the hub dataset's test split not read, only its train split (1 file; prepare it alone, "
        f"--input its files, e.g. for train.py --eval-data): {hub / 'data' / 'test.jsonl'}"
    ) in out
    write_jsonl(hub / "data" / "extra.jsonl", conversations("extra", 1))
    ds = data.TokenDataset(prepare.prepare([hub], tmp_path / "extra", workers=1))
    assert ds.meta["n_documents"] == 4
    assert ds.meta["inputs_passed_over"]["no split"] == listed(hub / "data" / "extra.jsonl")
    (hub / "data" / "train.jsonl").unlink()
    with pytest.raises(
        ValueError,
        match=r"hub: a hub dataset of the test and validation splits and 1 file naming no split, "
        r"no train split: prepare one, --input its files",
    ):
        prepare.prepare([hub], tmp_path / "none", workers=1)


def test_a_hub_folders_train_split_beside_unnamed_files_is_read_alone(tmp_path):
    """Once a file names a split, files naming none are passed over, as datasets does."""
    hub = hub_folder(tmp_path / "hub", {"train.jsonl": 2, "more.jsonl": 3})
    ds = data.TokenDataset(prepare.prepare([hub], tmp_path / "ds", workers=1))
    assert ds.meta["n_documents"] == 2
    assert ds.meta["inputs_passed_over"]["no split"] == listed(hub / "more.jsonl")


def test_a_hub_folder_of_one_split_not_train_reads_that_split(tmp_path):
    """With no train split, a folder whose record files all name one other split stands for
    them (an eval set alone), with a card or without; files naming no split beside them:
    refused, which to read is the user's choice."""
    hub = hub_folder(tmp_path / "hub", {"data/test-00000-of-00001.jsonl": 3})
    ds = data.TokenDataset(prepare.prepare([hub], tmp_path / "ds", workers=1))
    assert ds.meta["n_documents"] == 3
    assert ds.meta["inputs_passed_over"] == {"hub metadata": listed(hub / "README.md")}
    bare = tmp_path / "bare"
    write_jsonl(bare / "test.jsonl", conversations("test", 2))
    assert data.TokenDataset(prepare.prepare([bare], tmp_path / "b")).meta["n_documents"] == 2
    for folder in (hub, bare):
        write_jsonl(folder / "sft.jsonl", conversations("sft", 1))
        with pytest.raises(
            ValueError,
            match=rf"{folder.name}: a hub dataset of the test split and 1 file naming no split, "
            r"no train split: prepare one, --input its files",
        ):
            prepare.prepare([folder], tmp_path / "none", workers=1)


def test_a_hub_folder_of_one_split_and_of_shards_reads_all_of_it(tmp_path):
    """Shards of the train split alone, or files naming no split: every record file."""
    names = {f"data/train-0000{i}-of-00002.jsonl": 2 for i in range(2)}
    ds = data.TokenDataset(prepare.prepare([hub_folder(tmp_path / "hub", names)], tmp_path / "d"))
    assert ds.meta["n_documents"] == 4
    names = {"part1.jsonl": 2, "part2.jsonl": 3}
    ds = data.TokenDataset(prepare.prepare([hub_folder(tmp_path / "two", names)], tmp_path / "e"))
    assert ds.meta["n_documents"] == 5


def test_eval_data_that_is_a_copy_of_the_training_data_is_refused(tmp_path):
    training = data.TokenDataset(
        prepare.prepare([write_jsonl(tmp_path / "a.jsonl", conversations("a", 5))], tmp_path / "a")
    )
    vocab_size = training.meta["vocab_size"]
    shutil.copytree(training.path, tmp_path / "copy")
    with pytest.raises(
        ValueError,
        match=r"copy holds the same tokens as the training data .*a: nothing is held out",
    ):
        data.open_eval_data(str(tmp_path / "copy"), vocab_size, 8, training)
    # As many tokens and documents, other tokens: held out.
    held_out = prepare.prepare(
        [write_jsonl(tmp_path / "b.jsonl", conversations("b", 5))], tmp_path / "b"
    )
    assert data.open_eval_data(str(held_out), vocab_size, 8, training).path == held_out


def test_a_hub_folders_json_lines_json_file_is_read_as_records(tmp_path, capsys):
    """A .json file of JSON Lines is records, as datasets reads it, beside a card and a
    CITATION.cff (hub metadata); in a code tree the same file is a text, and said to be."""
    hub = tmp_path / "hub"
    write_jsonl(hub / "train.json", conversations("train", 3))
    (hub / "README.md").write_text("# A card")
    (hub / "CITATION.cff").write_text("cff-version: 1.2.0")
    ds = data.TokenDataset(prepare.prepare([hub], tmp_path / "ds", workers=1))
    alone = data.TokenDataset(
        prepare.prepare(
            [write_jsonl(tmp_path / "a.jsonl", conversations("train", 3))], tmp_path / "alone"
        )
    )
    assert ds.tokens.tolist() == alone.tokens.tolist() and ds.meta["sft"]
    assert ds.meta["inputs_passed_over"] == {
        "hub metadata": listed(hub / "CITATION.cff", hub / "README.md")
    }
    assert ds.meta["json_read_as_text"] == listed()
    (hub / "main.py").write_text("print('a code tree')")
    data.main(
        ["prepare", "--input", str(hub), "--output", str(tmp_path / "tree"), "--workers", "1"]
    )
    tree = data.TokenDataset(tmp_path / "tree")
    assert tree.meta["n_documents"] == 4 and not tree.meta["sft"]
    assert tree.meta["json_read_as_text"] == listed(hub / "train.json")
    out = capsys.readouterr().out
    assert (
        "1 .json file read as text, as every file of a folder that holds more than records "
        f"and hub metadata: {hub / 'train.json'}" in out
    )


def test_one_json_object_or_a_pretty_printed_one_is_no_json_lines(tmp_path):
    for content in ('{"a": 1}\n', '{\n  "a": 1\n}\n', '{"a": 1}\n[1]\n', "[]"):
        (tmp_path / "x.json").write_text(content)
        assert prepare._kind(tmp_path / "x.json", in_folder=True) == "text"
    (tmp_path / "x.json").write_text('\n{"a": 1}\n\n{"b": [2]}\nnot json\n')
    assert prepare._kind(tmp_path / "x.json", in_folder=True) == ".jsonl"


def test_a_prepared_dataset_inside_an_input_folder_is_passed_over(tmp_path, capsys):
    """Prepared output kept beside the raw data: named, not read; a file named twice (alone
    and in its folder) is read once."""
    hub = hub_folder(tmp_path / "hub", {"train.jsonl": 3})
    first = data.TokenDataset(prepare.prepare([hub], hub / "prepared", workers=1))
    again = data.TokenDataset(prepare.prepare([hub], hub / "prepared", workers=1))
    assert again.tokens.tolist() == first.tokens.tolist()
    assert again.meta["inputs_passed_over"]["prepared dataset"] == listed(hub / "prepared")
    twice = data.TokenDataset(prepare.prepare([hub, hub / "train.jsonl"], tmp_path / "t"))
    assert twice.tokens.tolist() == first.tokens.tolist()
    data.main(["prepare", "--input", str(hub), "--output", str(tmp_path / "o"), "--workers", "1"])
    assert (
        "1 prepared dataset inside the inputs not read (train.py --data takes a prepared "
        f"dataset): {hub / 'prepared'}" in capsys.readouterr().out
    )


def test_a_file_given_twice_is_read_once_the_same_way_and_said_to_be(tmp_path, capsys):
    """However a file is given twice (alone, in its folder, the folder twice, in any order): read
    once, said to be, each passed-over file named once, and none named that is read."""
    hub = hub_folder(tmp_path / "hub", {"data/train.jsonl": 2, "data/test.jsonl": 3})
    alone = write_jsonl(tmp_path / "a.jsonl", conversations("a", 1))
    files, passed_over = prepare._input_files([hub, hub, alone, alone])
    assert [path for path, _ in files] == [hub / "data" / "train.jsonl", alone]
    assert passed_over == {
        "hub metadata": [str(hub / "README.md")],
        "test split": [str(hub / "data" / "test.jsonl")],
        "reached twice": [str(hub / "data" / "train.jsonl"), str(alone)],
    }
    argv = ["prepare", "--input", str(alone), "--input", str(hub), str(alone), "--output"]
    data.main([*argv, str(tmp_path / "ds"), "--workers", "1"])  # --input repeated adds
    assert data.TokenDataset(tmp_path / "ds").meta["n_documents"] == 3
    note = f"1 file reached by more than one path (given twice, or a link) read once: {alone}"
    assert note in capsys.readouterr().out
    files, passed_over = prepare._input_files([hub, hub / "data" / "test.jsonl"])
    assert len(files) == 2 and passed_over == {"hub metadata": [str(hub / "README.md")]}
    # A JSON Lines .json: records in its folder, refused alone (not an array); the folder's
    # reading wins, in either order.
    write_jsonl(hub / "data" / "train.json", conversations("json", 2))
    json_lines = hub / "data" / "train.json"
    for inputs in ([hub, json_lines], [json_lines, hub]):
        files, _ = prepare._input_files(inputs)
        assert dict(files)[json_lines] == ".jsonl", inputs
    # Within a code tree the same file is a text: two folders reading it differently, refused.
    (tmp_path / "main.py").write_text("print('a code tree')")
    with pytest.raises(ValueError, match=r"train.json is read as text within .* and as .jsonl"):
        prepare._input_files([tmp_path, hub])


def test_a_file_reached_through_a_link_is_read_once_as_first_reached(tmp_path, capsys):
    """A link within a folder given once: the file read once, said to be reached by more than
    one path (it was not given twice). A .json array and a link to it named .txt, both given
    alone: read as the first of them reads it, in either order."""
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("a document")
    (tree / "sub" / "b.txt").symlink_to("../a.txt")
    data.main(["prepare", "--input", str(tree), "--output", str(tmp_path / "ds"), "--workers", "1"])
    assert data.TokenDataset(tmp_path / "ds").meta["inputs_passed_over"] == {
        "reached twice": listed(tree / "a.txt")
    }
    note = "1 file reached by more than one path (given twice, or a link) read once: "
    assert f"{note}{tree / 'a.txt'}" in capsys.readouterr().out
    array = tmp_path / "f" / "x.json"
    array.parent.mkdir()
    array.write_text(json.dumps([{"text": "a record"}]))
    (link := tmp_path / "f" / "y.txt").symlink_to("x.json")
    assert prepare._input_files([array, link])[0] == [(array, ".json")]
    assert prepare._input_files([link, array])[0] == [(link, "text")]


def test_meta_json_keeps_a_count_and_the_first_five_of_many_files_passed_over(tmp_path, capsys):
    """A hub dataset's many test shards, a tree's many package.json files: meta.json keeps their
    count and the first five paths, the summary says as much as before."""
    shards = {f"data/test-{i:05}-of-00007.jsonl": 1 for i in range(7)}
    hub = hub_folder(tmp_path / "hub", {"data/train.jsonl": 2, **shards})
    data.main(["prepare", "--input", str(hub), "--output", str(tmp_path / "ds"), "--workers", "1"])
    tests = sorted(hub / name for name in shards)
    assert data.TokenDataset(tmp_path / "ds").meta["inputs_passed_over"]["test split"] == {
        "n": 7,
        "first": [str(p) for p in tests[:5]],
    }
    first = ", ".join(map(str, tests[:5]))
    note = f"(7 files; prepare it alone, --input its files, e.g. for train.py --eval-data): {first}"
    assert f"{note}, ...\n" in capsys.readouterr().out
    for i in range(6):
        (tmp_path / "tree" / str(i)).mkdir(parents=True)
        (tmp_path / "tree" / str(i) / "package.json").write_text('{"name": "a"}')
    tree = data.TokenDataset(prepare.prepare([tmp_path / "tree"], tmp_path / "t", workers=1))
    assert tree.meta["json_read_as_text"]["n"] == 6
    assert len(tree.meta["json_read_as_text"]["first"]) == 5
