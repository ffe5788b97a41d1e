"""Small tables kept on every trainer (TorchRec's data-parallel placement) and trained without staleness.

A table of a few hundred rows is touched by every batch. On the parameter server its rows would train
like dense weights with a delay of up to ``staleness`` steps, which costs accuracy, and each of its lookups
would cost a round trip for a few kilobytes. ``PersiaStrategy(data_parallel_max_rows=N)`` keeps the
tables of a TorchRec collection that have at most ``N`` rows on the trainer instead:

* a collection's kept tables share one flat parameter (FBGEMM's table-batched layout), pooled by the same
  kernel as the remote rows (:func:`~lightning_persia.ops.pooled_lookup.pooled_lookup`);
* DDP all-reduces its gradient with the dense ones, so every replica stays identical;
* after each backward, :meth:`DataParallelTables.apply_gradients` runs the table's own sparse rule (the one
  the shards would run, row-wise Adagrad by default) on the rows whose gradient is not zero, then drops
  the gradient so that the LightningModule's optimizer leaves the rows alone;
* the rule's state is a buffer: checkpoints carry it with the weights.

Rows start from the parameter server's deterministic initialiser, so a table gets the same first values
wherever it is placed. The ids of a feature the data gives as vocabulary ids (``raw_features``: the data module's
``ids: raw``, :class:`~lightning_persia.data.transform.DataTransform`) index a kept table's rows directly, and one
outside them is an error; hashed ids are folded into the rows modulo the table's size (a remote table takes any
id; see :meth:`DataParallelTables.rows_of`).
"""
from __future__ import annotations

from itertools import accumulate
from typing import Iterable, Optional, Union

import torch
from torch import nn

from lightning_persia.embedding.transfer import small_tensor
from lightning_persia.ops.pooled_lookup import FlatLayout, FusedArguments, pooled_lookup
from lightning_persia.remote_ps.store.initializers import initial_rows
from lightning_persia.remote_ps.store.optimizers import SparseRule, make_rule
from lightning_persia.remote_ps.table_config import TableConfig


def _apply_rule(
    rule: SparseRule, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, touched: torch.Tensor,
    scale: float, bound: Optional[float],
) -> None:
    """``rule`` on the ``touched`` rows of a block, in float32 whatever the weights' dtype."""
    row_weights, row_state, row_grads = weights[touched].float(), state[touched], grads[touched].float()
    rule.apply(row_weights, row_state, row_grads * scale if scale != 1.0 else row_grads)
    if bound is not None:
        row_weights.clamp_(-bound, bound)
    weights[touched] = row_weights.to(weights.dtype)
    state[touched] = row_state


