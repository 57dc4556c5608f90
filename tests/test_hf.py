"""Hugging Face ``Trainer`` and ``accelerate`` drive optstack's optimizer and ``Scheduler`` (torch's contract).

Each run is compared with the plain loop an optstack user writes (zero_grad, backward, ``optimizer.step()``,
``scheduler.step()``) on the same data order, batch size and config: per-step losses, logged learning rates and
final parameters must be equal, and so must a run resumed from a checkpoint into freshly built objects.

Clipping: optstack clips (``OptimizerConfig.clip_grad``) and Trainer's is off (``max_grad_norm=0``; HF's default
1.0 clips ``p.grad`` before optstack's step, which then measures an already clipped norm). optstack's norm is the
one global norm of what it steps: every stage together, after unscaling, over reduced (ZeRO-1: sharded) buffers.

Models are tiny and built from configs (random init, no dropout); nothing reaches the hub and there is no tokenizer:
token ids are fed directly.
"""

from __future__ import annotations

import os

# huggingface_hub reads these when imported: nothing here may try the network (CI reaches only PyPI).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset, default_collate  # noqa: E402

from optstack import BuiltOptimizer, OptimizerConfig, build_optimizer  # noqa: E402
from optstack.schedule import LRSchedule  # noqa: E402

_NEEDS_HF = "needs the hf extra: pip install -e '.[hf]'"

VOCAB, SEQ, BATCH, STEPS = 64, 16, 4, 6
SCHEDULE = LRSchedule(init_lr=2e-3, max_lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=STEPS)
# clip_grad=1.0 is below the first steps' grad norms, so optstack's clipping is in play (asserted below).
CONFIG = OptimizerConfig(algorithm="adamw", lr=1e-2, min_lr=1e-3, weight_decay=0.1, clip_grad=1.0)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Models this small gain nothing from threads, and on a busy 2-core machine the threads' spinning turns
    # a one-second Trainer run into ten.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _build(model: nn.Module) -> BuiltOptimizer:
    return build_optimizer(CONFIG, model, lr_schedule=SCHEDULE)


def _assert_same_params(model: nn.Module, reference: nn.Module) -> None:
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    differ = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert not differ, f"parameters differ from the reference run: {differ}"


# -- Trainer -------------------------------------------------------------------------------------------------


def _transformers() -> ModuleType:
    return pytest.importorskip("transformers", reason=_NEEDS_HF)


def _tiny_lm(kind: str, seed: int = 0) -> nn.Module:
    tf = _transformers()
    torch.manual_seed(seed)
    if kind == "gpt2":  # no dropout: neither run may draw random numbers the other does not
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, bos_token_id=0, eos_token_id=0))


def _token_data() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    # Position 0 is never a target of a causal LM. Trainer divides the summed loss by the count of labels that
    # are not -100, and for a model built from a config it counts position 0 too: masking it makes its loss the
    # model's own mean, as in the plain loop.
    labels[:, 0] = -100
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]


def _plain_loop(model: nn.Module, built: BuiltOptimizer, steps: range) -> tuple[list[float], list[float]]:
    """(loss, optstack's pre-clip grad norm) of each step: Trainer's loop without Trainer."""
    data, losses, norms = _token_data(), [], []
    for step in steps:
        loss = model(**default_collate(data[step * BATCH:(step + 1) * BATCH])).loss
        built.optimizer.zero_grad()
        loss.backward()
        built.optimizer.step()
        built.scheduler.step()
        losses.append(loss.item())
        norms.append(built.optimizer.last_result.grad_norm)
    return losses, norms


def _trainer(model: nn.Module, built: BuiltOptimizer, out: Path, **args: Any) -> Any:
    tf = _transformers()
    settings: dict[str, Any] = {
        "max_steps": STEPS, "save_strategy": "no", "max_grad_norm": 0.0,  # optstack clips, Trainer does not
        "use_cpu": True, "report_to": [], "logging_steps": 1, "per_device_train_batch_size": BATCH,
        "train_sampling_strategy": "sequential", "seed": 0, "disable_tqdm": True,
    }
    return tf.Trainer(model=model, args=tf.TrainingArguments(output_dir=str(out), **settings | args),
                      train_dataset=_token_data(), optimizers=(built.optimizer, built.scheduler))


