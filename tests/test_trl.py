"""hfstream with TRL and other `TrainingArguments` subclasses: combining the arguments, and
`StreamTrainerMixin` on TRL's `SFTTrainer` training exactly like the stock `SFTTrainer`.

``@dataclass class Args(StreamTrainingArguments, SFTConfig)`` would silently give every field
``SFTConfig`` overrides (``bf16``, ``gradient_checkpointing``, ``learning_rate``, ...) the
`TrainingArguments` default again; hfstream refuses it. ``stream_arguments(SFTConfig)``, or
``class Args(SFTConfig, StreamTrainingArguments)``, keeps them. The TRL tests skip without trl
(``pip install -e .[dev]`` installs it); the generic ones run always.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser, TrainingArguments

from hfstream import StreamTrainingArguments, stream_arguments

STREAM_FIELDS = ("prefetch_depth", "grad_sync", "grad_bucket_mb", "grad_comm_dtype", "comm_stream_priority",
                 "step_watchdog_s", "stream_report", "save_async")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sft_config():
    return pytest.importorskip("trl").SFTConfig


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            out[f.name] = ("factory", f.default_factory())
        else:
            out[f.name] = f.default
    return out


# A project's own arguments class (no TRL needed): it overrides a plain default and a
# default_factory one of TrainingArguments, and adds a field.
@dataclass
class TeamArguments(TrainingArguments):
    learning_rate: float = field(default=3e-4, metadata={"help": "the team's learning rate"})
    include_for_metrics: list[str] = field(default_factory=lambda: ["inputs"], metadata={"help": "for metrics"})
    team: str = field(default="vision", metadata={"help": "who runs this"})


# A user's subclass of the combined class, at module level so that it pickles by name.
@dataclass
class TeamStreamArguments(stream_arguments(TeamArguments)):
    warmup_steps: float = 7


# ----------------------------------------------------------------------------------- the helper
def test_helper_keeps_every_sftconfig_default_and_adds_hfstream_fields(sft_config):
    cls = stream_arguments(sft_config)
    assert cls is stream_arguments(sft_config)                       # one class per base
    assert cls.__name__ == "StreamSFTConfig" and dataclasses.is_dataclass(cls)
    assert issubclass(cls, sft_config) and issubclass(cls, StreamTrainingArguments)
    got, sft, stream = _defaults(cls), _defaults(sft_config), _defaults(StreamTrainingArguments)
    speed = StreamTrainingArguments.SPEED_DEFAULTS       # hfstream's faster defaults (same results) stand
    assert {k: got[k] for k in sft if k not in speed} == {k: v for k, v in sft.items() if k not in speed}
    assert {k: got[k] for k in speed} == {k: stream[k] for k in speed}
    assert {k: got[k] for k in STREAM_FIELDS} == {k: stream[k] for k in STREAM_FIELDS}
    assert set(got) == set(sft) | set(STREAM_FIELDS)
    # The instance too, after both __post_init__ ran (SFTConfig turns bf16=None into True; on a
    # CPU that needs use_cpu=True, with or without hfstream).
    a, b = cls(output_dir="out", use_cpu=True), sft_config(output_dir="out", use_cpu=True)
    assert (a.bf16, a.gradient_checkpointing, a.learning_rate, a.logging_steps) == \
        (b.bf16, b.gradient_checkpointing, b.learning_rate, b.logging_steps)
    assert {k: v for k, v in a.to_dict().items() if k not in STREAM_FIELDS + speed} == \
        {k: v for k, v in b.to_dict().items() if k not in speed}


def test_helper_parses_a_flag_of_each_parent(sft_config, tmp_path):
    parser = HfArgumentParser(stream_arguments(sft_config))
    assert "--prefetch_depth" in parser.format_help() and "--max_length" in parser.format_help()
    (a,) = parser.parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--use_cpu", "--max_length", "128", "--packing",   # SFTConfig's
        "--learning_rate", "1e-4",                                                        # TrainingArguments'
        "--prefetch_depth", "0", "--grad_sync", "native", "--grad_bucket_mb", "8"])       # hfstream's
    assert (a.max_length, a.packing, a.learning_rate) == (128, True, 1e-4)
    assert (a.prefetch_depth, a.grad_sync, a.grad_bucket_mb) == (0, "native", 8.0)
    assert (a.bf16, a.gradient_checkpointing, a.logging_steps) == (True, True, 10)      # defaults kept


def test_helper_instances_pickle_and_deepcopy(tmp_path):
    """Trainer saves the arguments into each checkpoint (training_args.bin) with torch.save."""
    cls = stream_arguments(TeamArguments)
    a = cls(output_dir=str(tmp_path), prefetch_depth=3, team="nlp", report_to=[])
    for b in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a), copy.copy(a)):
        assert type(b) is cls and b == a and (b.prefetch_depth, b.team, b.learning_rate) == (3, "nlp", 3e-4)
    sub = TeamStreamArguments(output_dir=str(tmp_path), report_to=[])
    assert pickle.loads(pickle.dumps(sub)) == sub and type(copy.deepcopy(sub)) is TeamStreamArguments
    # A fresh process that has never built the class loads it from the file.
    torch.save(a, tmp_path / "training_args.bin")
    code = ("import sys, torch; sys.path.insert(0, 'tests'); "
            f"b = torch.load({str(tmp_path / 'training_args.bin')!r}, weights_only=False); "
            "print(type(b).__name__, b.prefetch_depth, b.team, b.learning_rate)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["StreamTeamArguments", "3", "nlp", "0.0003"]


def test_helper_with_any_training_arguments_subclass(tmp_path):
    cls = stream_arguments(TeamArguments)
    assert cls.__name__ == "StreamTeamArguments" and cls is stream_arguments(TeamArguments)
    a = cls(output_dir=str(tmp_path), report_to=[])
    assert (a.learning_rate, a.include_for_metrics, a.team, a.prefetch_depth) == (3e-4, ["inputs"], "vision", 2)
    assert stream_arguments(TrainingArguments) is StreamTrainingArguments
    assert stream_arguments(StreamTrainingArguments) is StreamTrainingArguments
    assert stream_arguments(TeamStreamArguments) is TeamStreamArguments
    with pytest.raises(TypeError, match="TrainingArguments subclass"):
        stream_arguments(dict)
    with pytest.raises(TypeError, match="TrainingArguments subclass"):
        stream_arguments(["not", "a", "class"])
    methods_only = type("MethodsOnly", (TeamArguments,), {"tag": lambda self: "x"})   # no @dataclass, no field
    b = stream_arguments(methods_only)(output_dir=str(tmp_path), report_to=[])
    assert (b.tag(), b.team, b.learning_rate, b.prefetch_depth) == ("x", "vision", 3e-4, 2)


@pytest.mark.parametrize("name", ["SFTConfig", "DPOConfig", "GRPOConfig", "KTOConfig", "RLOOConfig", "RewardConfig"])
def test_helper_and_check_with_each_trl_config(name):
    """Class-level only (no instance: some of these configs check their own fields on creation)."""
    from hfstream.trainer.field_defaults import _lost_defaults

    base = getattr(pytest.importorskip("trl"), name, None)
    if base is None:
        pytest.skip(f"this trl has no {name}")
    cls = stream_arguments(base)
    assert _lost_defaults(cls) == ()
    speed = StreamTrainingArguments.SPEED_DEFAULTS       # hfstream's faster defaults (same results) stand
    assert {k: v for k, v in _defaults(cls).items() if k not in STREAM_FIELDS + speed} == \
        {k: v for k, v in _defaults(base).items() if k not in speed}
    ta, own = _defaults(TrainingArguments), _defaults(base)
    overridden = {k for k in ta if own[k] != ta[k]}                      # bf16, logging_steps, ... at least
    wrong = dataclass(type("Wrong", (StreamTrainingArguments, base), {}))
    assert overridden and {f for f, *_ in _lost_defaults(wrong)} == overridden


# ------------------------------------------------------------------------- the order of the bases
def test_wrong_order_is_refused_naming_the_lost_fields(sft_config, tmp_path):
    @dataclass
    class Args(StreamTrainingArguments, sft_config):
        pass

    with pytest.raises(TypeError) as err:
        Args(output_dir=str(tmp_path), use_cpu=True)
    msg = str(err.value)
    assert "learning_rate: SFTConfig says 2e-05, Args has 5e-05" in msg
    assert "bf16" in msg and "gradient_checkpointing" in msg
    assert "class Args(SFTConfig, StreamTrainingArguments)" in msg and "stream_arguments(SFTConfig)" in msg
    with pytest.raises(TypeError, match="learning_rate"):                # the command line says the same
        HfArgumentParser(Args).parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu"])


def test_wrong_order_is_refused_for_any_subclass_and_default_factories(tmp_path):
    @dataclass
    class Args(StreamTrainingArguments, TeamArguments):
        pass

    with pytest.raises(TypeError, match=r"include_for_metrics: TeamArguments says .*, Args has list\(\)") as err:
        Args(output_dir=str(tmp_path), report_to=[])
    assert "learning_rate: TeamArguments says 0.0003" in str(err.value)


def test_forgotten_dataclass_decorator_is_refused(sft_config, tmp_path):
    class Args(sft_config, StreamTrainingArguments):                    # no @dataclass: no hfstream fields
        pass

    with pytest.raises(TypeError, match="prefetch_depth.*decorate Args with @dataclass"):
        Args(output_dir=str(tmp_path), use_cpu=True)


def test_right_order_and_deliberate_overrides_are_accepted(sft_config, tmp_path):
    @dataclass
    class Args(sft_config, StreamTrainingArguments):
        pass

    a = Args(output_dir=str(tmp_path), use_cpu=True, grad_sync="native")
    assert (a.bf16, a.gradient_checkpointing, a.learning_rate, a.logging_steps, a.grad_sync) == \
        (True, True, 2e-5, 10, "native")

    @dataclass
    class Mine(StreamTrainingArguments):                                 # the user's own defaults win
        learning_rate: float = 1e-3
        logging_steps: float = 1
        include_for_metrics: list[str] = field(default_factory=lambda: ["loss"])
        prefetch_depth: int = 4

    m = Mine(output_dir=str(tmp_path), report_to=[])
    assert (m.learning_rate, m.logging_steps, m.include_for_metrics, m.prefetch_depth) == (1e-3, 1, ["loss"], 4)

    @dataclass
    class MineSFT(sft_config, StreamTrainingArguments):                  # own default over SFTConfig's
        learning_rate: float = 5e-5
        max_length: int | None = 256

    s = MineSFT(output_dir=str(tmp_path), use_cpu=True)
    assert (s.learning_rate, s.max_length, s.bf16, s.gradient_checkpointing) == (5e-5, 256, True, True)

    @dataclass
    class OnTop(stream_arguments(sft_config)):                           # a subclass of the helper's class
        logging_steps: float = 2

    o = OnTop(output_dir=str(tmp_path), use_cpu=True)
    assert (o.logging_steps, o.learning_rate, o.gradient_checkpointing) == (2, 2e-5, True)

    class Methods(StreamTrainingArguments):                              # no @dataclass, no new field: fine
        def tag(self):
            return "x"

    assert Methods(output_dir=str(tmp_path), report_to=[]).tag() == "x"
    assert StreamTrainingArguments(output_dir=str(tmp_path), report_to=[]).prefetch_depth == 2


# ------------------------------------------------------------------ SFTTrainer, 2 processes
def _sft_parity(rank, world_size, tmp):
    """Stock SFTTrainer + SFTConfig vs StreamTrainerMixin on SFTTrainer + stream_arguments(SFTConfig).

    SFTConfig's own defaults stay as they are (bf16=True autocast on CPU, gradient checkpointing,
    learning_rate 2e-5, linear decay); what a test must set is set on both: use_cpu=True (stock
    TrainingArguments refuses bf16 on a CPU without it, and would not train the two CPU ranks as
    one job), few steps, a log every step, no saving and no reporting.
    """
    import datasets
    from transformers import GPT2Config, GPT2LMHeadModel
    from trl import SFTConfig, SFTTrainer

    from hfstream import StreamTrainerMixin
    from hfstream.cli.data import byte_tokenizer

    class SFTStream(StreamTrainerMixin, SFTTrainer):
        pass

    datasets.disable_progress_bars()
    texts = [f"sample {i}: the quick brown fox jumps over {i % 7} lazy dogs{'!' * (i % 5)}" for i in range(64)]
    common = dict(max_steps=6, per_device_train_batch_size=4, logging_steps=1, save_strategy="no", report_to=[],
                  seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, max_length=64)
    runs = {}
    for name, trainer_cls, args_cls, kw in (
        ("stock", SFTTrainer, SFTConfig, {}),
        ("off", SFTStream, stream_arguments(SFTConfig), dict(prefetch_depth=0, grad_sync="native")),
        ("default", SFTStream, stream_arguments(SFTConfig), {}),          # prefetch 2, grad_sync auto (overlap)
        ("sharded", SFTStream, stream_arguments(SFTConfig), dict(grad_sync="sharded")),   # bf16 on: no scaler
    ):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                           bos_token_id=256, eos_token_id=256, pad_token_id=256))
        args = args_cls(output_dir=f"{tmp}/{name}", **common, **kw)
        trainer = trainer_cls(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                              processing_class=byte_tokenizer())
        trainer.train()
        runs[name] = dict(
            losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
            params={k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            config=(args.bf16, args.gradient_checkpointing, args.learning_rate, args.lr_scheduler_type,
                    trainer.accelerator.mixed_precision, trainer.model.is_gradient_checkpointing,
                    trainer.accelerator.num_processes),
            mode=getattr(trainer, "grad_sync_mode", "stock"),
        )
    return runs


@pytest.mark.multiprocess
def test_sft_trainer_with_stream_mixin_trains_like_stock_sft_trainer(tmp_path, run_distributed):
    pytest.importorskip("trl")
    ranks = run_distributed(_sft_parity, 2, str(tmp_path), init_process_group=False, timeout=280)
    for runs in ranks:
        stock = runs["stock"]
        assert stock["config"] == (True, True, 2e-5, "linear", "bf16", True, 2)   # SFTConfig's defaults, on 2 ranks
        assert len(stock["losses"]) == 6
        for name in ("off", "default", "sharded"):
            assert runs[name]["config"] == stock["config"], name
        # hfstream off: bit-identical to the stock SFTTrainer.
        assert runs["off"]["losses"] == stock["losses"]
        for k, v in stock["params"].items():
            assert torch.equal(runs["off"]["params"][k], v), k
        # hfstream's defaults (prefetching, overlapped gradient sync): same training (bit-identical
        # when measured on 2 CPU ranks; the tolerance is that of test_trainer_overlap.py).
        assert runs["default"]["mode"] == "overlap"
        _assert_close(runs["default"]["losses"], stock["losses"])
        for k, v in stock["params"].items():
            _assert_close(runs["default"]["params"][k], v, msg=k)
        # Sharded: each rank steps half of SFTConfig's AdamW; the logged losses and the parameters
        # are those of the stock run.
        assert runs["sharded"]["mode"] == "sharded"
        _assert_close(runs["sharded"]["losses"], stock["losses"])
        for k, v in stock["params"].items():
            _assert_close(runs["sharded"]["params"][k], v, msg=k)
    for k, v in ranks[0]["default"]["params"].items():                 # the replicas stay identical
        assert torch.equal(v, ranks[1]["default"]["params"][k]), k


def _assert_close(got, want, msg=None):
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-5, atol=1e-6, msg=msg)