class DataParallelTables(nn.Module):
    """The kept-local tables of one collection: one flat weight, one flat optimizer state.

    Example::

        tables = DataParallelTables([TableConfig("ebc.t0", dim=8)], num_embeddings=[100], features=[("f0",)], seed=0)
        pooled = tables.pooled(tables.rows_of(kjt.values(), kjt.length_per_key()), kjt.offsets(), "sum", None)  # [B, 8]
        pooled.sum().backward()
        tables.apply_gradients(scale=1.0)
    """

    def __init__(
        self, configs: list[TableConfig], num_embeddings: list[int], features: list[tuple[str, ...]], seed: int,
        raw_features: Iterable[str] = (),
    ) -> None:
        super().__init__()
        self.configs = list(configs)
        self.num_embeddings = list(num_embeddings)
        self.features = [f for names in features for f in names]
        self.feature_tables = tuple(t for t, names in enumerate(features) for _ in names)
        dims = [c.dim for c in self.configs]
        self.layout = FlatLayout(rows=tuple(self.num_embeddings), dims=tuple(dims), feature_tables=self.feature_tables)
        # Neighbouring tables with the same rule, dim and bound are updated as one block of rows.
        self._segments: list[tuple[int, int, SparseRule, Optional[float]]] = []
        for table, config in enumerate(self.configs):
            rule = self._segments[-1][2] if self._segments else None
            if rule is not None and (rule.config, rule.dim, self._segments[-1][3]) == (config.optimizer, config.dim, config.weight_bound):
                self._segments[-1] = (self._segments[-1][0], table + 1, rule, config.weight_bound)
            else:
                self._segments.append((table, table + 1, make_rule(config.optimizer, config.dim, kernel_order=False),
                                       config.weight_bound))
        widths = [rule.state_width for first, stop, rule, _ in self._segments for _ in range(first, stop)]
        self._state_offsets = [0, *accumulate(n * w for n, w in zip(self.num_embeddings, widths))]
        self.weight = nn.Parameter(torch.cat([
            initial_rows(c.init, seed, c.name, torch.arange(n), c.dim).flatten() for c, n in zip(self.configs, self.num_embeddings)
        ]))
        self.register_buffer("optimizer_state", torch.cat([
            rule.initial_state(sum(self.num_embeddings[first:stop])).flatten() for first, stop, rule, _ in self._segments
        ]))
        self._dropped = 0
        self._dropped_on_device: Optional[torch.Tensor] = None  # counted on a GPU without reading the count back
        self._fused: Optional[FusedArguments] = None  # the layout's fused-lookup arguments on the weight's device
        self.register_buffer("_rows_per_feature", torch.tensor([self.num_embeddings[t] for t in self.feature_tables]), persistent=False)
        raw = set(raw_features)
        #: the features whose ids index the rows as they are (the others are folded modulo the table's size)
        self.raw_features = tuple(f for f in self.features if f in raw)
        self.register_buffer("_raw_per_feature", torch.tensor([f in raw for f in self.features], dtype=torch.bool), persistent=False)

    @property
    def dropped_nonfinite_rows(self) -> int:
        """Gradient rows left alone because they were not finite, so far."""
        on_device = int(self._dropped_on_device) if self._dropped_on_device is not None else 0
        return self._dropped + on_device

    def raw_feature_rows(self) -> dict[str, int]:
        """The rows of the table each of :attr:`raw_features` indexes (its ids must lie in ``[0, rows)``)."""
        return {f: self.num_embeddings[t] for f, t in zip(self.features, self.feature_tables) if f in self.raw_features}

    def table_view(self, table: int) -> torch.Tensor:
        """Rows of table ``table`` as ``[num_embeddings, dim]`` (a view of the parameter)."""
        offsets = self.layout.table_offsets
        return self.weight[offsets[table] : offsets[table + 1]].view(self.num_embeddings[table], self.configs[table].dim)

    def rows_of(self, ids: torch.Tensor, lengths_per_feature: list[int]) -> torch.Tensor:
        """Row of each id in its feature's table, on this module's device: the id itself for a raw feature (an id
        outside ``[0, num_embeddings)`` raises ``ValueError`` naming the feature, the id and the table's size), else
        ``id mod num_embeddings`` (the hashing trick: hashed ids, as the examples' local models fold them)."""
        counts = small_tensor(lengths_per_feature, self._rows_per_feature.device)
        modulus = torch.repeat_interleave(self._rows_per_feature, counts, output_size=ids.numel())
        ids = ids.to(modulus.device)
        if not self.raw_features:
            return torch.remainder(ids, modulus)
        raw = torch.repeat_interleave(self._raw_per_feature, counts, output_size=ids.numel())
        outside = raw & ((ids < 0) | (ids >= modulus))
        if bool(outside.any()):  # a read back from a GPU: the price of naming a bad id before it reads another row
            position = int(torch.nonzero(outside)[0, 0])
            feature = self.features[int(torch.searchsorted(torch.tensor(list(accumulate(lengths_per_feature))), position, right=True))]
            raise ValueError(f"feature {feature!r}: id {int(ids[position])} is outside its table of {int(modulus[position])} rows "
                             "kept on the trainers (ids: raw indexes rows directly; give the table more rows, or hash the ids)")
        return torch.where(raw, ids, torch.remainder(ids, modulus))

    def pooled(self, ids: torch.Tensor, offsets: torch.Tensor, pooling: str, per_sample_weights: Optional[torch.Tensor]) -> torch.Tensor:
        """Pooled embeddings ``[B, sum of feature dims]`` of this module's features (bags feature-major)."""
        if self._fused is None or self._fused.packed.device != self.weight.device:
            self._fused = FusedArguments.of(self.layout, self.weight.device)
        return pooled_lookup(self.weight, self.layout, ids, offsets, pooling, per_sample_weights, self._fused)

    @torch.no_grad()
    def apply_gradients(self, scale: Union[float, torch.Tensor], masked: Optional[bool] = None) -> None:
        """Runs each table's rule on the rows with a non-zero gradient (times ``scale``), then drops the gradient.

        Rows whose gradient is not finite (an AMP overflow) are left alone and counted in
        ``dropped_nonfinite_rows``, as the remote path drops them. A row touched with an exactly zero gradient
        is not updated (a shard would still run its rule on it: it differs only with weight decay or Adam).

        On the CPU the rule runs on the touched rows only (found with ``nonzero``). On a GPU finding them would read
        a count back from the device, a wait in every step: there (``masked``, the default off the CPU) the rule
        runs on every row and only the touched, finite ones take the result, which for tables this small costs
        the device little and the host nothing. Both give the same rows.
        """
        grad = self.weight.grad
        if grad is None:
            return
        masked = grad.device.type != "cpu" if masked is None else masked
        offsets = self.layout.table_offsets
        for first, stop, rule, bound in self._segments:
            rows = sum(self.num_embeddings[first:stop])
            weights = self.weight[offsets[first] : offsets[stop]].view(rows, rule.dim)
            grads = grad[offsets[first] : offsets[stop]].view(rows, rule.dim)
            state = self.optimizer_state[self._state_offsets[first] : self._state_offsets[stop]].view(rows, rule.state_width)
            if masked:
                self._apply_masked(rule, weights, state, grads, scale, bound)
                continue
            # A batch touches a small part of the rows: the rule runs on those only (NaN != 0, so a non-finite
            # row counts as touched, and is then dropped).
            touched = torch.nonzero(grads.ne(0).any(dim=1)).squeeze(1)
            finite = torch.isfinite(grads.index_select(0, touched)).all(dim=1)
            if not bool(finite.all()):
                self._dropped += int((~finite).sum())
                touched = touched[finite]
            if not touched.numel():
                continue
            _apply_rule(rule, weights, state, grads, touched, float(scale), bound)
        self.weight.grad = None

    def _apply_masked(self, rule: SparseRule, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor,
                      scale: Union[float, torch.Tensor], bound: Optional[float]) -> None:
        touched = grads.ne(0).any(dim=1)
        finite = torch.isfinite(grads).all(dim=1)
        dropped = (touched & ~finite).sum()
        self._dropped_on_device = dropped if self._dropped_on_device is None else self._dropped_on_device + dropped
        take = (touched & finite).unsqueeze(1)
        new_weights, new_state = weights.to(torch.float32, copy=True), state.clone()
        rule.apply(new_weights, new_state, torch.where(finite.unsqueeze(1), grads.float(), 0.0) * scale)
        if bound is not None:
            new_weights.clamp_(-bound, bound)
        weights.copy_(torch.where(take, new_weights.to(weights.dtype), weights))
        state.copy_(torch.where(take, new_state, state))

    def _apply(self, fn, recurse: bool = True):
        # ``.to(dtype)`` / ``.half()`` of the model (Lightning's "*-true" precisions) must not round the rule's
        # state: an Adagrad accumulator in bf16 stops growing.
        state = self.optimizer_state
        super()._apply(fn, recurse)
        moved = self.optimizer_state
        if moved.dtype != state.dtype:
            self._buffers["optimizer_state"] = state.to(moved.device)
        return self

    def extra_repr(self) -> str:
        return ", ".join(f"{c.name}: {n} rows, dim={c.dim}" for c, n in zip(self.configs, self.num_embeddings))
