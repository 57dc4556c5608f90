"""Bounded, data-only deserialisation: what a file may make a load build, allocate, hash or walk.

A checkpoint file is data from disk; it must not choose how much time or memory a load spends. Three places
build objects from a file's bytes, and each is bounded here, before the object exists or the memory is taken:

- pickles (DCP ``.metadata``, the ``torch.save`` records inside ``.distcp`` files): a pure-Python unpickler that
  admits only the globals it is given, never hashes what the file built (a dict key, a set member must be a
  flat value: str, bytes, number, None, or a flat tuple of those, so no self-nested tuple makes ``hash``
  exponential), and whose result is walked once (each object once, however aliased) against a depth and a
  node limit;
- ``torch.save`` records (zip archives): stored members only (no deflate), no more members or bytes than the
  record itself, and a dry run of their ``data.pkl`` through the unpickler above before ``torch.load`` sees them
  (``torch.load(weights_only=True)`` admits ``bytearray(N)``, which allocates N bytes from a 20-byte pickle);
- transformed items (a DCP ``transform_descriptors`` such as zstd): read through the transform at most to the
  size the metadata gives the item, never decompressed in full first.

Every refusal is a ``Refused`` (or ``ValueError``) naming what was found; the caller adds the file.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import IO, Any

import torch

__all__ = ["MAX_DEPTH", "MAX_NODES", "Refused", "BoundedUnpickler", "check_key", "check_tree", "read_bounded",
           "check_record", "scan_record"]

MAX_DEPTH = 64  # containers inside containers: DCP metadata and optimizer state need fewer than 10
MAX_NODES = 1 << 22  # containers and values in one data pickle (each counted once)
MAX_KEY_BITS = 64  # an int used as a key (a hash of a 5,000-digit int costs little, but nothing needs one)
MAX_TUPLE_KEY = 64  # elements of a tuple used as a key
MAX_RECORD_MEMBERS = 4096  # files in one torch.save record (a tensor has 5; a dict of tensors one per storage)


class Refused(Exception):
    """What a file holds that a data-only load refuses (the caller names the file)."""


_ATOMS = (str, bytes, float, bool, type(None))


def check_key(key: Any) -> None:
    """Refuse a dict key or set member that is not flat data: hashing it could take any time."""
    if isinstance(key, _ATOMS) or isinstance(key, torch.dtype):
        return
    if type(key) is int:
        if key.bit_length() > MAX_KEY_BITS:
            raise Refused(f"a dict key that is an int of {key.bit_length()} bits")
        return
    if type(key) is tuple or type(key) is torch.Size:
        if len(key) > MAX_TUPLE_KEY:
            raise Refused(f"a dict key that is a tuple of {len(key)} elements")
        for part in key:
            if type(part) is int:
                check_key(part)
            elif not isinstance(part, _ATOMS):
                raise Refused(f"a dict key holding a {type(part).__name__} (only flat tuples of str, bytes and "
                              "numbers; a nested one can take forever to hash)")
        return
    check = _KEY_CHECKS.get(type(key))
    if check is None:
        raise Refused(f"a dict key of type {type(key).__name__}")
    check(key)


#: type -> check of a key of that type (a DCP ``MetadataIndex``: registered by safe.py)
_KEY_CHECKS: dict[type, Callable[[Any], None]] = {}


def register_key(cls: type, check: Callable[[Any], None]) -> None:
    _KEY_CHECKS[cls] = check


class BoundedUnpickler(pickle._Unpickler):
    """Python's own unpickler, its globals limited to ``allowed`` and every key checked before it is hashed.

    The pure-Python unpickler, so that each opcode that hashes (dict and set building) can be checked first.
    ``file`` must be in memory (a ``BytesIO``): a length a file claims is then never allocated beyond its size.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: IO[bytes], allowed: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[module, name]
        except (KeyError, TypeError):
            raise Refused(f"the global {module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise Refused(f"a persistent id ({type(pid).__name__})")

    def _load_build(self) -> None:
        state = self.stack[-1]
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict):
                for key in part:
                    check_key(key)
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


def _keys_then(opcode: bytes, keys: Callable[[Any], list[Any]]) -> None:
    """Check the keys an opcode is about to hash (in the pure unpickler, the items since the last mark are
    ``self.stack``), then run it."""
    original = pickle._Unpickler.dispatch[opcode[0]]

    def load(self: BoundedUnpickler) -> None:
        for key in keys(self):
            check_key(key)
        original(self)

    BoundedUnpickler.dispatch[opcode[0]] = load


_keys_then(pickle.SETITEM, lambda self: [self.stack[-2]])
_keys_then(pickle.SETITEMS, lambda self: self.stack[::2])
_keys_then(pickle.DICT, lambda self: self.stack[::2])
_keys_then(pickle.ADDITEMS, lambda self: list(self.stack))
_keys_then(pickle.FROZENSET, lambda self: list(self.stack))


def _checked_set(kind: type) -> Callable[..., Any]:
    def build(items: Any = ()) -> Any:
        if not isinstance(items, list | tuple):
            raise Refused(f"a {kind.__name__} built from something other than a list")
        for item in items:
            check_key(item)
        return kind(items)
    return build


def _checked_ordered_dict(items: Any = ()) -> OrderedDict:
    if not isinstance(items, list | tuple) or any(not isinstance(p, list | tuple) or len(p) != 2 for p in items):
        raise Refused("an OrderedDict built from something other than a list of pairs")
    for key, _ in items:
        check_key(key)
    return OrderedDict(items)