def _logged(trainer: Any, key: str, after: int = 0) -> list[float]:
    """Trainer's per-step log of ``key`` (``logging_steps=1``) for the steps after ``after``."""
    return [row[key] for row in trainer.state.log_history if "loss" in row and row["step"] > after]


def _scheduled_lrs(built: BuiltOptimizer, steps: range) -> list[float]:
    """The lr Trainer logs (``get_last_lr()[0]``: group 0's, as of the optimizer step) by optstack's schedule."""
    return [SCHEDULE(step) * built.optimizer.param_groups[0].get("lr_mult", 1.0) for step in steps]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trainer_trains_as_the_plain_loop(kind: str, tmp_path: Path) -> None:
    model = _tiny_lm(kind)
    built = _build(model)
    trainer = _trainer(model, built, tmp_path)
    trainer.train()

    reference = _tiny_lm(kind)
    losses, norms = _plain_loop(reference, _build(reference), range(STEPS))
    assert norms[0] > CONFIG.clip_grad, "the setup must exercise optstack's clipping"
    assert _logged(trainer, "loss") == losses
    _assert_same_params(model, reference)
    assert built.scheduler.num_steps == STEPS
    assert _logged(trainer, "learning_rate") == _scheduled_lrs(built, range(STEPS))
    # Trainer saw the gradients unclipped (max_grad_norm=0), as optstack measured them before clipping.
    assert _logged(trainer, "grad_norm") == pytest.approx(norms, rel=1e-5)


def test_trainer_resumes_from_checkpoint_into_fresh_objects(tmp_path: Path) -> None:
    reference = _tiny_lm("gpt2")
    losses, _ = _plain_loop(reference, _build(reference), range(STEPS))

    first = _tiny_lm("gpt2")
    _trainer(first, _build(first), tmp_path, max_steps=3, save_strategy="steps", save_steps=3).train()
    checkpoint = tmp_path / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "scheduler.pt").is_file()

    model = _tiny_lm("gpt2", seed=1)  # another init: the checkpoint must bring the parameters too
    built = _build(model)
    trainer = _trainer(model, built, tmp_path)
    trainer.train(resume_from_checkpoint=str(checkpoint))

    assert _logged(trainer, "loss", after=3) == losses[3:]
    assert _logged(trainer, "learning_rate", after=3) == _scheduled_lrs(built, range(3, STEPS))
    assert built.scheduler.num_steps == STEPS
    _assert_same_params(model, reference)


# -- accelerate ----------------------------------------------------------------------------------------------

ACCUM, MICRO_BATCHES = 2, 8


def _reset_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def accelerate() -> Iterator[ModuleType]:
    """accelerate, its process-wide state reset around the test (Trainer builds an ``Accelerator`` too, and the
    state outlives it), as accelerate's own test cases do."""
    module = pytest.importorskip("accelerate", reason=_NEEDS_HF)
    _reset_accelerate_state()
    yield module
    _reset_accelerate_state()


def _regression(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def _micro_batches() -> DataLoader:
    gen = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(MICRO_BATCHES * BATCH, 16, generator=gen),
                         torch.randn(MICRO_BATCHES * BATCH, 4, generator=gen))
    return DataLoader(data, batch_size=BATCH, shuffle=False)


def _accelerated(accelerate: ModuleType, seed: int = 0) -> tuple[Any, BuiltOptimizer, tuple[Any, ...]]:
    """(accelerator, the optstack objects, prepared (model, optimizer, scheduler, loader))."""
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    model = _regression(seed)
    built = _build(model)
    return accelerator, built, accelerator.prepare(model, built.optimizer, built.scheduler, _micro_batches())


