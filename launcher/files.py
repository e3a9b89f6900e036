"""File utilities, one of each: atomic replace, append with fsync, sha256, the end of a file, a follower.

Nothing here knows about runs; every other module writes and reads its files through these.

- ``write_bytes_atomic``/``write_text_atomic``/``write_json_atomic``: readers see the old file or the
  new one, never half.
- ``write_json_or_warn``: the same from inside a training process, where a disk's refusal (``DISK_ERRNOS``) is
  a warning, never an exception (``disk_error`` describes it).
- ``DiskTolerantStream``: a training process's stdout or stderr (the run's log, on the run's disk) that drops
  what a refusing disk will not take instead of raising it into the training loop.
- ``append_line``: one line appended and fsynced (``events.jsonl``).
- ``open_regular``/``read_regular``: a regular file only (never a FIFO, a device or a socket, links followed),
  within a byte limit; ``parse_json``: the one JSON parser of what the launcher reads, with bounds on depth,
  values, integers, numbers and strings;
- ``read_json_bounded``: JSON from a file of at most so many bytes and so deep, or ``Unreadable`` saying why;
  ``read_typed``: the same as a typed record (a dataclass; ``typed`` for a value already parsed, ``type_problem``
  for one value against a type), and ``unreadable``: the one line that says why not;
  ``read_json_object``/``read_yaml_mapping``: a mapping, or a one-line description of why not.
- ``shown``: text from outside (a command line, an exception, a path) with its control characters escaped.
- ``read_tail``: the last bytes of a growing file without reading the rest.
- ``FileFollower``: the bytes appended to a file since the last call; a file that is deleted and
  recreated, or truncated, is read again from its start.

New files follow the process umask (0644 under the usual 022), so a user on the host can read what a
container wrote.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints, is_typeddict

from launcher.errors import ExitCode, LauncherError

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_mode() -> int:
    """The mode a new file gets from the umask (0644 under the usual 022)."""
    return 0o666 & ~_umask()


def write_bytes_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` so that readers see the old file or the new one, never half of one.

    The data goes to a temporary file in the same folder, is fsynced and renamed over ``path``, and the
    folder is fsynced. If anything fails, the old file stays as it was. The file gets ``mode``, else
    what the umask allows.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, default_mode() if mode is None else mode)  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            Path(tmp).unlink(missing_ok=True)
        except OSError:  # e.g. the failed write (EIO) made the kernel remount the disk read-only: report the EIO
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_text_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically, as ``write_bytes_atomic``."""
    write_bytes_atomic(path, text.encode("utf-8"), mode)


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace ``path`` with ``data`` as indented JSON so that readers never see a partial file."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


# What a sick disk answers a write with: full, read-only (also the kernel's emergency remount), failing, over quota.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EIO, errno.EDQUOT})


def disk_error(exc: BaseException, path: Path | None = None) -> dict[str, Any] | None:
    """``errno`` (its name), the path and the free bytes under it when ``exc`` is a disk's refusal of a write;
    ``path`` is what was being written when the error does not name a file (a failed ``write``)."""
    if not isinstance(exc, OSError) or exc.errno not in DISK_ERRNOS:
        return None
    path = exc.filename or exc.filename2 or path
    free = None
    for folder in [Path(str(path)), *Path(str(path)).parents] if path else []:
        try:
            usage = os.statvfs(folder)
            free = usage.f_bavail * usage.f_frsize
            break
        except OSError:
            continue
    return {
        "errno": errno.errorcode.get(exc.errno, str(exc.errno)),
        "path": None if path is None else str(path),
        "free_bytes": free,
        "message": exc.strerror,
    }


