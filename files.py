"""The file rules every other file follows: `UsageError` for what the user got wrong, JSON
and directories (`OutputDir`) written whole and never over anything else, no write through a
link, a full disk said in one line. It imports nothing of longtune's: every file builds on it."""

import errno
import fnmatch
import glob
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


class UsageError(ValueError):
    """Something the user gave (a flag, a file, a directory) is wrong. train.py and data.py
    print its message alone, once; any other exception is a bug and keeps its traceback."""


def read_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path} is not a file" if path.exists() else f"{path} does not exist")
    try:
        value = json.loads(path.read_bytes())
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UsageError(f"{path} is not valid JSON: {e}") from e
    except RecursionError:  # json recurses once per level: [[[...]]] 100k deep
        raise UsageError(f"{path}: JSON nested too deep to read") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def write_json(path: Path, value: dict) -> None:
    write_whole(path, json.dumps(value, indent=1) + "\n")


def write_whole(path: Path, text: str) -> None:
    """Written whole or not at all: a reader never sees half a file."""
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w", opener=no_follow) as f:
        f.write(text)
    os.replace(tmp, path)


def no_follow(path: str | os.PathLike, flags: int) -> int:
    """open()'s opener for a file longtune writes in a directory others may write into: a
    symbolic link put there in its place would have it write into the link's target."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o666)


# What a path not found may be: a Hugging Face hub id, which longtune does not download.
LOCAL_PATH = "a local path: for a hub id, `huggingface-cli download ID --local-dir DIR`, then DIR"

# A full filesystem, or the user's quota on it: what was given to write into holds no more.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space(what: str, directory: Path) -> UsageError:
    """The one line for an OSError in NO_SPACE, said once the partial output is removed."""
    free = shutil.disk_usage(directory).free
    return UsageError(
        f"no space left to write {what} ({free:,} bytes free there): free some space, or "
        f"write it elsewhere"
    )


def check_directory_path(path: Path, what: str) -> None:
    """Refuses a path no directory can be made at: it, or its nearest existing parent, is a file."""
    existing = next(p for p in (path, *path.parents) if p.exists())  # "." and "/" exist
    if not existing.is_dir():
        where = "" if existing == path else f": {existing}"
        raise UsageError(f"{what} {path}{where} is a file")


def plural(n: int, noun: str) -> str:
    """'1 process', '2 processes', '1 group', '2 groups'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


def params_text(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def first_names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


@dataclass(frozen=True)
class OutputDir:
    """A kind of directory longtune writes whole and may later replace: `marker` is the file
    that makes a directory one (`writing` writes it; a dataset's is its meta.json), `names` the
    patterns of all its files. An existing directory is replaced only if empty or holding the
    marker and that kind's files alone: a mistyped path never deletes what someone keeps there."""

    kind: str
    marker: str
    names: tuple[str, ...]

    def check(self, final: str | os.PathLike) -> None:
        final = Path(final)
        check_directory_path(final, f"{self.kind} directory")
        held = sorted(p.name for p in final.iterdir()) if final.is_dir() else []
        # What the one there wrote, as its marker lists; else (written before markers listed
        # them, or a dataset's meta.json) what its files may be named.
        listed = read_json(final / self.marker).get("files") if self.marker in held else None
        if isinstance(listed, list):
            foreign = [n for n in held if n not in listed and n != self.marker]
        else:
            foreign = [n for n in held if not any(fnmatch.fnmatch(n, p) for p in self.names)]
        if foreign:
            raise UsageError(
                f"{self.kind} directory {final} holds {first_names(foreign)}, which no {self.kind} "
                f"writes: writing one there would replace them; give a new or empty directory, "
                f"or an earlier {self.kind}"
            )
        if held and self.marker not in held:
            raise UsageError(
                f"{self.kind} directory {final} holds {first_names(held)} but no {self.marker}, "
                f"which every {self.kind} longtune writes holds: writing there would replace "
                f"files someone else wrote (or a longtune {self.kind} from before that file: "
                f"remove it); give a new or empty directory, or an earlier {self.kind}"
            )

    def make_temp(self, final: str | os.PathLike) -> Path:
        """Beside `final`, with a new directory's mode (mkdtemp's is rwx for its owner only), so
        the result can be shared like the user's other files."""
        final = Path(final).resolve()  # "." has no name to put beside; a link, its target
        self.check(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        tmp.chmod(0o777 & ~_umask())
        # A process killed (SIGKILL, out of memory) leaves its directory: said, never removed
        # (another process may still be writing into it). mkdtemp's names end in 8 characters.
        name, suffix = glob.escape(final.name), "?" * 8
        left = [p for k in ("tmp", "old") for p in final.parent.glob(f".{name}.{k}-{suffix}")]
        if left := sorted(str(p) for p in left if p != tmp):
            print(
                f"note: {', '.join(left)}: unfinished {self.kind} directories (their writer was "
                f"killed, or is still running); remove those not in use",
                file=sys.stderr,
            )
        return tmp

    @contextmanager
    def writing(self, final: str | os.PathLike) -> Iterator[Path]:
        """make_temp's directory, marked and swapped in for `final` when the block ends, removed
        if it fails or is interrupted."""
        tmp = self.make_temp(final)
        try:
            yield tmp
            files = sorted(p.name for p in tmp.iterdir())  # the next one replaces these alone
            marker = {"written_by": "longtune", "kind": self.kind, "files": files}
            write_json(tmp / self.marker, marker)
            self.swap_in(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and e.errno in NO_SPACE:
                raise no_space(f"the {self.kind} {final}", tmp.parent) from None
            raise

    def swap_in(self, tmp: Path, final: str | os.PathLike) -> None:
        """`final` checked again (it may have changed); an old one goes once the new one is in."""
        final = Path(final).resolve()
        self.check(final)
        old = None
        try:
            if final.exists():
                # A name of its own: a leftover of an interrupted swap is never in the way.
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
                os.replace(final, old)
            os.replace(tmp, final)
        except BaseException:
            if old is not None and not final.exists():
                os.replace(old, final)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def give_ordinary_mode(file: Path) -> None:
    """The mode open() gives a new file (umask applied), for files written 0600 (safetensors)."""
    file.chmod(0o666 & ~_umask())


def _umask() -> int:
    umask = os.umask(0)  # reading it means setting it: put it back at once
    os.umask(umask)
    return umask