def _accelerate_loop(accelerator: Any, built: BuiltOptimizer, prepared: tuple[Any, ...], batches: Any, *,
                     save_before: int | None = None, save_dir: Path | None = None) -> tuple[list[float], list[int]]:
    """(loss, optstack's scheduler step count) after each micro-batch; ``accelerator.save_state(save_dir)``
    before micro-batch ``save_before``."""
    model, opt, sched, _ = prepared
    losses, steps = [], []
    for index, (x, y) in enumerate(batches):
        if index == save_before:
            accelerator.save_state(str(save_dir))
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
        steps.append(built.scheduler.num_steps)
    return losses, steps


def _manual_accumulation(model: nn.Module, built: BuiltOptimizer, micro: range) -> list[float]:
    batches, losses = list(_micro_batches()), []
    for index in micro:
        if index % ACCUM == 0:
            built.optimizer.zero_grad()
        x, y = batches[index]
        loss = nn.functional.mse_loss(model(x), y)
        (loss / ACCUM).backward()
        losses.append(loss.item())
        if index % ACCUM == ACCUM - 1:
            built.optimizer.step()
            built.scheduler.step()
    return losses


def test_accelerate_accumulates_and_steps_the_schedule_once_per_update(accelerate: ModuleType) -> None:
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    accelerator, built, prepared = _accelerated(accelerate)
    model, opt, sched, batches = prepared
    # Unwrapped, both would act on every micro-batch: an update per micro-batch, the lr running ACCUM x as fast.
    assert isinstance(opt, AcceleratedOptimizer) and isinstance(sched, AcceleratedScheduler)
    losses, steps = _accelerate_loop(accelerator, built, prepared, batches)
    assert steps == [(i + 1) // ACCUM for i in range(MICRO_BATCHES)]
    assert sched.get_last_lr() == built.scheduler.get_last_lr()
    assert built.scheduler.get_last_lr()[0] == SCHEDULE(MICRO_BATCHES // ACCUM) * built.param_groups[0]["lr_mult"]

    reference = _regression()
    assert losses == _manual_accumulation(reference, _build(reference), range(MICRO_BATCHES))
    _assert_same_params(model, reference)


def test_accelerate_save_state_and_load_state_resume(accelerate: ModuleType, tmp_path: Path) -> None:
    half = MICRO_BATCHES // 2
    accelerator, built, prepared = _accelerated(accelerate)
    losses, _ = _accelerate_loop(accelerator, built, prepared, prepared[3], save_before=half, save_dir=tmp_path)
    assert (tmp_path / "optimizer.bin").is_file() and (tmp_path / "scheduler.bin").is_file()

    _reset_accelerate_state()
    accelerator, fresh, resumed = _accelerated(accelerate, seed=1)  # another init: load_state brings the params
    model, _, _, batches = resumed
    assert not fresh.optimizer.state
    accelerator.load_state(str(tmp_path))
    assert fresh.scheduler.num_steps == half // ACCUM
    assert fresh.optimizer.state_dict()["state"].keys() == built.optimizer.state_dict()["state"].keys()
    rest, steps = _accelerate_loop(accelerator, fresh, resumed, accelerator.skip_first_batches(batches, half))
    assert rest == losses[half:]
    assert steps == [(i + 1) // ACCUM for i in range(half, MICRO_BATCHES)]
    _assert_same_params(model, prepared[0])


def test_trainer_clipping_on_top_of_optstacks_is_a_warning(tmp_path: Path) -> None:
    import warnings

    model = _tiny_lm("gpt2")
    trainer = _trainer(model, _build(model), tmp_path, max_steps=2, max_grad_norm=1.0)  # Trainer's default
    with pytest.warns(UserWarning, match=r"max_grad_norm=1.0; its default is 1.0\) .* clips them again "
                                         r"\(OptimizerConfig.clip_grad=1.0\).*TrainingArguments\(max_grad_norm=0\)"):
        trainer.train()
    model = _tiny_lm("gpt2")
    with warnings.catch_warnings(record=True) as caught:  # Trainer's clipping off: no word
        warnings.simplefilter("always")
        _trainer(model, _build(model), tmp_path, max_steps=2).train()
    assert not [w for w in caught if "max_grad_norm" in str(w.message)]
