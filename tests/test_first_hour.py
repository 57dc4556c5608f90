"""What a new user does by habit in the first hour (issue 30) either works or fails at once, saying what to do.

One test per habit; each failed before the fix (silently wrong, a crash deep inside, or a hang).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack import OptimizerConfig, build_optimizer
from optstack.schedule import LRSchedule


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


# -- 2: a schedule that disagrees with the config ------------------------------------------------------------


@pytest.mark.parametrize(("config", "schedule", "named"), [
    (OptimizerConfig(), LRSchedule(max_lr=3e-4, decay_steps=10),
     ["LRSchedule.max_lr=0.0003", "OptimizerConfig.lr=0.001"]),
    (OptimizerConfig(lr=3e-4), LRSchedule(max_lr=3e-4, min_lr=3e-5, decay_steps=10),
     ["LRSchedule.min_lr=3e-05", "OptimizerConfig.min_lr=0.0"]),
])
def test_schedule_disagreeing_with_config_is_an_error(config, schedule, named):
    with pytest.raises(ValueError, match="disagrees with the config") as raised:
        build_optimizer(config, _model(), lr_schedule=schedule)
    for text in named:
        assert text in str(raised.value)
    assert "OptimizerConfig(lr=0.0003" in str(raised.value)  # the fix, spelled out


def test_schedule_agreeing_with_config_runs_as_written():
    built = build_optimizer(OptimizerConfig(lr=3e-4, min_lr=3e-5), _model(),
                            lr_schedule=LRSchedule(max_lr=3e-4, min_lr=3e-5, warmup_steps=2, decay_steps=4))
    lrs = []
    for _ in range(6):
        built.scheduler.step()
        lrs.append(built.scheduler.get_last_lr()[0])
    assert lrs[1] == pytest.approx(3e-4) and lrs[-1] == pytest.approx(3e-5)


# -- 4: torch.compile of the step or of a train step --------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["adamw", "muon"])
@pytest.mark.parametrize("what", ["opt.step", "train step"])
def test_compiled_step_equals_eager(algorithm, what):
    torch._dynamo.reset()
    config = OptimizerConfig(algorithm=algorithm, lr=1e-2, clip_grad=1.0)
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def run(compiled: bool) -> nn.Module:
        model = _model()
        opt = build_optimizer(config, model).optimizer
        step = torch.compile(opt.step, backend="aot_eager") if compiled and what == "opt.step" else opt.step

        def train(x: torch.Tensor) -> None:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            step()

        train_step = torch.compile(train, backend="aot_eager") if compiled and what == "train step" else train
        for x in batches:
            train_step(x)
            assert opt.last_result.applied
        return model

    eager, compiled = run(False), run(True)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=name)


# -- 6: the demo: Ctrl-C before the first checkpoint; --resume of a finished run ------------------------------


_TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=60000",
         "train.batch_size=8", "train.eval_batches=1", "schedule.warmup_steps=2", "train.sample_bytes=20",
         "train.steps=5", "train.eval_every=1", "train.checkpoint_every=100", "schedule.decay_steps=5"]


def _demo_config():
    from optstack.demo.config import load_config, parse_override

    return load_config(None, [parse_override(s) for s in _TINY])


def _metrics(out) -> list[tuple]:
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["val_loss"], r["grad_norm"], r["lr"]) for r in rows]


def test_demo_ctrl_c_saves_a_checkpoint_that_resume_continues(tmp_path):
    import signal

    from optstack.demo.train import train

    cfg = _demo_config()
    straight = tmp_path / "straight"
    train(cfg, straight, progress=False, echo=lambda _: None)

    def press_ctrl_c_at_step_2(line: str) -> None:
        if line.startswith("step 2/"):
            signal.raise_signal(signal.SIGINT)  # as the terminal delivers it, mid-loop

    out = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt, match=r"after step 2, saved as checkpoint step_0+2; continue with: "
                                                r"optstack train --out .* --resume"):
        train(cfg, out, progress=False, echo=press_ctrl_c_at_step_2)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    assert (out / "checkpoints" / "latest").read_text().strip().endswith("2")
    train(cfg, out, resume=True, progress=False, echo=lambda _: None)
    assert _metrics(out) == _metrics(straight)  # the resumed run repeats the uninterrupted one


def test_demo_resume_of_a_finished_run_changes_nothing(tmp_path):
    from optstack.demo.train import train

    cfg, out = _demo_config(), tmp_path / "run"
    first = train(cfg, out, progress=False, echo=lambda _: None)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    said: list[str] = []
    again = train(cfg, out, resume=True, progress=False, echo=said.append)
    assert again == first
    assert "finished" in said[0] and "nothing to do" in said[0]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


# -- 10: migration errors say what to do instead ----------------------------------------------------------------


def test_torch_style_param_groups_point_to_rules_and_optstack_optim():
    model = _model()
    groups = [{"params": list(model[0].parameters()), "weight_decay": 0.0}, {"params": list(model[2].parameters())}]
    with pytest.raises(ValueError, match=r"torch-style param groups .*settings 'weight_decay'.*rules=default_rules"
                                         r"\(config\) \+ \[Rule\(Name.*use optstack\.optim"):
        build_optimizer(OptimizerConfig(), groups)


def test_deepcopy_of_the_optimizer_says_what_to_copy_instead():
    import copy

    opt = build_optimizer(OptimizerConfig(), _model()).optimizer
    with pytest.raises(TypeError, match=r"copy\.deepcopy\(optimizer\.state_dict\(\)\).*deepcopy the model, then "
                                        r"build_optimizer"):
        copy.deepcopy(opt)


def test_an_optimizer_class_or_object_as_algorithm_names_the_string_to_pass():
    from optstack.rules import Name, Rule

    with pytest.raises(ValueError, match=r"got an optimizer class \(AdamW\).*algorithm='adamw' .* or "
                                         r"algorithm='torch\.optim\.AdamW'"):
        OptimizerConfig(algorithm=torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"got an optimizer class \(RMSprop\).*Pass algorithm='torch\.optim\.RMSprop'"):
        OptimizerConfig(algorithm=torch.optim.RMSprop)
    with pytest.raises(ValueError, match=r"got an optimizer object \(SGD\).*algorithm='sgd'"):
        OptimizerConfig(algorithm=torch.optim.SGD(_model().parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"Rule\(Name\('0\.\*'\)\): algorithm must be a non-empty optimizer name, got "
                                         r"an optimizer class \(Adam\).*Pass algorithm='adam'"):
        Rule(Name("0.*"), algorithm=torch.optim.Adam)


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"learning_rate": 3e-4}, "no field 'learning_rate': use lr=..."),
    ({"betas": (0.9, 0.95)}, "no field 'betas': use adam=AdamConfig(beta1=..., beta2=...)"),
    ({"max_grad_norm": 1.0}, "no field 'max_grad_norm': use clip_grad=..."),
    ({"weight_decy": 0.1}, "no field 'weight_decy' (did you mean 'weight_decay'?)"),
])
def test_foreign_config_names_say_which_field_to_use(kwargs, says):
    with pytest.raises(TypeError) as raised:
        OptimizerConfig(**kwargs)
    assert says in str(raised.value) and "Its fields are algorithm, lr, " in str(raised.value)


def test_another_models_state_dict_says_so_without_jargon():
    ours = build_optimizer(OptimizerConfig(), _model()).optimizer
    other_model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 5))  # same names, other head
    other = build_optimizer(OptimizerConfig(), other_model).optimizer
    other_model(torch.randn(2, 8)).sum().backward()
    other.step()
    with pytest.raises(ValueError) as raised:
        ours.load_state_dict(other.state_dict())
    message = str(raised.value)
    assert "'exp_avg' of parameter '2.weight' has 80 elements, but '2.weight' has 64 (shape (4, 16))" in message
    assert "saved with another model" in message and "model.load_state_dict" in message
    assert "stage" not in message and "DCP" not in message and "layout" not in message


# -- 11: the demo's plots -----------------------------------------------------------------------------------------


def test_demo_groups_have_distinct_labels_and_lr_lines_stay_visible():
    pytest.importorskip("matplotlib", reason="needs the demo extra")
    from optstack.demo.gpt import GPT
    from optstack.demo.plots import lr_figure
    from optstack.demo.train import group_label, make_optimizer

    cfg = _demo_config()
    groups = make_optimizer(cfg, GPT(cfg.model)).optimizer.param_groups
    labels = [group_label(i, g, "adamw") for i, g in enumerate(groups)]
    assert [label.split(" (")[0] for label in labels] == ["0: default", "1: wd_mult=0"]  # was "default" twice
    rows = [{"step": s, "group_lr": [0.1 * s, 0.1 * s]} for s in (1, 2, 3)]  # one schedule: the lines coincide
    lines = lr_figure(rows, labels).axes[0].get_lines()
    assert [line.get_label() for line in lines] == labels
    assert len({(line.get_linestyle(), line.get_linewidth()) for line in lines}) == 2


def test_grad_norm_plot_marks_the_clip_value():
    pytest.importorskip("matplotlib", reason="needs the demo extra")
    from optstack.demo.plots import grad_norm_figure

    rows = [{"step": s, "grad_norm": 3.0 / s} for s in (1, 2, 3)]
    lines = grad_norm_figure(rows, clip_grad=1.0).axes[0].get_lines()
    assert [list(line.get_ydata()) for line in lines if "clipped" in line.get_label()] == [[1.0, 1.0]]
    assert len(grad_norm_figure(rows, clip_grad=0.0).axes[0].get_lines()) == 1  # no clipping, no line


def test_demo_without_matplotlib_says_the_plots_were_skipped(tmp_path, monkeypatch):
    import sys

    from optstack.demo.train import train

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the core install: no demo extra
    said: list[str] = []
    train(_demo_config(), tmp_path / "run", progress=False, echo=said.append)
    assert any(line.startswith("plots skipped: matplotlib is not installed") and "optstack[demo]" in line
               for line in said)
    assert not list((tmp_path / "run").glob("*.png")) and (tmp_path / "run" / "summary.json").is_file()


def test_demo_second_ctrl_c_quits_at_once_and_says_there_is_nothing_to_resume(tmp_path):
    import signal

    from optstack.demo.train import train

    def press_ctrl_c_twice_at_step_2(line: str) -> None:
        if line.startswith("step 2/"):
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt, match=r"interrupted at step 2, before any checkpoint was saved: nothing to "
                                                r"resume; start the run again \(without --resume\)"):
        train(_demo_config(), out, progress=False, echo=press_ctrl_c_twice_at_step_2)
    assert not (out / "checkpoints" / "latest").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
