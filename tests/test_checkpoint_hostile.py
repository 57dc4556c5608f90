"""Hostile and damaged checkpoints end in a clear error within seconds and bounded memory, with nothing changed.

Each attack is one from issue 27, made by someone who can write the checkpoint directory and recompute the
CRC-32s and the manifest's seal (unsigned checkpoints: plain CRCs). Before the fix each one hung (a hash that
never returns), took minutes (a quadratic check), allocated gigabytes from a few bytes, loaded a NaN or
infinite setting, or failed without naming the file. Now each is a ``ValueError`` naming the file (and the
field), in well under ``SECONDS``, and the optimizer, scheduler, model and previous checkpoint are unchanged.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import time
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from optim_harness import stack_state
from torch import nn
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

from optstack.checkpoint import OptimizerState, SafeFileSystemReader, load_checkpoint, save_checkpoint
from optstack.checkpoint.format import MANIFEST, PART, seal
from optstack.checkpoint.io import file_checksum
from optstack.config import LossScaleConfig, OptimizerConfig
from optstack.factory import BuiltOptimizer, build_optimizer
from optstack.schedule import LRSchedule

SECONDS = 10.0  # each refusal takes well under a second here; the margin is for a loaded 2-core machine


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.bfloat16)


def _build(model: nn.Module) -> BuiltOptimizer:
    config = OptimizerConfig(lr=1e-2, precision="bf16", loss_scale=LossScaleConfig(mode="dynamic", initial=2.0**14))
    return build_optimizer(config, model, lr_schedule=LRSchedule(max_lr=1e-2, warmup_steps=10, decay_steps=50))


def _train(model: nn.Module, built: BuiltOptimizer, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        built.optimizer.scale_loss(((model(x.bfloat16()).float() - y) ** 2).mean()).backward()
        built.optimizer.step()
        built.optimizer.zero_grad()
        built.scheduler.step()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items())


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of steps 1 (the previous one) and 3 (``latest``)."""
    root = tmp_path_factory.mktemp("hostile")
    model = _model(0)
    built = _build(model)
    _train(model, built, range(1))
    save_checkpoint(root, built.optimizer, step=1, scheduler=built.scheduler, model=model)
    _train(model, built, range(1, 3))
    save_checkpoint(root, built.optimizer, step=3, scheduler=built.scheduler, model=model)
    return root