def write_json_or_warn(path: Path, data: Any, what: str) -> dict[str, Any] | None:
    """Write a record from inside a training process, where the launcher's own bookkeeping must never end the
    run: a disk's refusal (``DISK_ERRNOS``) is logged as one warning line and returned (``disk_error``), not
    raised; the caller writes the whole record again at its next update. Any other error raises.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, data)
    except OSError as exc:
        found = disk_error(exc, path)
        if found is None:
            raise
        logger.warning(
            "could not write %s %s (%s: %s, %s bytes free); training goes on and the record is written "
            "again at its next update",
            what,
            path,
            found["errno"],
            found["message"],
            found["free_bytes"],
        )
        return found
    return None


class DiskTolerantStream:
    """A training process's stdout or stderr whose file a disk may refuse (``DISK_ERRNOS``): the text is dropped
    and counted instead of raising. The job's output goes to the run's log on the run's disk, so on a full or
    read-only disk the Trainer's progress bar, a print or a warning would otherwise end the rank with ENOSPC or
    EROFS; the lines written while the disk refuses are lost (what the buffer held is written once it takes
    writes again). Everything else is the wrapped stream's (``fileno``, ``isatty``, ``encoding``...)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.dropped_chars = 0

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            self.dropped_chars += len(text)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def share_readable(folder: Path) -> int:
    """Give every file under ``folder`` the read bits the umask allows (never more, never write or exec).

    Some writers create files 0600 whatever the umask (safetensors 0.8 writes its files through a private
    temporary file), which a user on the host cannot read when a container wrote them as root. Returns
    the number of files changed; files that vanish meanwhile are skipped.
    """
    readable = default_mode() & 0o444
    changed = 0
    for path in folder.rglob("*"):
        try:
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_mode & readable == readable:
                continue
            os.chmod(path, st.st_mode & 0o7777 | readable)
            changed += 1
        except OSError:
            continue
    return changed


def make_folder(path: Path, purpose: str) -> Path:
    """Create ``path`` (and its parents) if needed.

    Raises:
        LauncherError: it cannot be made or written there (read-only mount, a file in the way, no permission).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as err:
        raise LauncherError(
            f"{purpose} {path} cannot be used ({err.strerror or err}); point it at a writable folder (for a "
            "container: mount the outputs volume read-write and writable by the container's user)",
            ExitCode.USAGE,
        ) from None
    return path


def append_line(path: Path, line: str) -> None:
    """Append ``line`` (a newline is added) and fsync it: all of it or nothing (a failed write, e.g. a
    full disk, is cut back off so that no half line stays behind)."""
    data = (line + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, default_mode())
    try:
        start = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# Bounds on a JSON file the launcher reads (its own records, the Trainer's trainer_state.json): what it writes
# is far below them; a file past them is damaged or planted, and is refused before it is parsed.
MAX_JSON_BYTES = 16 << 20
MAX_JSON_DEPTH = 64
MAX_JSON_ITEMS = 1_000_000
# a string, or an unterminated one up to the end: the same match from every quote would make the scan quadratic
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\Z)', re.S)
_JSON_BRACKET = re.compile(rb"[\[\]{}]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class Unreadable(ValueError):
    """A file that cannot be read as what it should hold; the message says why (one line)."""


def json_depth(data: bytes, limit: int) -> int:
    """How deeply ``data`` nests (arrays and objects), counted up to ``limit + 1``.

    A scan of brackets outside strings, without recursion: ``json.loads`` recurses once per level, so
    a file of 200,000 nested objects must be refused before it is parsed, and what a parse returns is
    walked by code (``asdict``, ``json.dumps``, the record check) that recurses too.
    """
    depth = deepest = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub(b'""', data)):
        if match.group() in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth -= 1
    return deepest


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (after links): a FIFO, a device
    (``/dev/zero`` behind a link), a socket or a folder is refused without blocking or reading.

    Opened with ``O_NONBLOCK``, so that opening a FIFO never waits for a writer; on a regular file the flag
    changes nothing. Reads of a regular file are bounded by the caller's byte limit: a regular file cannot
    make a read wait (a hung network mount aside, which no read of ours can time out).

    Raises:
        FileNotFoundError: there is no such file.
        Unreadable: not a regular file, or it cannot be opened (the message says why).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise Unreadable(shown(err.strerror or str(err))) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as err:
        os.close(fd)
        raise Unreadable(shown(err.strerror or str(err))) from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise Unreadable(f"not a regular file ({_FILE_KINDS.get(stat.S_IFMT(mode), 'a special file')})")
    return fd


_FILE_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path`` (a regular file, ``open_regular``) when it holds at most ``max_bytes``.

    Raises:
        FileNotFoundError: there is no such file.
        Unreadable: not a regular file, larger than ``max_bytes``, or unreadable (the message says why).
    """
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:  # stat first: a huge file is refused without reading it
            raise Unreadable(f"{size:,} bytes, more than the {max_bytes:,} a record may have")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise Unreadable(shown(err.strerror or str(err))) from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew since the stat
        raise Unreadable(f"more than the {max_bytes:,} bytes a record may have")
    return data