#: Safe stand-ins for the builtin containers a pickle may name (their members are checked before hashing).
CONTAINERS: dict[tuple[str, str], Any] = {
    ("builtins", "set"): _checked_set(set), ("builtins", "frozenset"): _checked_set(frozenset),
    ("collections", "OrderedDict"): _checked_ordered_dict,
}


def check_tree(root: Any, what: str = "the pickle") -> None:
    """Refuse containers nested deeper than ``MAX_DEPTH``, a container inside itself, or more than ``MAX_NODES``
    objects; each object is visited once however often the pickle aliases it (linear in what was built)."""
    depth: dict[int, int] = {}  # id -> depth below it (finished)
    open_: set[int] = set()
    keep: list[Any] = []  # holds the visited objects so that ids stay unique
    stack: list[tuple[Any, bool]] = [(root, False)]
    nodes = 0
    while stack:
        obj, done = stack.pop()
        key = id(obj)
        children = _children(obj)
        if children is None:
            continue
        if done:
            open_.discard(key)
            depth[key] = 1 + max((depth.get(id(c), 0) for c in children), default=0)
            if depth[key] > MAX_DEPTH:
                raise Refused(f"containers nested more than {MAX_DEPTH} deep in {what}")
            continue
        if key in depth:
            continue
        if key in open_:
            raise Refused(f"a container that contains itself in {what}")
        nodes += 1 + len(children)
        if nodes > MAX_NODES:
            raise Refused(f"more than {MAX_NODES} objects in {what}")
        open_.add(key)
        keep.append(obj)
        stack.append((obj, True))
        stack.extend((c, False) for c in children if _children(c) is not None and id(c) not in depth)


def _children(obj: Any) -> list[Any] | None:
    if isinstance(obj, list | tuple | set | frozenset):
        return list(obj)
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict) and not isinstance(obj, type):
        return list(state.values())
    return None


def read_bounded(stream: IO[bytes], limit: int, what: str) -> bytes:
    """At most ``limit`` bytes of ``stream`` (a decompressing one reads no further); ``Refused`` if it has more."""
    parts, got = [], 0
    while got <= limit:  # a raw (decompressing) stream may return less than asked before its end
        part = stream.read(min(limit + 1 - got, 1 << 24))
        if not part:
            break
        parts.append(part)
        got += len(part)
    data = b"".join(parts)
    if len(data) > limit:
        raise Refused(f"{what} holds more than the {limit} bytes its metadata allows (a compressed item that "
                      "expands beyond its size, or damage)")
    return data


# -- torch.save records ------------------------------------------------------------------------------------
class _Opaque:
    """What a dry run builds for a tensor, a storage or another object torch would rebuild: nothing."""


def _stub(*_: Any, **__: Any) -> _Opaque:
    return _Opaque()


_STORAGES = [n for n in dir(torch) if n.endswith("Storage") and isinstance(getattr(torch, n), type)]
#: What a ``torch.save`` record of tensors and plain data may name: each rebuilds from data the record holds
#: (a tensor views a stored buffer), none allocates by an argument (unlike ``bytearray(N)`` or ``torch.Tensor(N)``).
RECORD_GLOBALS: dict[tuple[str, str], Any] = {
    **{("torch._utils", n): _stub for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                              "_rebuild_parameter", "_rebuild_parameter_with_state")},
    ("torch._tensor", "_rebuild_from_type_v2"): _stub, ("torch.nn.parameter", "Parameter"): _stub,
    ("torch", "Size"): _stub, ("torch", "device"): _stub, ("torch.serialization", "_get_layout"): _stub,
    ("torch.storage", "UntypedStorage"): _stub, ("torch.storage", "TypedStorage"): _stub,
    ("builtins", "complex"): complex,
    **{("torch", n): _stub for n in _STORAGES},
    **{("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
    **CONTAINERS,
}


class _RecordScan(BoundedUnpickler):
    def persistent_load(self, pid: Any) -> Any:
        return _Opaque()  # a storage: its bytes are a member of the record, bounded by the record's size


def check_record(data: bytes, limit_members: int = MAX_RECORD_MEMBERS) -> None:
    """Refuse a ``torch.save`` record that could make ``torch.load`` take more than its own size: compressed or
    oversized members, too many members, or a ``data.pkl`` outside ``RECORD_GLOBALS`` (or unbounded)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise Refused(f"a record that is not a torch.save archive ({exc})") from None
    if len(members) > limit_members:
        raise Refused(f"a record of {len(members)} members (at most {limit_members})")
    total, pkl = 0, None
    for member in members:
        if member.compress_type != zipfile.ZIP_STORED:
            raise Refused(f"a compressed member {member.filename!r} (torch.save stores members uncompressed; a "
                          "compressed one can expand a thousandfold)")
        total += member.file_size
        if member.file_size != member.compress_size or total > len(data):
            raise Refused(f"member {member.filename!r} claims {member.file_size} bytes, more than the record holds")
        if member.filename.endswith("/data.pkl") or member.filename == "data.pkl":
            pkl = member
    if pkl is None:
        raise Refused("a record without data.pkl")
    try:
        pickled = archive.read(pkl)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:  # a damaged header or CRC
        raise Refused(f"a damaged record ({exc})") from None
    scan_record(pickled)


def scan_record(pickled: bytes) -> None:
    """Dry-run a record's ``data.pkl``: only ``RECORD_GLOBALS``, flat keys, bounded depth and size."""
    try:
        result = _RecordScan(io.BytesIO(pickled), RECORD_GLOBALS).load()
    except Refused:
        raise
    except Exception as exc:  # damage: truncation, a wrong arity, an int of 5,000 digits, ...
        raise Refused(f"a damaged pickle ({type(exc).__name__}: {str(exc)[:200]})") from None
    check_tree(result)
