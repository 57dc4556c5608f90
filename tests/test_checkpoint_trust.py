"""Loading a checkpoint never runs code from it; a signed checkpoint refuses tampering.

Each attack is the one a person who can write the checkpoint directory would make: replace or edit a file, then
recompute the per-file CRC-32s and the manifest's seal (plain CRCs, so anyone can). Every one must end in a
``ValueError`` naming the file, with no code run (no marker file), and the optimizer, model, scheduler and the
previous checkpoint unchanged. With ``key=``, a change no CRC sees is refused too.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from optim_harness import stack_state
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

from optstack.checkpoint import OptimizerState, SafeFileSystemReader, load_checkpoint, save_checkpoint
from optstack.checkpoint.format import MANIFEST, PART, seal
from optstack.checkpoint.io import file_checksum
from optstack.config import LossScaleConfig, OptimizerConfig
from optstack.demo.rundir import TrainState
from optstack.factory import BuiltOptimizer, build_optimizer
from optstack.schedule import LRSchedule
from optstack.tensor_bytes import tensor_bytes

KEY = b"a secret only the trainer knows"


class Payload:
    """Unpickling it opens (creates) the marker file: the proof that code from the checkpoint ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.marker, "w"))


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
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Checkpoints of steps 1 (the previous one) and 3 (``latest``), unsigned and signed; step 3's state."""
    root = tmp_path_factory.mktemp("trust")
    model = _model(0)
    built = _build(model)
    _train(model, built, range(1))
    for where in ("plain", "signed"):
        save_checkpoint(root / where, built.optimizer, step=1, scheduler=built.scheduler, model=model,
                        key=KEY if where == "signed" else None)
    _train(model, built, range(1, 3))
    for where in ("plain", "signed"):
        save_checkpoint(root / where, built.optimizer, step=3, scheduler=built.scheduler, model=model,
                        key=KEY if where == "signed" else None)
    return root, stack_state(model, built)


