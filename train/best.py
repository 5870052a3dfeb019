"""``train.select_best``: export the drafter of the evaluation that scored best, not the last one.

SpecForge keeps the checkpoint with the highest held-out simulated acceptance length; headway does
the same with ``train.select_best=simulated_tau`` (that figure plus the bonus token: the same order).
Each evaluation after step 0 that beats the best so far (strictly) writes the trainable weights and
the metrics to ``<output_dir>/best/`` atomically; a resumed run reads them back when they predate its
checkpoint. At the end the loop exports that drafter with its metrics (``selected_step`` says which).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from headway.heads.files import atomic_write_text, save_safetensors
from headway.train.accelerator import gathered
from headway.train import fsdp as fsdp_mod

CHOICES = ("last", "simulated_tau")  # higher is better for every named metric
FOLDER = "best"
WEIGHTS, RECORD = "trainable.safetensors", "best.json"


def check_choice(name: str) -> None:
    if name not in CHOICES:
        raise ValueError(f"select_best must be one of {', '.join(CHOICES)} (the held-out metric whose best "
                         f"evaluation is exported), got {name!r}")


class BestKeeper:
    """The best evaluation so far of one run: its step and score, its weights on disk (main process)."""

    def __init__(self, out: Path, metric: str, is_main: bool):
        check_choice(metric)
        self.folder, self.metric, self.is_main = Path(out) / FOLDER, metric, is_main
        self.step: int | None = None
        self.score = float("-inf")
        self.metrics: dict | None = None

    @property
    def active(self) -> bool:
        return self.metric != "last"

    def restore(self, resumed_step: int) -> None:
        """Read a best written before the checkpoint this run resumed from (a later one is stale: the
        steps after the checkpoint are trained again)."""
        record = self.folder / RECORD
        if not self.active or not record.is_file() or not (self.folder / WEIGHTS).is_file():
            return
        saved = json.loads(record.read_text())
        if saved.get("metric") == self.metric and saved["step"] <= resumed_step:
            self.step, self.score, self.metrics = saved["step"], saved["score"], saved["metrics"]

    def consider(self, acc, step: int, metrics: dict, model: torch.nn.Module, fsdp: bool) -> bool:
        """Keep this evaluation's drafter if it beats the best (every rank calls it: the metrics are
        reduced, so every rank decides alike; sharded weights are gathered collectively)."""
        score = metrics.get(self.metric)
        if not self.active or step == 0 or score is None or not score > self.score:
            return False
        if fsdp:
            state = fsdp_mod.trainable_state(model)  # collective
        else:
            with gathered(acc, model):
                state = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
        if self.is_main:
            save_safetensors(state, self.folder / WEIGHTS)
            atomic_write_text(self.folder / RECORD, json.dumps({"metric": self.metric, "step": step, "score": score,
                                                                "metrics": metrics}, indent=2))
        self.step, self.score, self.metrics = step, score, metrics
        return True

    def chosen(self, last_step: int, last: dict) -> dict:
        """The metrics of the drafter the run exports: the best evaluation's (``selected_step`` says
        which step), or ``last`` unchanged when nothing is selected."""
        if not self.active:
            return last
        if self.step is None or self.step == last_step or self.metrics is None:
            return {**last, "selected_step": last_step}
        return {**self.metrics, "selected_step": self.step}

    def load_into(self, model: torch.nn.Module, last_step: int) -> bool:
        """Put the best drafter's weights into ``model`` (the main process, with whole weights: after
        the loop's gather or unshard); False when the last evaluation is the best."""
        if not self.active or self.step is None or self.step == last_step:
            return False
        state = load_file(str(self.folder / WEIGHTS))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))
        return True