# Bounds on a value inside a record: an integer of more digits than any count, size, pid or step the launcher
# keeps (2**63 has 19) is damage; Python's own limit (4,300 digits) would raise a ValueError no reader expects.
MAX_INT_DIGITS = 20
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise Unreadable(f"an integer of {len(text.lstrip('-')):,} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Unreadable(f"a number out of range ({shown(text[:40])})")
    return value


def _not_finite(text: str) -> float:
    raise Unreadable(f"a non-finite number ({text})")


def _whole_strings(value: Any) -> Any:
    """``value`` with every lone UTF-16 surrogate (``"\\ud800"`` in JSON, which no UTF-8 text can hold) put
    as U+FFFD, so that what is read can always be printed and written again. Depth is bounded by the caller."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_whole_strings(v) for v in value]
    if isinstance(value, dict):
        return {_whole_strings(k): _whole_strings(v) for k, v in value.items()}
    return value


def parse_json(data: bytes, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS) -> Any:
    """The JSON value in ``data``: the one parser of everything the launcher reads (records, log lines, the
    Trainer's state), with bounds on what it takes.

    Refused: deeper than ``max_depth``, more than ``max_items`` values, integers of more than
    ``MAX_INT_DIGITS`` digits, numbers that are not finite (``NaN``, ``Infinity``, ``1e999``), text that is not
    UTF-8. Lone surrogates in strings become U+FFFD.

    Raises:
        Unreadable: why not (one line).
    """
    if json_depth(data, max_depth) > max_depth:
        raise Unreadable(f"nested more than {max_depth} levels deep")
    if _value_count(data, max_items) > max_items:
        raise Unreadable(f"more than {max_items:,} values")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Unreadable("not UTF-8 text") from None
    try:
        value = json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_not_finite)
    except Unreadable:
        raise
    except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise Unreadable(f"not JSON: {shown(str(err)[:200])}") from None
    return _whole_strings(value) if _SURROGATE_ESCAPE.search(data) else value


def _value_count(data: bytes, limit: int) -> int:
    """An upper bound of the values in ``data`` (its commas and opening brackets outside strings, plus one)."""
    if len(data) <= limit:  # a value takes at least one byte: nothing to count
        return 0
    bare = _JSON_STRING.sub(b'""', data)
    return bare.count(b",") + bare.count(b"[") + bare.count(b"{") + 1


def read_json_bounded(
    path: Path, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS
) -> Any:
    """The JSON value in ``path`` (a regular file, ``read_regular``) parsed by ``parse_json``, read only if it
    is at most ``max_bytes``.

    Raises:
        FileNotFoundError: there is no such file.
        Unreadable: not a regular file, too large, or refused by ``parse_json`` (the message says which).
    """
    return parse_json(read_regular(path, max_bytes), max_depth, max_items)


def type_problem(value: Any, hint: Any) -> str | None:
    """Why ``value`` is not of the type ``hint`` (the subset the records use: None, str, int, float, bool,
    Any, unions, ``list[X]``, ``dict[str, X]``, TypedDicts), or None when it is.

    A typed check of our own rather than pydantic: ``launcher status`` must not pay pydantic's import
    (docs/performance.md). Depth is bounded by the reader (``read_json_bounded``), so the recursion is too.
    """
    if hint is Any:
        return None
    if hint is None or hint is type(None):
        return None if value is None else f"{kind_of(value)}, not null"
    origin = get_origin(hint)
    if origin is Union or str(origin) == "<class 'types.UnionType'>":
        options = get_args(hint)
        problems = [type_problem(value, h) for h in options]
        return None if None in problems else next(p for p in problems if p)
    if origin is list:
        if not isinstance(value, list):
            return f"{kind_of(value)}, not a list"
        (item,) = get_args(hint)
        return next((f"item {i}: {p}" for i, v in enumerate(value) if (p := type_problem(v, item))), None)
    if origin is dict:
        if not isinstance(value, dict):
            return f"{kind_of(value)}, not an object"
        item = get_args(hint)[1]
        return next((f"{k!r}: {p}" for k, v in value.items() if (p := type_problem(v, item))), None)
    if is_typeddict(hint):
        if not isinstance(value, dict):
            return f"{kind_of(value)}, not an object"
        keys = get_type_hints(hint)
        if missing := sorted(hint.__required_keys__ - value.keys()):  # a TypedDict of total=True: what readers index
            return f"no key {missing[0]!r}"
        return next((f"{k!r}: {p}" for k, v in value.items() if k in keys and (p := type_problem(v, keys[k]))), None)
    if hint is float:  # JSON has one number type
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    return None if ok else f"{kind_of(value)}, not {getattr(hint, '__name__', hint)}"


def kind_of(value: Any) -> str:
    """``value`` as a short JSON excerpt, for a message saying what was found instead."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else f"{type(value).__name__} {text[:37]}..."


_HINTS: dict[type, dict[str, Any]] = {}


def typed(data: Any, model: type[T]) -> T:
    """``data`` (a parsed JSON value) as an instance of ``model``, a dataclass whose field types are the subset
    ``type_problem`` checks. Keys the model does not declare are ignored (a newer writer stays readable), fields
    with a default may be missing; every key it declares must have its type.

    Raises:
        Unreadable: not an object, a field of the wrong type, or a field without a default missing.
    """
    if not isinstance(data, dict):
        raise Unreadable(f"{kind_of(data)}, not an object")
    hints = _HINTS.get(model)
    if hints is None:
        hints = _HINTS[model] = {f.name: get_type_hints(model)[f.name] for f in dataclasses.fields(model)}
    values = {k: v for k, v in data.items() if k in hints}
    for key, value in values.items():
        if why := type_problem(value, hints[key]):
            raise Unreadable(f"field {key!r}: {why}")
    missing = [
        f.name
        for f in dataclasses.fields(model)
        if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise Unreadable(f"no field {missing[0]!r}")
    return model(**values)


def read_typed(path: Path, model: type[T], max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> T:
    """The record in ``path`` as a ``model`` (``read_json_bounded``, then ``typed``).

    Raises:
        FileNotFoundError: there is no such file.
        Unreadable: as ``read_json_bounded`` and ``typed``; ``unreadable(path, err)`` is the one line to show.
    """
    return typed(read_json_bounded(path, max_bytes, max_depth), model)


def read_optional(
    path: Path, model: type[T], max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH
) -> tuple[T | None, str | None]:
    """``read_typed`` for a record that may be absent: ``(record, None)``; ``(None, None)`` when there is no
    file; ``(None, "unreadable: PATH (why)")`` when there is one that cannot be read as a ``model``."""
    try:
        return read_typed(path, model, max_bytes, max_depth), None
    except FileNotFoundError:
        return None, None
    except Unreadable as err:
        return None, unreadable(path, err)


def unreadable(path: Path, why: Any) -> str:
    """The one line for a record that cannot be read: ``unreadable: PATH (why)``."""
    return f"unreadable: {shown(path)} ({shown(why)})"


def shown(text: Any) -> str:
    """``text`` as one line that is safe to print: control characters (newlines, escape sequences) are
    written as ``\\n``, ``\\x1b``..., so that text from outside cannot add rows or move the cursor; printable
    characters of any script stay as they are."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


def _read_mapping(path: Path, load: Any, errors: tuple[type[Exception], ...], what: str) -> dict[str, Any] | str:
    try:
        data = load(path)
    except FileNotFoundError:
        return f"{shown(path)} is missing"
    except (OSError, UnicodeDecodeError, RecursionError, *errors) as err:
        return f"{shown(path)} is unreadable ({shown(err)})"
    return data if isinstance(data, dict) else f"{shown(path)} does not hold {what}"


def read_json_object(path: Path, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any] | str:
    """The JSON object in ``path`` (bounded as ``read_json_bounded``), or a one-line problem description."""
    return _read_mapping(path, lambda p: read_json_bounded(p, max_bytes), (Unreadable,), "a JSON object")


# Bounds on a YAML document the launcher reads (a run config, its overrides): a config is a few KB and uses
# anchors rarely. An alias bomb (nested anchors, each alias repeating the one before) is a few hundred bytes that
# expands to billions of nodes in whatever walks it (validation, a copy, json.dumps).
MAX_YAML_BYTES = 1 << 20
MAX_YAML_NODES = 100_000


def load_yaml(text: str, what: str) -> Any:
    """The YAML document in ``text`` (``yaml.safe_load``), refused in one line when it is larger than
    ``MAX_YAML_BYTES`` or its aliases would expand it past ``MAX_YAML_NODES`` values (counted on the composed
    node graph, where an alias is one shared node, before anything is built). ``what`` names the document.

    Raises:
        Unreadable: too large, too many aliases, or not YAML (the message says which).
    """
    import yaml  # here: `launcher status` reads no YAML and should not pay for importing it

    if len(text) > MAX_YAML_BYTES:
        raise Unreadable(f"{what} has {len(text):,} characters, more than the {MAX_YAML_BYTES:,} a config may have")
    try:
        if "*" in text and (nodes := _expanded_nodes(yaml.compose(text, Loader=yaml.SafeLoader))) > MAX_YAML_NODES:
            raise Unreadable(
                f"{what}: its YAML aliases (*name) expand it to {nodes:,} values, more than "
                f"{MAX_YAML_NODES:,} (an alias bomb?); write the values out"
            )
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise Unreadable(f"{what} is not valid YAML: {shown(err)}") from None
    except RecursionError:
        raise Unreadable(f"{what} nests too deeply") from None


def _expanded_nodes(root: Any) -> int:
    """How many values the composed YAML ``root`` holds once every alias is expanded (a node reached through
    several aliases counts each time; each node's own count is computed once)."""
    import yaml

    sizes: dict[int, int] = {}

    def size(node: Any) -> int:
        if id(node) not in sizes:
            total = 1
            if isinstance(node, yaml.MappingNode):
                total += sum(size(key) + size(value) for key, value in node.value)
            elif isinstance(node, yaml.SequenceNode):
                total += sum(size(item) for item in node.value)
            sizes[id(node)] = total
        return sizes[id(node)]

    return 0 if root is None else size(root)


def read_yaml_mapping(path: Path) -> dict[str, Any] | str:
    """The YAML mapping in ``path`` (a regular file, read by ``load_yaml``), or a one-line problem description."""

    def load(p: Path) -> Any:
        return load_yaml(read_regular(p, MAX_YAML_BYTES).decode("utf-8"), shown(p))

    return _read_mapping(path, load, (Unreadable,), "a mapping")


def read_tail(path: Path, max_bytes: int, start: int = 0) -> bytes:
    """The last ``max_bytes`` of ``path`` (a regular file), never from before byte ``start``; empty if
    unreadable or not a regular file."""
    try:
        fd = open_regular(path)
    except (OSError, Unreadable):
        return b""
    try:
        size = os.fstat(fd).st_size
        offset = max(start, size - max_bytes)
        return os.pread(fd, max(0, size - offset), offset)
    except OSError:
        return b""
    finally:
        os.close(fd)


def tail_lines(path: Path, lines: int, block: int = 65536) -> str:
    """The last ``lines`` lines of a text file (read from its last ``block`` bytes)."""
    data = read_tail(path, block)
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:]) + "\n" if data else ""


class FileFollower:
    """Hands out what is appended to a file, call after call.

    The followed file stays open between calls: while it is, a deleted file's inode number cannot be
    reused by the file that replaces it (ext4 reuses a freed number at once), so a new inode means a
    new file, which is then read from its start. A file that shrank was truncated: read from its start.
    """

    def __init__(self, path: Path, offset: int = 0, max_bytes: int = 16 << 20):
        self.path = path
        self.max_bytes = max_bytes
        self._file: Any = None
        self._offset = offset

    def read_new(self) -> tuple[bytes, bool]:
        """The bytes appended since the last call, and whether the file was replaced or truncated."""
        try:
            st = os.stat(self.path)
        except OSError:
            return b"", False
        restarted = False
        if self._file is None or os.fstat(self._file.fileno()).st_ino != st.st_ino or st.st_size < self._offset:
            restarted = self._file is not None
            self.close()
            try:  # kept open between calls, see above; a FIFO or a device is never opened
                self._file = os.fdopen(open_regular(self.path), "rb")
            except (OSError, Unreadable):
                return b"", False
            if restarted or st.st_size < self._offset:
                self._offset = 0
        self._file.seek(self._offset)
        # what the stat saw, at most ``max_bytes`` a call (the rest comes at the next): a bounded read
        data = self._file.read(max(0, min(st.st_size - self._offset, self.max_bytes)))
        self._offset += len(data)
        return data, restarted

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