@pytest.fixture
def root(source: tuple[Path, dict], tmp_path: Path) -> Path:
    shutil.copytree(source[0], tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.fixture
def victim() -> tuple[nn.Module, BuiltOptimizer]:
    model = _model(5)
    built = _build(model)
    _train(model, built, range(20, 22))
    return model, built


def _reseal(checkpoint: Path, edit=None) -> None:  # type: ignore[no-untyped-def]
    """What an attacker does after changing files: recompute every CRC-32 and the manifest's seal."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest.pop("seal")
    for name in manifest["files"]:
        manifest["files"][name] |= file_checksum(checkpoint / name)
    if edit is not None:
        edit(manifest)
    (checkpoint / MANIFEST).write_text(seal(manifest))


def _refused(root: Path, victim: tuple[nn.Module, BuiltOptimizer], match: str, key: bytes | None = None) -> None:
    """The load fails with ``match``, the victim changes nowhere, the previous checkpoint is untouched."""
    model, built = victim
    before, previous = stack_state(model, built), _files(root / "step_00000001")
    with pytest.raises(ValueError, match=match):
        load_checkpoint(root, built.optimizer, scheduler=built.scheduler, model=model, key=key)
    assert _same(before, stack_state(model, built))
    assert _files(root / "step_00000001") == previous


def _metadata(root: Path) -> Path:
    return root / "step_00000003" / "rank_00000" / ".metadata"


def _edit_metadata(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    metadata = pickle.loads(path.read_bytes())  # the test's own file: a plain load is safe here
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))


def test_the_attack_from_issue_17_runs_no_code(root: Path, victim, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _metadata(root / "plain").write_bytes(pickle.dumps(Payload(marker)))
    _reseal(root / "plain" / "step_00000003")
    _refused(root / "plain", victim, r"step_00000003/rank_00000/\.metadata holds the global (builtins|io)\.open")
    assert not marker.exists()
    # The previous checkpoint still loads, and the payload is live: a plain pickle.load runs it.
    model, built = victim
    load_checkpoint(root / "plain" / "step_00000001", built.optimizer, scheduler=built.scheduler, model=model)
    pickle.loads(_metadata(root / "plain").read_bytes())
    assert marker.exists()


def _nested_in_planner_data(marker: Path):  # type: ignore[no-untyped-def]
    return lambda md: setattr(md, "planner_data", {"optim": [("x", Payload(marker))]})


def _reduce_in_a_chunk_size(marker: Path):  # type: ignore[no-untyped-def]
    def edit(md) -> None:  # type: ignore[no-untyped-def]
        entry = next(iter(md.state_dict_metadata.values()))
        entry.chunks[0].sizes = Payload(marker)
    return edit


def _reduce_in_storage_meta(marker: Path):  # type: ignore[no-untyped-def]
    return lambda md: setattr(md, "storage_meta", StorageMeta(save_id=Payload(marker)))  # type: ignore[arg-type]


@pytest.mark.parametrize("edit", [_nested_in_planner_data, _reduce_in_a_chunk_size, _reduce_in_storage_meta])
def test_a_payload_inside_valid_metadata_runs_no_code(root: Path, victim, tmp_path: Path, edit) -> None:
    marker = tmp_path / "pwned"
    _edit_metadata(_metadata(root / "plain"), edit(marker))
    _reseal(root / "plain" / "step_00000003")
    _refused(root / "plain", victim, r"rank_00000/\.metadata holds the global (builtins|io)\.open")
    assert not marker.exists()


def test_metadata_cannot_set_attributes_of_a_class(root: Path, victim) -> None:
    # GLOBAL StorageMeta; BUILD (None, {"save_id": "hacked"}): slot state would setattr on the class itself.
    poison = (b"\x80\x04ctorch.distributed.checkpoint.metadata\nStorageMeta\nN}X\x07\x00\x00\x00save_id"
              b"X\x06\x00\x00\x00hackeds\x86b.")
    _metadata(root / "plain").write_bytes(poison)
    _reseal(root / "plain" / "step_00000003")
    _refused(root / "plain", victim, r"\.metadata holds state to set on a type object")
    assert StorageMeta.save_id is None


def test_metadata_pointing_outside_its_directory(root: Path, victim) -> None:
    def edit(md) -> None:  # type: ignore[no-untyped-def]
        for info in md.storage_data.values():
            info.relative_path = "../../step_00000001/rank_00000/__0_0.distcp"
    _edit_metadata(_metadata(root / "plain"), edit)
    _reseal(root / "plain" / "step_00000003")
    _refused(root / "plain", victim, r"\.metadata is not DCP checkpoint metadata: .* points at '\.\./\.\./step")


@pytest.mark.parametrize("field, edit", [
    ("params['0.weight'].shape", lambda m: m["params"]["0.weight"].update(shape="8x6")),
    ("a chunk of params['0.weight']", lambda m: m["params"]["0.weight"]["chunks"].__setitem__(0, {"rank": 0})),
    ("params['0.bias'].group", lambda m: m["params"]["0.bias"].update(group=99)),
    ("a file name", lambda m: m["files"].update({"../../etc/passwd": {"bytes": 1, "crc32": "00000000"}})),
    ("model['0.bias'].rank", lambda m: m["model"]["0.bias"].update(rank="0")),
])
def test_manifest_with_unexpected_types(root: Path, victim, field: str, edit) -> None:  # type: ignore[no-untyped-def]
    _reseal(root / "plain" / "step_00000003", edit)
    _refused(root / "plain", victim, rf"step_00000003/manifest\.json: {re.escape(field)} is .*, expected")


def test_part_with_unexpected_types(root: Path, victim) -> None:  # type: ignore[no-untyped-def]
    """A writer's part of the manifest (``format.PART``: dtypes, scalars, packs) is checked as the manifest is."""
    checkpoint = root / "plain" / "step_00000003"
    part = json.loads((checkpoint / "rank_00000" / PART).read_text())
    part.pop("seal")
    part["params"]["0.bias"]["scalars"]["step"].update(value={"__class__": "os.system"})
    (checkpoint / "rank_00000" / PART).write_text(seal(part))
    _reseal(checkpoint)
    _refused(root / "plain", victim, r"step_00000003/rank_00000/state\.json: params\['0\.bias'\]\.scalars\['step'\] "
                                     r"is .*, expected")


def test_train_state_with_unexpected_types(tmp_path: Path) -> None:
    state = TrainState(step=3, model={"n_layer": 1}, data_rng=torch.Generator().manual_seed(1).get_state(),
                       torch_rng=torch.Generator().manual_seed(2).get_state(), best_val_loss=1.5, skipped_steps=0,
                       train_seconds=2.0, world_size=1)
    assert TrainState.from_json(state.to_json(), "ok").step == 3
    for field, value in [("step", "3"), ("model", ["n_layer"]), ("best_val_loss", {"x": 1}), ("world_size", True)]:
        text = json.dumps(json.loads(state.to_json()) | {field: value})
        with pytest.raises(ValueError, match=rf"train state 'ts\.json' is damaged .*{field} is"):
            TrainState.from_json(text, "ts.json")


def _force_crc(data: bytearray, at: int, crc: int) -> None:
    """Set ``data[at:at + 4]`` so that the CRC-32 of ``data`` is ``crc`` (CRC-32 is affine over GF(2))."""
    data[at : at + 4] = bytes(4)
    base, basis = zlib.crc32(data), {}
    for bit in range(32):  # the CRC change of each of the 32 bits, reduced to a basis
        probe = bytearray(data)
        probe[at + bit // 8] ^= 1 << (bit % 8)
        vec, mask = zlib.crc32(probe) ^ base, 1 << bit
        while vec and (top := vec.bit_length() - 1) in basis:
            vec, mask = vec ^ basis[top][0], mask ^ basis[top][1]
        if vec:
            basis[top] = (vec, mask)
    want, bits = crc ^ base, 0
    while want:
        vec, mask = basis[want.bit_length() - 1]
        want, bits = want ^ vec, bits ^ mask
    data[at : at + 4] = bits.to_bytes(4, "little")


def test_a_change_no_crc_sees_is_refused_with_the_key(root: Path, victim, source) -> None:
    checkpoint = root / "signed" / "step_00000003"
    data_file = checkpoint / "rank_00000" / "__0_0.distcp"
    data = bytearray(data_file.read_bytes())
    crc = zlib.crc32(data)
    saved = tensor_bytes(source[1]["0.0.weight.param"])  # the fp32 master, as written
    at = bytes(data).find(saved)
    assert at > 0
    data[at : at + 4] = tensor_bytes(torch.tensor([1e6]))  # the attacker's value for the first element
    _force_crc(data, at + 8, crc)  # the third element absorbs the CRC
    data_file.write_bytes(bytes(data))
    assert file_checksum(data_file)["crc32"] == f"{crc:08x}"
    _refused(root / "signed", victim, r"__0_0\.distcp fails its SHA-256 check", key=KEY)
    # Without the key the CRCs are all a load has, and they match: the change goes in unseen.
    model, built = victim
    load_checkpoint(root / "signed", built.optimizer, scheduler=built.scheduler, model=model)
    assert stack_state(model, built)["0.0.weight.param"][0] == 1e6


def test_signed_checkpoint_refuses_recomputed_checksums(root: Path, victim) -> None:
    def more_steps(m: dict) -> None:
        m["scheduler"]["num_steps"] = 40
    _reseal(root / "signed" / "step_00000003", more_steps)
    _refused(root / "signed", victim, r"manifest\.json fails its HMAC-SHA256 check", key=KEY)


def test_an_older_signed_checkpoint_under_a_newer_steps_name_is_refused(root: Path, victim) -> None:
    # a replay: step 1's checkpoint, validly signed, copied in as step 3 (the newest) would roll training back
    shutil.rmtree(root / "signed" / "step_00000003")
    shutil.copytree(root / "signed" / "step_00000001", root / "signed" / "step_00000003")
    _refused(root / "signed", victim, r"checkpoint of step 1 but its directory is named for step 3", key=KEY)


def test_wrong_key_unsigned_and_right_key(root: Path, victim, source) -> None:
    _refused(root / "signed", victim, "fails its HMAC-SHA256 check", key=b"another key")
    _refused(root / "plain", victim, r"is not signed \(no hmac_sha256\)", key=KEY)
    with pytest.raises(ValueError, match="key must be non-empty"):
        load_checkpoint(root / "signed", victim[1].optimizer, key="")
    model, built = victim
    info = load_checkpoint(root / "signed", built.optimizer, scheduler=built.scheduler, model=model,
                           key=KEY.decode())
    assert info.step == 3 and _same(stack_state(model, built), source[1])


def test_unsigned_checkpoints_load_as_before(root: Path, victim, source) -> None:
    manifest = json.loads((root / "plain" / "step_00000003" / MANIFEST).read_text())
    assert "hmac_sha256" not in manifest and all("sha256" not in e for e in manifest["files"].values())
    model, built = victim
    load_checkpoint(root / "plain", built.optimizer, scheduler=built.scheduler, model=model)
    assert _same(stack_state(model, built), source[1])


def test_dcp_load_through_the_safe_reader(tmp_path: Path, victim, source) -> None:
    """``dcp.load`` with ``SafeFileSystemReader``: an ``OptimizerState`` round trip, and a bytes item whose
    unpickling would run code is refused (DCP's own reader runs it)."""
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    model = _model(0)
    built = _build(model)
    _train(model, built, range(3))
    dcp.save({"model": model.state_dict(), "optim": OptimizerState(model, built.optimizer, built.scheduler)},
             checkpoint_id=tmp_path / "dcp")
    theirs, their_built = victim
    dcp.load({"model": theirs.state_dict(), "optim": OptimizerState(theirs, their_built.optimizer,
                                                                   their_built.scheduler)},
             storage_reader=SafeFileSystemReader(tmp_path / "dcp"))
    assert _same(stack_state(theirs, their_built), stack_state(model, built))

    marker = tmp_path / "pwned"
    dcp.save({"w": torch.ones(3), "extra": Payload(marker)}, checkpoint_id=tmp_path / "evil")
    marker.unlink(missing_ok=True)
    with pytest.raises(CheckpointException, match=r"__0_0\.distcp: item 'extra' is not plain data"):
        dcp.load({"w": torch.zeros(3), "extra": None}, storage_reader=SafeFileSystemReader(tmp_path / "evil"))
    assert not marker.exists()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointException, match=r"evil/\.metadata holds the global"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=SafeFileSystemReader(tmp_path / "evil"))
    assert not marker.exists()