@pytest.fixture
def root(source: Path, tmp_path: Path) -> Path:
    shutil.copytree(source, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.fixture
def victim() -> tuple[nn.Module, BuiltOptimizer]:
    model = _model(5)
    built = _build(model)
    _train(model, built, range(20, 22))
    return model, built


def _step3(root: Path) -> Path:
    return root / "step_00000003"


def _reseal(checkpoint: Path, edit: Any = None) -> None:
    """What an attacker does after changing files: recompute every CRC-32 and the manifest's seal."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest.pop("seal")
    for name in manifest["files"]:
        manifest["files"][name] |= file_checksum(checkpoint / name)
    if edit is not None:
        edit(manifest)
    (checkpoint / MANIFEST).write_text(seal(manifest))


def _refused(root: Path, victim: tuple[nn.Module, BuiltOptimizer], match: str) -> float:
    """The load fails with ``match`` within ``SECONDS``; nothing changed. Returns the seconds it took."""
    model, built = victim
    before, previous = stack_state(model, built), _files(root / "step_00000001")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        load_checkpoint(root, built.optimizer, scheduler=built.scheduler, model=model)
    took = time.perf_counter() - start
    assert took < SECONDS, f"the refusal took {took:.1f} s"
    assert _same(before, stack_state(model, built))
    assert _files(root / "step_00000001") == previous
    return took


# -- crafted pickles -------------------------------------------------------------------------------------
def _nested_tuple(levels: int) -> bytes:
    """Opcodes leaving t_levels on the stack, t_0 = (), t_i = (t_{i-1}, t_{i-1}) through the memo: a few bytes
    per level, 2**levels paths, so ``hash(t_levels)`` never returns."""
    out = bytearray(b")\x94")  # EMPTY_TUPLE, MEMOIZE (memo 0)
    for i in range(levels):
        ref = b"j" + i.to_bytes(4, "little")  # LONG_BINGET i
        out += ref + ref + b"\x86\x94"  # TUPLE2, MEMOIZE (memo i + 1)
    return bytes(out)


def tuple_key_bomb(levels: int = 120) -> bytes:
    """``{t_levels: None}``: the dict's SETITEM hashes the key."""
    return b"\x80\x04}" + _nested_tuple(levels) + b"Ns."


def bytearray_bomb(size: int = 2_400_000_000) -> bytes:
    """``bytearray(size)``: admitted by torch's ``weights_only`` allowlist; allocates ``size`` bytes."""
    return (b"\x80\x02cbuiltins\nbytearray\n\x8a" + bytes([5]) + size.to_bytes(5, "little")
            + b"\x85R.")


def _record(pickled: bytes, compress: int = zipfile.ZIP_STORED, data: bytes | None = None) -> bytes:
    """A torch.save-style archive holding ``pickled`` as data.pkl (and a storage ``data``)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/byteorder", "little")
        if data is not None:
            archive.writestr("archive/data/0", data, compress_type=compress)
        archive.writestr("archive/version", "3\n")
    return out.getvalue()


def _deflated_tensor_record(numel: int) -> bytes:
    """A real tensor record of ``numel`` zeros whose storage member is deflated (~1000:1)."""
    buffer = io.BytesIO()
    torch.save(torch.zeros(numel), buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for info in source.infolist():
            deflate = info.filename.endswith("/data/0")
            archive.writestr(info.filename, source.read(info),
                             compress_type=zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
    return out.getvalue()


def _replace_item(rank_dir: Path, record: bytes) -> None:
    """Rewrite ``rank_dir``'s data file with its first item's record replaced by ``record`` (offsets fixed)."""
    meta_path = rank_dir / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())  # the test's own file: a plain load is safe here
    items = sorted(metadata.storage_data.items(), key=lambda kv: kv[1].offset)
    name = items[0][1].relative_path
    data = (rank_dir / name).read_bytes()
    out, offset = bytearray(), 0
    for i, (_, info) in enumerate(items):
        body = record if i == 0 else data[info.offset : info.offset + info.length]
        info.offset, info.length = offset, len(body)
        out += body
        offset += len(body)
    (rank_dir / name).write_bytes(bytes(out))
    meta_path.write_bytes(pickle.dumps(metadata))


# -- the attacks -------------------------------------------------------------------------------------------
def test_self_nested_tuple_key_in_the_metadata(root: Path, victim) -> None:
    (_step3(root) / "rank_00000" / ".metadata").write_bytes(tuple_key_bomb())
    _reseal(_step3(root))
    _refused(root, victim, r"rank_00000/\.metadata holds a dict key holding a tuple")


def test_self_nested_tuple_key_in_a_distcp_record(root: Path, victim) -> None:
    _replace_item(_step3(root) / "rank_00000", _record(tuple_key_bomb()))
    _reseal(_step3(root))
    _refused(root, victim, r"__0_0\.distcp: item .* is not plain data \(a dict key holding a tuple")


def test_aliased_chunk_lists_are_refused_in_linear_time(root: Path, victim) -> None:
    path = _step3(root) / "rank_00000" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))] * 4000
    properties = TensorProperties(dtype=torch.float32)
    for i in range(4000):  # 16M chunk references in a pickle of ~100 KB
        metadata.state_dict_metadata[f"x{i}"] = TensorStorageMetadata(properties, torch.Size([1]), chunks)
    path.write_bytes(pickle.dumps(metadata))
    assert path.stat().st_size < 200_000
    _reseal(_step3(root))
    _refused(root, victim, r"\.metadata is not DCP checkpoint metadata: state_dict_metadata lists more chunks")


def test_bytearray_of_gigabytes_in_a_record(root: Path, victim) -> None:
    _replace_item(_step3(root) / "rank_00000", _record(bytearray_bomb()))
    _reseal(_step3(root))
    _refused(root, victim, r"__0_0\.distcp: item .* is not plain data \(the global builtins\.bytearray\)")


def test_deflated_record_is_refused(root: Path, victim) -> None:
    _replace_item(_step3(root) / "rank_00000", _deflated_tensor_record(16))
    _reseal(_step3(root))
    _refused(root, victim, r"__0_0\.distcp: item .* is not plain data \(a compressed member 'archive/data/0'")


def test_an_item_larger_than_its_chunk_is_refused(root: Path, victim) -> None:
    _replace_item(_step3(root) / "rank_00000", _deflated_tensor_record(1 << 20))  # ~4 KB deflated, 4 MiB zeros
    _reseal(_step3(root))
    _refused(root, victim, r"__0_0\.distcp: item .* (is \d+ bytes, more than|is not plain data \(a compressed)")


def test_a_transform_descriptor_is_refused(root: Path, victim) -> None:
    path = _step3(root) / "rank_00000" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    next(iter(metadata.storage_data.values())).transform_descriptors = ["stream.zstd/1"]
    path.write_bytes(pickle.dumps(metadata))
    _reseal(_step3(root))
    _refused(root, victim, r"rank_00000/\.metadata: item .* has transforms \['stream\.zstd/1'\]")


def test_a_chunk_beyond_its_tensor_is_refused(root: Path, victim) -> None:
    """A chunk claiming more than its tensor would raise what a transformed item may expand to."""
    path = _step3(root) / "rank_00000" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    entry = next(iter(metadata.state_dict_metadata.values()))
    entry.chunks[0].sizes = torch.Size([1 << 40])
    path.write_bytes(pickle.dumps(metadata))
    _reseal(_step3(root))
    _refused(root, victim, r"\.metadata is not DCP checkpoint metadata: a chunk of .* of size \[1099511627776\] "
                           r"lies outside the tensor's size")


def test_an_item_beyond_its_file_is_refused(root: Path, victim) -> None:
    path = _step3(root) / "rank_00000" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    next(iter(metadata.storage_data.values())).offset = 1 << 60
    path.write_bytes(pickle.dumps(metadata))
    _reseal(_step3(root))
    _refused(root, victim, r"__0_0\.distcp: item .* claims bytes \[1152921504606846976, .* of a \d+-byte file")


@pytest.mark.parametrize("field, edit, match", [
    ("NaN step", lambda m: m["params"]["0.bias"]["scalars"]["step"].update(value=float("nan")),
     r"params\['0\.bias'\]\.scalars\['step'\] is nan .*expected a finite number >= 0"),
    ("negative step", lambda m: m["params"]["0.bias"]["scalars"]["step"].update(value=-3.0),
     r"params\['0\.bias'\]\.scalars\['step'\] is -3\.0"),
    ("huge pack item", lambda m: m.update(packs=[["float32", [["optim/0.bias/exp_avg", 0, 10**15]]]]),
     r"the packs of rank 0, packs\['0'\]\[0\]\[1\]\[0\] holds 1000000000000000 elements"),
], ids=["NaN step", "negative step", "huge pack item"])
def test_part_values_out_of_range(root: Path, victim, field: str, edit, match: str) -> None:
    """Steps are in the writing rank's part of the manifest (``format.PART``), checked as the manifest is."""
    _edit_part(_step3(root) / "rank_00000", edit)
    _reseal(_step3(root))
    _refused(root, victim, rf"step_00000003/rank_00000/state\.json: {match}")


def _edit_part(directory: Path, edit: Any) -> None:
    part = json.loads((directory / PART).read_text())
    part.pop("seal")
    edit(part)
    (directory / PART).write_text(seal(part))


@pytest.mark.parametrize("field, edit, match", [
    ("inf weight decay", lambda m: m["groups"][0]["settings"].update(weight_decay=float("inf")),
     r"groups\[0\]\.settings\['weight_decay'\] is inf .*expected finite numbers in \[0, inf\]"),
    ("negative lr", lambda m: m["groups"][0]["settings"].update(lr=-1.0),
     r"groups\[0\]\.settings\['lr'\] is -1\.0"),
    ("beta of 2", lambda m: m["groups"][0]["settings"].update(betas=[0.9, 2.0]),
     r"groups\[0\]\.settings\['betas'\] is \[0\.9, 2\.0\]"),
    ("huge pack item", lambda m: m.update(packs={"0": [["float32", [["optim/0.bias/exp_avg", 0, 10**15]]]]}),
     r"the packs of rank 0, packs\['0'\]\[0\]\[1\]\[0\] holds 1000000000000000 elements"),
], ids=["inf weight decay", "negative lr", "beta of 2", "huge pack item"])
def test_manifest_values_out_of_range(root: Path, victim, field: str, edit, match: str) -> None:
    _reseal(_step3(root), edit)
    _refused(root, victim, rf"step_00000003/manifest\.json: {match}")


def test_a_5000_digit_int_in_the_manifest(root: Path, victim) -> None:
    path = _step3(root) / MANIFEST
    path.write_text(path.read_text().replace('"step": 3', '"step": ' + "9" * 5000, 1))
    _refused(root, victim, r"manifest\.json: an integer of 5000 digits at line \d+ column \d+ \(after key 'step'\)")


def test_deep_json_in_the_manifest(root: Path, victim) -> None:
    path = _step3(root) / MANIFEST
    path.write_text(path.read_text().replace('"step": 3', '"step": ' + "[" * 100_000 + "]" * 100_000, 1))
    _refused(root, victim, r"manifest\.json: containers nested too deep to parse, from line \d+ column \d+ "
                           r"\(after key 'step'\)")


def test_a_symlink_out_of_the_checkpoint_is_refused(root: Path, victim, tmp_path: Path) -> None:
    data = _step3(root) / "rank_00000" / "__0_0.distcp"
    outside = tmp_path / "elsewhere.distcp"
    shutil.move(data, outside)
    os.symlink(outside, data)
    _refused(root, victim, r"__0_0\.distcp is a symbolic link to .*elsewhere\.distcp, outside the checkpoint")


# -- dcp.load through SafeFileSystemReader and OptimizerState ------------------------------------------
class _Deflate(StreamTransformExtension):
    """A streaming decompressor (as zstd's is), for a compression bomb the installed torch can read."""

    @staticmethod
    def registry_name() -> str:
        return "test.deflate"

    @staticmethod
    def from_descriptor(version: str) -> _Deflate:
        return _Deflate()

    def get_descriptor(self) -> str:
        return "test.deflate/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        raise NotImplementedError

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        class Reader(io.RawIOBase):
            def __init__(self) -> None:
                self.inflate = zlib.decompressobj()

            def readable(self) -> bool:
                return True

            def readinto(self, b: Any) -> int:
                data = self.inflate.unconsumed_tail or input.read(1 << 16)
                out = self.inflate.decompress(data, len(b))
                b[: len(out)] = out
                return len(out)

        return io.BufferedReader(Reader())


def _dcp_stack(tmp_path: Path) -> tuple[nn.Module, BuiltOptimizer, Path]:
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    model = _model(0)
    built = _build(model)
    _train(model, built, range(3))
    path = tmp_path / "dcp"
    dcp.save({"optim": OptimizerState(model, built.optimizer, built.scheduler)}, checkpoint_id=path)
    return model, built, path


def test_a_compression_bomb_reads_only_its_items_size(tmp_path: Path) -> None:
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    path = tmp_path / "bomb"
    dcp.save({"w": torch.ones(1000)}, checkpoint_id=path)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    info = next(iter(metadata.storage_data.values()))
    bomb = zlib.compress(bytes(1 << 26), 9)  # 64 MiB of zeros in 64 KB (1 GiB would be ~1 MB, as bounded)
    (path / info.relative_path).write_bytes(bomb)
    info.offset, info.length, info.transform_descriptors = 0, len(bomb), ["test.deflate/1"]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    registry = ExtensionRegistry()
    registry.register(_Deflate)
    start = time.perf_counter()
    with pytest.raises(CheckpointException, match=r"__0_0\.distcp: item 'w' is not plain data \(item 'w' holds "
                                                  r"more than the 69536 bytes its metadata allows"):
        dcp.load({"w": torch.zeros(1000)}, storage_reader=SafeFileSystemReader(path, _extension_registry=registry))
    assert time.perf_counter() - start < SECONDS


def test_safe_reader_refuses_a_tuple_key_metadata(tmp_path: Path) -> None:
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "d")
    (tmp_path / "d" / ".metadata").write_bytes(tuple_key_bomb())
    start = time.perf_counter()
    with pytest.raises(CheckpointException, match=r"d/\.metadata holds a dict key holding a tuple"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=SafeFileSystemReader(tmp_path / "d"))
    assert time.perf_counter() - start < SECONDS


@pytest.mark.parametrize("damage", ["truncated", "refused item"])
def test_a_failed_dcp_load_leaves_the_optimizer_as_it_was(tmp_path: Path, victim, damage: str) -> None:
    """Issue 27: 12 of 12 (and 2 of 12) moments were overwritten by a dcp.load that then failed."""
    _, _, path = _dcp_stack(tmp_path)
    data = path / "__0_0.distcp"
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size * 2 // 3])
    else:
        _replace_item(path, _record(bytearray_bomb()))
    model, built = victim
    before = stack_state(model, built)
    with pytest.raises(CheckpointException):
        dcp.load({"optim": OptimizerState(model, built.optimizer, built.scheduler)},
                 storage_reader=SafeFileSystemReader(path))
    assert _same(before, stack_state(model, built))

