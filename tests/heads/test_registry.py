"""The drafter-kind registry: a kind defined entirely in this file, registered, and taken through
``headway train`` -> save -> ``load_drafter`` -> ``headway info`` -> generate (greedy equal to
``generate``), with no package file touched; and headway's own kinds read from the registry."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from headway import cli
from headway.heads import Drafter, load_drafter
from headway.heads.base import DrafterConfig
from headway.heads.hub.info import describe_checkpoint
from headway.heads.registry import (DrafterKind, TrainingMethod, get_kind, head_class, kind_of, kind_of_config,
                                    kinds, register_kind, training_methods, unregister_kind)
from headway.inference import SpeculativeGenerator, as_proposer
from headway.inference.proposer import Draft, DraftContext, Proposer
from headway.inference.tree import chain
from headway.train.common import parse_run_args, run_main, setup_run
from headway.train.config import to_dict
from headway.train.data import DataConfig
from headway.train.loop import Method, TrainConfig, run_training


# --- the toy kind: a bigram table that proposes a chain from the root token ----------------------

@dataclasses.dataclass
class BigramConfig(DrafterConfig):
    depth: int = 3  # draft tokens per round

    drafter_type_name = "toy-bigram"


class BigramHead(Drafter):
    """logits of the token after token t: ``table[t]`` [V]."""

    config_class = BigramConfig

    def __init__(self, config: BigramConfig):
        super().__init__(config)
        self.table = torch.nn.Parameter(torch.zeros(config.vocab_size, config.vocab_size))

    @classmethod
    def from_target(cls, target, **fields) -> "BigramHead":
        return cls(BigramConfig(hidden_size=target.config.hidden_size, vocab_size=target.config.vocab_size, **fields))


class BigramProposer(Proposer):
    def __init__(self, head: BigramHead):
        self.head = head.eval()

    def bind(self, target_model) -> None:
        self.head.check_target(target_model)

    def default_tree(self):
        return chain(self.head.config.depth)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        depth = min(self.head.config.depth, ctx.max_depth)
        tokens = [int(ctx.tokens[-1])]
        for _ in range(depth):
            tokens.append(int(self.head.table[tokens[-1]].argmax()))
        return Draft(chain(depth), torch.tensor(tokens, device=ctx.tokens.device))


class BigramModule(torch.nn.Module):
    def __init__(self, head: BigramHead):
        super().__init__()
        self.head = head

    def forward(self, batch):
        ids, mask = batch["input_ids"], batch["loss_mask"][:, 1:].bool()  # token t+1 after token t
        logits = self.head.table[ids[:, :-1]][mask]  # [n, V]
        labels = ids[:, 1:][mask]
        loss = F.cross_entropy(logits, labels, reduction="sum")
        top5 = logits.topk(5, dim=-1).indices
        counts = {"head0/loss_sum": loss.detach(), "head0/top1": (logits.argmax(-1) == labels).sum(),
                  "head0/top5": (top5 == labels[:, None]).any(-1).sum(), "head0/count": mask.sum()}
        return loss / mask.sum().clamp(min=1), counts


class BigramMethod(Method):
    def __init__(self, head: BigramHead):
        self.model = BigramModule(head)

    def export(self, model, output_dir: Path, metrics: dict) -> None:
        model.head.save_pretrained(output_dir, metrics=metrics)


@dataclasses.dataclass
class BigramRunConfig:
    model: str = "tiny-random-llama"
    features: str = "online"
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    head: BigramConfig = dataclasses.field(default_factory=BigramConfig)
    train: TrainConfig = dataclasses.field(default_factory=lambda: TrainConfig(output_dir="outputs/toy"))


class BigramTraining:
    """The training entry point of the toy kind (``headway train toy``)."""

    RunConfig = BigramRunConfig

    @staticmethod
    def feature_layers(cfg, depth: int) -> list[int]:
        return []

    @staticmethod
    def train(cfg: BigramRunConfig) -> dict:
        run = setup_run(cfg.model, cfg.features, cfg.data, cfg.train)
        head = BigramHead.from_target(run.target, depth=cfg.head.depth, base_model_name_or_path=cfg.model)
        return run_training(run.acc, cfg.train, BigramMethod(head), run.train_data, run.eval_data,
                            run_config=to_dict(cfg))

    @staticmethod
    def main(argv=None, exit_process: bool = False) -> dict:
        parse = lambda a: parse_run_args(BigramRunConfig, "Train a bigram drafter.", "toy/none", a)  # noqa: E731
        return run_main(BigramTraining.train, parse, argv, exit_process)


TOY = DrafterKind(name="toy", title="Toy bigram", drafter_type="toy-bigram", head_class=BigramHead,
                  proposer=BigramProposer, training={"toy": TrainingMethod(BigramTraining, "a toy bigram drafter")},
                  info_fields=("depth",), describe=lambda info: f"a bigram table proposing {info['depth']} tokens")


@pytest.fixture
def toy_kind():
    register_kind(TOY)
    yield TOY
    unregister_kind("toy")


def test_a_kind_defined_in_a_test_trains_saves_loads_describes_and_generates(toy_kind, tmp_path, tiny_llama, capsys):
    config = tmp_path / "toy.yaml"
    config.write_text(json.dumps({"data": {"source": "packaged", "max_length": 64, "max_examples": 200,
                                           "heldout_fraction": 0.1},
                                  "head": {"depth": 3},
                                  "train": {"batch_size": 16, "max_steps": 25, "lr": 0.3, "trackers": [],
                                            "log_every": 5, "num_threads": 1}}))
    out = tmp_path / "run"
    assert "toy" in training_methods()
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", "--help"])  # the command line's method list reads the registry
    assert "toy" in shown.getvalue()
    assert cli.main(["train", "toy", "--config", str(config), f"train.output_dir={out}"]) == 0
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if "eval/head0/loss" in e]
    assert evals[-1]["eval/head0/loss"] < 0.8 * evals[0]["eval/head0/loss"], evals  # it learned

    head = load_drafter(out)  # the registry's drafter_type -> class
    assert type(head) is BigramHead and head.config.depth == 3 and kind_of(head) is toy_kind
    assert head_class({"drafter_type": "toy-bigram"}) is BigramHead

    info = describe_checkpoint(out)
    assert info["kind"] == "toy" and info["depth"] == 3
    assert info["description"] == "a bigram table proposing 3 tokens"
    assert "Toy bigram drafter" in (out / "README.md").read_text()  # the card's title
    capsys.readouterr()
    assert cli.main(["info", str(out)]) == 0
    assert "a bigram table proposing 3 tokens" in capsys.readouterr().out

    target, _ = tiny_llama
    assert isinstance(as_proposer(head), BigramProposer)
    gen = SpeculativeGenerator(target, head, tree="chain-3")  # drafts every round (tree="auto" may decline a weak drafter)
    g = torch.Generator().manual_seed(0)
    for n in (5, 9, 14):
        ids = torch.randint(4, target.config.vocab_size, (1, n), generator=g)
        got = gen.generate(ids, max_new_tokens=20)
        want = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20)
        assert got.sequences[0].tolist() == want[0].tolist()
        assert max(got.stats.draft_depth_per_step) == 3


def test_headway_kinds_come_from_the_registry():
    from headway.heads.formats import eagle as eagle_formats, medusa as medusa_formats
    from headway.heads.formats.convert import FORMATS
    from headway.heads.eagle import Eagle1Head, Eagle3Head, EagleHead
    from headway.heads.medusa import MedusaHeads
    from headway.inference.eagle import EagleProposer
    from headway.inference.medusa import MedusaProposer

    assert [k.name for k in kinds()][:3] == ["medusa", "eagle", "eagle3"]
    medusa, eagle1, eagle3 = get_kind("medusa"), get_kind("eagle"), get_kind("eagle3")
    assert medusa.head is MedusaHeads and eagle1.head is Eagle1Head and eagle3.head is Eagle3Head
    assert issubclass(Eagle1Head, EagleHead) and issubclass(Eagle3Head, EagleHead)
    assert medusa.exports == medusa_formats.FORMATS and eagle1.exports + eagle3.exports == eagle_formats.FORMATS
    assert all(set(k.exports) <= set(FORMATS) and set(k.imports) <= set(FORMATS) for k in kinds())
    assert kind_of_config({"drafter_type": "eagle", "version": 1}) is eagle1
    assert kind_of_config({"drafter_type": "eagle", "version": 3}) is eagle3
    assert kind_of_config({"drafter_type": "nothing"}) is None
    assert list(training_methods())[:3] == ["medusa", "medusa2", "eagle"]
    from headway.heads.registry import resolve

    assert resolve(medusa.proposer) is MedusaProposer and resolve(eagle3.proposer) is EagleProposer
    for method in training_methods().values():
        entry = resolve(method.entry)
        assert callable(entry.main) and dataclasses.is_dataclass(entry.RunConfig) and callable(entry.feature_layers)


def test_registering_something_else_is_refused():
    with pytest.raises(TypeError, match="register_kind takes a DrafterKind"):
        register_kind("medusa")
    with pytest.raises(ValueError, match="unknown drafter kind 'nope'; known: \\['medusa'"):
        get_kind("nope")


def test_a_saved_drafters_kind_is_read_from_its_config_alone(tmp_path):
    """``saved_kind``: the kind a saved folder's config.json names (no weights read: the CLI refuses a flag a kind
    cannot take before any model loads); None for a missing folder, a foreign or unreadable config."""
    from headway.heads.layerskip import LayerSkipHead
    from headway.heads.registry import saved_kind
    from headway.heads.target.tiny import build_tiny_target

    target, _ = build_tiny_target("llama", seed=0)
    LayerSkipHead.from_target(target, exit_layer=1).save_pretrained(tmp_path / "ls")
    (tmp_path / "ls" / "model.safetensors").unlink()  # the config alone tells
    assert saved_kind(tmp_path / "ls").name == "layerskip"
    assert saved_kind(tmp_path / "missing") is None
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert saved_kind(tmp_path / "foreign") is None and saved_kind(tmp_path / "broken") is None
