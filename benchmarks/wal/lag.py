"""The lag of a run's lookups, from the trainer's Prometheus histograms (``lightning_persia.strategy.metrics``).

Per training step, how many earlier steps' embedding updates were still unacknowledged when its lookup went out
(``at_issue``: the most its rows can have missed) and when the lookup was answered (``at_answer``: a retried
lookup, answered after its shard restarted, sees the updates that landed while it waited). Each figure is a mean
over the steps and the count of steps per lag (the histogram's buckets 0, 1, 2, 3, 4 are one value each).
"""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = {"at_issue": "persia_trainer_embedding_lag_steps", "at_answer": "persia_trainer_embedding_lag_at_answer_steps"}


def lag_figures(scrape: str) -> dict[str, dict]:
    """The figures of a trainer's metrics page (``scrape``: the text served at ``PersiaStrategy.metrics_url``):
    ``{"at_issue": {"mean": m, "steps": n, "counts": {"0": c0, "1": c1, ..., "+Inf": ...}}, "at_answer": ...}``."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    out = {}
    for key, name in HISTOGRAMS.items():
        if f"{name}_count" not in samples:
            raise ValueError(f"the metrics hold no histogram {name!r}: was the strategy made with metrics=MetricsEndpoint(...)?")
        steps = samples[f"{name}_count"][0].value
        total = samples[f"{name}_sum"][0].value
        counts, below = {}, 0.0
        for sample in sorted(samples[f"{name}_bucket"], key=lambda s: float(s.labels["le"])):
            counts[_label(sample.labels["le"])] = int(sample.value - below)
            below = sample.value
        out[key] = {"mean": round(total / steps, 4) if steps else 0.0, "steps": int(steps),
                    "counts": {k: v for k, v in counts.items() if v}}
    return out


def _label(bound: str) -> str:
    """``"4.0"`` -> ``"4"``; ``"+Inf"`` stays."""
    value = float(bound)
    return str(int(value)) if value.is_integer() else bound


def mean_lag(runs: list[dict], key: str) -> float:
    """The mean lag (``key``: ``at_issue`` or ``at_answer``) over the steps of ``runs`` (their ``lag`` figures)."""
    steps = sum(run[key]["steps"] for run in runs)
    return round(sum(run[key]["mean"] * run[key]["steps"] for run in runs) / steps, 4) if steps else 0.0
