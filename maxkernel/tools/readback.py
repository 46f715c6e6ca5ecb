"""Reading what a sandboxed child left in its run dir, as the untrusted data it is.

A child (above all a candidate) can replace any file in its run dir with a directory, a symlink, a FIFO, a
2 GiB sparse file or 20,000 small ones. Every read here therefore checks the entry's type without following
links (a regular file, opened with O_NOFOLLOW), its size against a cap before reading, and parses
defensively (`np.load(allow_pickle=False)`, shapes and dtypes against what was asked for). Anything that
does not fit raises `ReadBackError`, which the harness turns into a rejection, never a traceback.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

import numpy as np

from maxkernel.tools.results import ArraySpec, np_dtype

MAX_JSON_BYTES = 16 << 20
"""result.json and programs.json: structured data only; programs are far smaller than this."""
MAX_TAIL_BYTES = 4000
"""How much of stderr is quoted back in a message."""
MAX_RUN_DIR_ENTRIES = 2000
"""A candidate needs a handful of files; more than this is abuse, reported and deleted unread."""
MAX_JSON_DEPTH = 400
"""Nesting a read-back JSON document may have: a program tree nests about three levels per jaxpr level
(real programs: a few dozen); Python's parser and the walkers recurse, so deeper is refused unread."""
NPY_HEADER_SLACK = 4096
"""Bytes an .npy member may hold beyond its array's data (its header)."""
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


class ReadBackError(Exception):
    """A file the child left is not what the protocol says it is (type, size, count or content)."""


def read_capped(path: Path, cap: int) -> bytes:
    """The bytes of a regular file of at most `cap` bytes; never follows a symlink, never reads more."""
    try:
        st = os.lstat(path)
    except FileNotFoundError as exc:
        raise ReadBackError(f"{path.name} is missing") from exc
    if not stat.S_ISREG(st.st_mode):
        raise ReadBackError(f"{path.name} is not a regular file")
    if st.st_size > cap:
        raise ReadBackError(f"{path.name} is {st.st_size} bytes, over the {cap}-byte cap")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ReadBackError(f"{path.name} cannot be opened: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ReadBackError(f"{path.name} is not a regular file")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise ReadBackError(f"{path.name} grew past the {cap}-byte cap while being read")
    return data


def json_depth(data: bytes) -> int:
    """The deepest nesting of `[`/`{` in a JSON document (brackets inside strings do not count)."""
    bare = np.frombuffer(_JSON_STRING.sub(b'""', data), np.uint8)
    if bare.size == 0:
        return 0
    delta = (bare == ord("[")).astype(np.int64) + (bare == ord("{")) - (bare == ord("]")) - (bare == ord("}"))
    return int(np.cumsum(delta).max(initial=0))


def bounded_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` of untrusted bytes (already size-capped by the caller), refused when nested deeper than
    `max_depth` (Python's parser and every recursive reader would otherwise fail with RecursionError)."""
    raw = data.encode() if isinstance(data, str) else data
    if json_depth(raw) > max_depth:
        raise ReadBackError(f"a JSON document nested deeper than {max_depth} levels")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ReadBackError(f"not valid JSON: {str(exc)[:200]}") from exc


MAX_YAML_BYTES = 1 << 20
MAX_YAML_ALIASES = 64
MAX_YAML_DEPTH = 64
"""A task's YAML is a few kilobytes of settings: these bounds refuse an alias bomb (a few hundred bytes
that expand into gigabytes once anything walks the result) before it is built."""


def bounded_yaml(text: str) -> Any:
    """`yaml.safe_load` of a task's YAML, refused (ValueError) when it is over `MAX_YAML_BYTES`, uses more
    than `MAX_YAML_ALIASES` aliases or nests deeper than `MAX_YAML_DEPTH`; the events are counted before
    any object is built. YAML syntax errors propagate as `yaml.YAMLError`."""
    import yaml

    if len(text) > MAX_YAML_BYTES:
        raise ValueError(f"the YAML is {len(text)} characters, over the {MAX_YAML_BYTES} cap")
    aliases = depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            aliases += 1
            if aliases > MAX_YAML_ALIASES:
                raise ValueError(f"the YAML uses more than {MAX_YAML_ALIASES} aliases (an alias bomb?)")
        elif isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise ValueError(f"the YAML nests deeper than {MAX_YAML_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return yaml.safe_load(text)


def tail_text(path: Path, n: int = MAX_TAIL_BYTES) -> str:
    """The last `n` bytes of a log as text; '' for anything that is not a regular file (never raises)."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return f"[{path.name} is not a regular file]"
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - n))
            data = f.read(n)
    except OSError:
        return ""
    text = data.decode(errors="replace")
    return (f"[... {size - n} bytes before]\n" if size > n else "") + text


def file_size(path: Path) -> int:
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def count_entries(root: Path, cap: int = MAX_RUN_DIR_ENTRIES) -> int:
    """Entries under `root` (files, dirs, links; links not followed), counting stops just past `cap`."""
    n = 0
    stack = [root]
    while stack and n <= cap:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    n += 1
                    if n > cap:
                        break
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
        except OSError:
            continue
    return n


def load_arrays(path: Path, cap: int, expected: dict[str, ArraySpec]) -> dict[str, np.ndarray]:
    """An .npz of exactly the named arrays with exactly the given shapes and dtypes (bfloat16 travels as
    uint16 bits, as `pack_arrays` writes it). Each member's *decompressed* size is checked against what its
    expected array needs before it is read: a compressed member (a zip bomb) cannot make this process
    inflate more than the arrays it asked for."""
    data = read_capped(path, cap)
    out: dict[str, np.ndarray] = {}
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            names = set(z.files)
            if names != set(expected):
                missing = sorted(set(expected) - names)[:3]
                extra = sorted(names - set(expected))[:3]
                raise ReadBackError(f"{path.name}: arrays missing {missing}, unexpected {extra}")
            for name, spec in expected.items():
                size = z.zip.getinfo(f"{name}.npy").file_size
                need = int(np.prod(spec.shape, dtype=np.int64)) * np_dtype(spec.dtype).itemsize
                if size > need + NPY_HEADER_SLACK:
                    raise ReadBackError(
                        f"{path.name}: {name} decompresses to {size} bytes; a {spec} array needs {need}"
                    )
                arr = z[name]
                want = np_dtype(spec.dtype)
                raw = np.dtype(np.uint16) if spec.dtype == "bfloat16" else want
                if arr.dtype != raw or tuple(arr.shape) != tuple(spec.shape):
                    raise ReadBackError(
                        f"{path.name}: {name} is {arr.dtype}{list(arr.shape)}, expected {spec}"
                    )
                out[name] = arr.view(want) if spec.dtype == "bfloat16" else arr
    except ReadBackError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse failure of untrusted bytes is a rejection
        raise ReadBackError(f"{path.name} is not a valid array file: {type(exc).__name__}: {exc}") from exc
    return out


def pack_arrays(arrays: dict[str, Any]) -> bytes:
    """The .npz bytes of named arrays; bfloat16 as uint16 bits (npz cannot name bfloat16)."""
    raw = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        raw[name] = a.view(np.uint16) if a.dtype.name == "bfloat16" else a
    buf = io.BytesIO()
    np.savez(buf, **raw)
    return buf.getvalue()


def remove_tree(path: Path) -> None:
    """Delete a run dir whatever the child did to its modes (a chmod 000 folder must not survive)."""

    def fix(func: Any, p: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if not os.path.islink(p) and os.path.isdir(p):
                os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)
