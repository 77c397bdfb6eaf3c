"""Atomic JSON writes and schema checks shared by Profile, Plan and RunReport (no torch)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from stageplan.errors import SchemaError, StageplanError


def _probe_writable(folder: Path, what: str) -> None:
    """Create and remove a file in ``folder``: the only honest test (root ignores permission bits, and
    os.access calls /proc writable)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".stageplan-probe-", dir=str(folder))
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StageplanError(
            f"cannot write {what} in folder {str(folder)!r} ({exc.strerror or exc}); choose a writable place"
        ) from None


def check_output_path(path: str | os.PathLike[str], inputs: Any = ()) -> Path:
    """Refuse, before any work is done, an output file that could not be written: a missing or unwritable
    folder, a path that is a folder, or one of the command's own ``inputs`` (paths; others are ignored), which
    the output would replace."""
    if str(path) == "":
        raise StageplanError("the output path is empty; give a file name such as out.json")
    p = Path(path)
    for given in inputs:
        if (
            isinstance(given, (str, os.PathLike))
            and Path(given).exists()
            and p.exists()
            and os.path.samefile(given, p)
        ):
            raise StageplanError(f"output {str(p)!r} is this command's input {str(given)!r}; writing it "
                                 "would replace what it was made from: give another -o path")
    if _written_in_place(p):
        if not os.access(p, os.W_OK):
            raise StageplanError(f"cannot write {str(p)!r} (not writable); choose a writable place")
        return p
    # a link is written through: check where it goes
    target = Path(os.path.realpath(p)) if p.is_symlink() else p
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise StageplanError(f"output folder {str(parent)!r} does not exist (for {str(p)!r}); create it "
                             f"first or choose another path")
    if target.is_dir():
        raise StageplanError(
            f"output path {str(p)!r} is a folder; give a file name such as {str(p / 'out.json')!r}")
    _probe_writable(parent, f"{str(p)!r}")
    return p


def _written_in_place(p: Path) -> bool:
    """An existing device, pipe or path under /dev or /proc (``-o /dev/null``, ``/dev/stdout``): written to as
    open() would; a temporary file renamed over it would replace the device, or the file a shell redirected
    stdout to."""
    return p.exists() and (str(p).startswith(("/dev/", "/proc/")) or not (p.is_file() or p.is_dir()))


def check_output_dir(path: str | os.PathLike[str]) -> Path:
    """Refuse, before any work is done, an output folder that could not be created or written."""
    if str(path) == "":
        raise StageplanError("the output folder is empty; give a folder name such as out")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise StageplanError(f"output folder {str(p)!r} is a file; give a folder name")
    parent = p if p.is_dir() else (p.parent if str(p.parent) else Path("."))
    if not parent.is_dir():
        raise StageplanError(f"output folder {str(parent)!r} does not exist (for {str(p)!r}); create it "
                             f"first or choose another path")
    _probe_writable(parent, f"the folder {str(p)!r}")
    return p


def _clean(obj: Any) -> Any:
    """NaN/inf are not JSON: store them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def default_mode() -> int:
    """0o666 minus the umask: what open() would give (mkstemp's 0o600 would surprise users)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> None:
    """Call ``write`` on a temporary file in the same folder, then os.replace it over ``path``: a reader never
    sees a half-written file, and a failure leaves what was there before. A symbolic link is written through
    to the file it names (the link stays); a device, a pipe or a path under /dev or /proc (``-o /dev/null``,
    ``/dev/stdout``) is written to as open() would, not replaced by a file."""
    p = check_output_path(path)
    if _written_in_place(p):
        with open(p, "wb") as f:
            write(f)
        return
    if p.is_symlink():
        p = Path(os.path.realpath(p))
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp",
                               dir=str(p.parent) if str(p.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, default_mode())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """JSON (NaN and infinities as null), written atomically."""
    text = json.dumps(_clean(data), indent=1, allow_nan=False) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


def is_number(value: Any, *, finite: bool = True) -> bool:
    """A JSON number (int or float, not true/false), and finite unless ``finite`` is False: what every
    loader's field checks start from."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (not finite or math.isfinite(value)))


def malformed(source: str, exc: KeyError | TypeError, remedy: str) -> SchemaError:
    """The one line for a stored file a loader could not build: a missing field (KeyError) or one of the wrong
    kind (TypeError), then the remedy."""
    what = f"lacks field {exc}" if isinstance(exc, KeyError) else f"has a field of the wrong kind ({exc})"
    return SchemaError(f"{source} {what}; {remedy}")


def short_repr(value: Any) -> str:
    """repr() cut to about 120 characters, so that a refusal naming a whole object stays a readable line."""
    import reprlib

    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlist, r.maxdict, r.maxtuple, r.maxlevel = 60, 60, 6, 4, 6, 2
    return r.repr(value)


def read_json(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        inside = sorted(q.name for q in p.glob("*.json"))
        more = f" and {len(inside) - 4} more" if len(inside) > 4 else ""
        raise StageplanError(f"{what} {str(p)!r} is a folder, not a file; give the file inside it"
                             + (f" (it holds {', '.join(inside[:4])}{more})" if inside
                                else " (it holds no .json file)"))
    if not p.is_file():
        raise StageplanError(f"{what} file {str(p)!r} does not exist; check the path")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SchemaError(
            f"{what} file {str(p)!r} is not valid JSON ({exc}); regenerate it with stageplan"
        ) from exc
    except RecursionError as exc:  # json's decoder recurses once per nesting level
        raise SchemaError(f"{what} file {str(p)!r} nests its JSON deeper than Python reads; no stageplan "
                          "file nests more than a few levels: regenerate it with stageplan") from exc
    if not isinstance(data, dict):
        raise SchemaError(f"{what} file {str(p)!r} holds a {type(data).__name__}, not a JSON object; "
                          f"regenerate it with stageplan")
    return data


def check_schema(data: dict[str, Any], expected: str, what: str) -> None:
    """Accept exactly ``expected`` (e.g. 'stageplan.profile/1'); name both versions otherwise."""
    got = data.get("schema")
    if got == expected:
        return
    kind = expected.rsplit("/", 1)[0]
    if isinstance(got, str) and got.startswith(kind + "/"):
        raise SchemaError(
            f"{what} has schema {got!r} but this stageplan reads {expected!r}; "
            "use the stageplan version that wrote it, or regenerate the file"
        )
    raise SchemaError(f"{what} has schema {got!r}, expected {expected!r}; this is not a stageplan "
                      f"{kind.split('.')[-1]} file")


def save_or_keep(obj: Any, path: str | os.PathLike[str]) -> None:
    """``obj.save(path)`` for a finished result; if that write fails now (the disk filled, the folder went
    away), keep the result in a named temporary file and say where, instead of losing the work."""
    try:
        obj.save(path)
    except (OSError, StageplanError) as exc:
        fd, kept = tempfile.mkstemp(prefix="stageplan-", suffix=".json")
        os.close(fd)
        obj.save(kept)
        raise StageplanError(f"could not write {str(path)!r} ({exc}); the result was kept in {kept}") from exc
